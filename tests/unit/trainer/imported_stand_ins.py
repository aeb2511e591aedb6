"""Stand-ins for the files a shipped config's header tells the user to make first (an imported
Hugging Face model, a tokenizer), for dry runs: a folder holding what the dry run reads of an
import, its `model_args.json` and the DCP index (`.metadata`) of its weights, and no weight."""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from titanlab.models.registry import build_model, family_of_args
from titanlab.models.stored_args import write_model_args


def imported_folder(folder: str, args: Any, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write `folder` as `convert_checkpoint from-hf` would index a model of `args`: every
    weight's name and shape under "model.", no data file (none is listed, so the folder reads
    as complete). Returns `folder`."""
    os.makedirs(folder, exist_ok=True)
    write_model_args(folder, family_of_args(args), args)
    with torch.device("meta"):
        model = build_model(args)
    entries = {
        f"model.{name}": TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype),
            size=p.shape,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * p.dim()), sizes=p.shape)],
        )
        for name, p in model.state_dict().items()
    }
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=entries, storage_data={}), f)  # type: ignore[arg-type]
    return folder
