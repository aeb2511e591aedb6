"""The model args stored next to a checkpoint: `model_args.json` in a DCP folder.

titanlab writes it into every checkpoint it saves and into every folder `convert_checkpoint
from-hf` creates, so a model of any shape (not only a published flavor) can be trained from
(`checkpoint.initial_load_path` with `model.flavor = "hf"`) and exported (`to-hf` without
`--flavor`). The file is plain JSON: {"name": family, "flavor": published flavor or "hf",
"args": the args dataclass's fields}.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from titanlab.models.common.rope import RopeScaling
from titanlab.models.registry import ModelFamily, get_family, matching_flavor

MODEL_ARGS_FILE = "model_args.json"
HF_FLAVOR = "hf"
"""The `model.flavor` value meaning "the args of a Hugging Face config / stored checkpoint"."""


def write_model_args(folder: str, family: ModelFamily, args: Any) -> str:
    """Write `<folder>/model_args.json` for `args` of `family`; returns the path."""
    record = {
        "name": family.name,
        "flavor": matching_flavor(family, args) or HF_FLAVOR,
        "args": dataclasses.asdict(args),
    }
    path = os.path.join(folder, MODEL_ARGS_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return path


def read_model_args(folder: str) -> tuple[ModelFamily, str, Any] | None:
    """(family, flavor name or "hf", args) stored in `folder`, or None when it has no file.

    Raises:
        ValueError: one line when the file is not a valid record (naming the path and field).
    """
    path = os.path.join(folder, MODEL_ARGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        family = get_family(record["name"])
        fields = dict(record["args"])
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        args = family.args_cls(**fields)
        args.validate()
        return family, str(record.get("flavor", HF_FLAVOR)), args
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid titanlab model_args.json: {e}") from None
