"""Llama 3.1 8B's dims with fewer blocks, as the GPU rows ran them (`tools/gpu_check.py`: 11 of
32 blocks, the most one 80 GB GPU holds with AC none), for the per-op ledger's tools."""

from __future__ import annotations

import dataclasses
import json
import os

LAYERS = 11


def model_args(folder: str, layers: int = LAYERS) -> list[str]:
    """Options for Llama 3.1 8B's dims with `layers` blocks and its 128,256-id vocabulary (a
    config.json written in `folder`)."""
    import torch

    from titanlab.models.registry import get_family

    family = get_family("llama3")
    args = dataclasses.replace(family.flavors["8B"], n_layers=layers, vocab_size=128256)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(family.hf.to_config(args, torch.bfloat16, 8192, None, None), f)
    return ["--model.flavor", "hf", "--model.hf_config", folder]
