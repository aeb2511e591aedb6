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
import typing
from typing import Any

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


def _from_dict(cls: type, fields: dict[str, Any]) -> Any:
    """`cls(**fields)` with nested dataclass fields (RoPE scaling, MoE args) rebuilt from their
    dicts and JSON lists turned back into tuples."""
    hints = typing.get_type_hints(cls)
    out = {}
    for name, value in fields.items():
        hint = hints.get(name)
        if isinstance(value, dict):
            nested = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
            if not nested:
                raise TypeError(f"field {name!r} is not a dataclass")
            value = _from_dict(typing.cast(type, nested[0]), value)
        elif isinstance(value, list):
            value = tuple(value)
        out[name] = value
    return cls(**out)


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
        args = _from_dict(family.args_cls, dict(record["args"]))
        args.validate()
        return family, str(record.get("flavor", HF_FLAVOR)), args
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a valid titanlab model_args.json: {e}") from None
