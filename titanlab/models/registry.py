"""The model registry: `model.name` → the family that builds, shards, converts and counts it.

A family is a folder `titanlab/models/<name>/` whose `family.py` defines `FAMILY`, a
`ModelFamily` declaring in one place its args dataclass and published flavors, the plain-PyTorch
model, its tensor-parallel block plan, its Hugging Face state-dict adapter and config mapping,
and its FLOPs-per-token formula. The trainer, pre-flight, memory estimator, benchmark,
`convert_checkpoint` and `--help` ask this registry; adding a family is a folder plus one line in
`FAMILIES` (the checklist is in `titanlab/models/README.md`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

FAMILIES: dict[str, str] = {
    "llama3": "titanlab.models.llama3.family",
    "qwen3": "titanlab.models.qwen3.family",
    "qwen3_moe": "titanlab.models.qwen3_moe.family",
    "deepseek_v3": "titanlab.models.deepseek_v3.family",
    "gpt_oss": "titanlab.models.gpt_oss.family",
    "qwen3_5": "titanlab.models.qwen3_5.family",
    "qwen3_5_moe": "titanlab.models.qwen3_5.moe_family",
}
"""Family name → module defining `FAMILY`. Imported on first use."""

DEFAULT_FAMILY = "llama3"
"""`model.name` when none is given (and the family of a checkpoint that does not say)."""


@dataclass(frozen=True)
class ModelFamily:
    """Everything titanlab needs to know about one architecture.

    Attributes:
        name: the `model.name` value, e.g. "qwen3".
        description: one line for `--help` and logs.
        args_cls: the args dataclass (fields are the architecture's hyper-parameters).
        flavors: published sizes, name → args with vocab_size set or -1 (from the tokenizer).
        model_cls: builds the plain-PyTorch model from args (meta device friendly).
        flops_per_token: (args, seq_len, non-embedding parameter count) → training FLOPs/token.
        hf: the Hugging Face mapping (`titanlab.models.common.hf_config.HFMapping`).
    """

    name: str
    description: str
    args_cls: type
    flavors: Mapping[str, Any]
    model_cls: Callable[[Any], nn.Module]
    flops_per_token: Callable[[Any, int, int], int]
    hf: Any


def get_family(name: str) -> ModelFamily:
    """The family registered as `name`.

    Raises:
        ValueError: one line naming `name` and the valid names.
    """
    module = FAMILIES.get(name)
    if module is None:
        raise ValueError(f"model.name={name!r} is unknown; valid: {', '.join(FAMILIES)}")
    family = importlib.import_module(module).FAMILY
    assert isinstance(family, ModelFamily) and family.name == name, module
    return family


def family_of_hf_config(cfg: Mapping[str, Any]) -> ModelFamily:
    """The family whose Hugging Face `model_type` is `cfg["model_type"]`.

    Raises:
        ValueError: one line naming the model_type and the supported ones.
    """
    model_type = cfg.get("model_type")
    types = {}
    for name in FAMILIES:
        family = get_family(name)
        for model_type_ in (family.hf.model_type, *family.hf.aliases):
            types[model_type_] = family
    if model_type not in types:
        raise ValueError(f"config.json model_type={model_type!r}; valid: {', '.join(types)}")
    return types[model_type]


def get_flavor(family: ModelFamily, flavor: str) -> Any:
    """`family.flavors[flavor]`.

    Raises:
        ValueError: one line naming the flavor and the family's valid ones.
    """
    if flavor not in family.flavors:
        raise ValueError(
            f"model.flavor={flavor!r} is unknown for model.name={family.name!r}; valid: "
            f"{', '.join(family.flavors)}"
        )
    return family.flavors[flavor]


def same_architecture(family: ModelFamily, a: Any, b: Any) -> bool:
    """Whether args `a` and `b` of `family` describe one architecture (vocab size, RoPE table
    length and MoE load-balancing options aside: the last are training choices), compared
    through the family's Hugging Face config (so `hidden_dim` 704 equals `multiple_of` 64's
    rounding of the same width)."""
    import dataclasses

    import torch

    def shape(x: Any) -> dict:
        x = dataclasses.replace(x, vocab_size=max(a.vocab_size, 1), max_seq_len=1)
        if hasattr(x, "moe"):
            moe = dataclasses.replace(x.moe, load_balance_coeff=0.0, bias_update_speed=0.0)
            x = dataclasses.replace(x, moe=moe)
        return family.hf.to_config(x, torch.float32, 1, None, None)

    return shape(a) == shape(b)


def matching_flavor(family: ModelFamily, args: Any) -> str | None:
    """The published flavor whose architecture `args` has (`same_architecture`); None for a
    custom shape."""
    for name, flavor_args in family.flavors.items():
        if same_architecture(family, args, flavor_args):
            return name
    return None


def family_of_args(args: Any) -> ModelFamily:
    """The family whose args dataclass `args` is an instance of.

    Raises:
        ValueError: `args` belongs to no registered family.
    """
    for name in FAMILIES:
        family = get_family(name)
        if type(args) is family.args_cls:
            return family
    raise ValueError(f"{type(args).__name__} is the args of no registered model family")


def build_model(args: Any) -> nn.Module:
    """The plain-PyTorch model of `args` (its family's `model_cls`), on the current device
    (wrap in `torch.device("meta")` for shapes only)."""
    return family_of_args(args).model_cls(args)


def format_families() -> str:
    """The `--help` section listing every family with its description and flavors."""
    lines = ["model families (model.name → model.flavor):"]
    for name in FAMILIES:
        family = get_family(name)
        lines.append(f"  {name}: {family.description}")
        lines.append(f"      flavors: {', '.join(family.flavors)}, or hf (model.hf_config)")
    return "\n".join(lines)
