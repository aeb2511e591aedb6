"""`peft.json`: the LoRA settings stored beside the weights of every checkpoint folder of a LoRA
run (the adapter shapes give the rank; alpha and the targets are only here)."""

from __future__ import annotations

import dataclasses
import json
import os

from titanlab.config.peft import Peft

PEFT_FILE = "peft.json"


def write_peft_config(folder: str, cfg: Peft) -> str:
    """Write `<folder>/peft.json`; returns its path."""
    path = os.path.join(folder, PEFT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
        f.write("\n")
    return path


def read_peft_config(folder: str) -> Peft | None:
    """The `Peft` stored in `folder`, or None when it has no peft.json.

    Raises:
        ValueError: one line when the file is not a valid record.
    """
    path = os.path.join(folder, PEFT_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cfg = Peft(**json.load(f))
        cfg.validate()
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a valid LoRA record: {e}") from None
    return cfg
