"""A model for generation from a titanlab DCP checkpoint (any layout) or a Hugging Face folder."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, cast

import torch
from torch import nn

from titanlab.checkpoint.streaming import DcpModelReader
from titanlab.models.common.decoder import Decoder
from titanlab.models.registry import ModelFamily
from titanlab.models.stored_args import read_model_args


def load_model(
    path: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, ModelFamily, Any]:
    """(model in eval mode on `device` in `dtype`, its family, its args) from `path`: a DCP
    folder (`step-N` or `export-step-N` of any parallel layout; `model_args.json` gives the
    shape) or a Hugging Face folder (`config.json` + safetensors, imported as
    `convert_checkpoint from-hf` does). The export of a LoRA or QLoRA run loads with its
    adapters merged (W + alpha/r · B A, `titanlab.checkpoint.peft_export.LoraMerger`).

    Raises:
        ValueError: one line when `path` is neither, is incomplete, or has no model args.
    """
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is not a folder; give a step-N, export-step-N or "
                         "Hugging Face folder")  # fmt: skip
    if os.path.isfile(os.path.join(path, "config.json")):
        from titanlab.checkpoint.convert import hf_to_dcp

        with tempfile.TemporaryDirectory(prefix="titanlab-hf-") as tmp:
            dcp = os.path.join(tmp, "model")
            hf_to_dcp(path, dcp, overwrite=True, progress=False)
            return load_model(dcp, device, dtype)
    stored = read_model_args(path)
    if stored is None:
        raise ValueError(
            f"checkpoint {path!r} has no model_args.json nor config.json; give a folder "
            "titanlab saved (checkpoint/step-N, export-step-N) or a Hugging Face folder"
        )
    family, _, args = stored
    reader = DcpModelReader(path)
    state = _weights(reader, path)
    if "tok_embeddings.weight" not in state:
        raise ValueError(f"checkpoint {path!r} holds no model weights (tok_embeddings.weight)")
    vocab = state["tok_embeddings.weight"].shape[0]
    args = dataclasses.replace(args, vocab_size=vocab)
    with torch.device("meta"):
        model = cast(Decoder, family.model_cls(args))
    model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rope_")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match its model_args.json: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    model.reset_rope(device)  # to_empty left the RoPE tables uninitialized
    return model.to(dtype).eval(), family, args


def _weights(reader: DcpModelReader, path: str) -> dict[str, torch.Tensor]:
    """The model's weights from `reader`, LoRA adapters merged into their base weights.

    Raises:
        ValueError: one line for adapters without their base (a LoRA run's step checkpoint).
    """
    from titanlab.checkpoint.peft_export import LoraMerger, adapter_pairs

    pairs = adapter_pairs(reader.tensors)
    if not pairs:
        return {name: reader.load(name) for name in reader.tensors}
    if any(base not in reader.tensors for base in pairs):
        raise ValueError(
            f"checkpoint {path!r} holds LoRA adapters without their base (a step checkpoint of "
            "a LoRA run); give the run's export-step-N folder, which has both"
        )
    merger = LoraMerger(reader, path)
    return {
        name: merger.merged(name).to(reader.load(name).dtype)
        if name in pairs
        else reader.load(name)
        for name in reader.tensors
        if name not in merger.adapter_names
    }
