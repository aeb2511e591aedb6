"""What both conversion directions share: dtypes by name, sizes, the expected state-dict
shapes of a model, which model a DCP folder holds, and the output folder."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

import torch

from titanlab.checkpoint.streaming import (
    ConversionError,
)
from titanlab.models.registry import (
    DEFAULT_FAMILY,
    ModelFamily,
    get_family,
    get_flavor,
)
from titanlab.models.stored_args import read_model_args

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX = "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """Bytes in `text`: an int, or a number with KB/MB/GB (powers of 1000) or KiB/MiB/GiB.

    Raises:
        ConversionError: not a positive size.
    """
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "b": 1,
    }
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            t, mult = t[: -len(unit)], factor
            break
    else:
        mult = 1
    try:
        size = int(float(t) * mult)
    except ValueError:
        size = 0
    if size <= 0:
        raise ConversionError(
            f"size {text!r} is not a positive size; e.g. 5GB, 500MB, 2GiB or bytes"
        )
    return size


def expected_shapes(family: ModelFamily, args: Any) -> dict[str, tuple[int, ...]]:
    """titanlab state-dict names → shapes of a `family` model of `args` (vocab_size resolved),
    in state-dict order; built on the meta device, so no memory."""
    with torch.device("meta"):
        model = family.model_cls(dataclasses.replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def resolve_dcp_model(
    dcp_dir: str, model_name: str | None, flavor: str | None, model_args: Any, vocab: int
) -> tuple[ModelFamily, Any, str]:
    """(family, args with `vocab`, label for messages) of a DCP checkpoint: explicit
    `model_args`, else a named flavor, else the folder's `model_args.json`, else the default family's
    debugmodel."""
    stored = read_model_args(dcp_dir)
    if model_args is not None:
        family, label = get_family(model_name or DEFAULT_FAMILY), "the given model args"
    elif flavor is None and stored is not None:
        family, name, model_args = stored
        label = f"{family.name} model of {dcp_dir}/model_args.json ({name})"
    else:
        family = get_family(model_name or (stored[0].name if stored else DEFAULT_FAMILY))
        flavor = flavor or "debugmodel"
        try:
            model_args, label = get_flavor(family, flavor), f"flavor {flavor!r}"
        except ValueError as e:
            raise ConversionError(str(e)) from None
    args = dataclasses.replace(model_args, vocab_size=vocab)
    args.validate()
    return family, args, label


def prepare_out_dir(path: str, overwrite: bool) -> None:
    if os.path.isdir(path) and os.listdir(path):
        if not overwrite:
            raise ConversionError(
                f"output folder {path!r} exists and is not empty; "
                "choose a new folder or pass --overwrite"
            )
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)


def write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
