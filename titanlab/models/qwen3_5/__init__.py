"""Qwen3.5 models, dense (`qwen3_5`) and MoE (`qwen3_5_moe`): architecture arguments, published
flavors, and the plain-PyTorch model."""

from titanlab.models.qwen3_5.args import Qwen35ModelArgs, qwen3_5_flavors
from titanlab.models.qwen3_5.model import Qwen35Transformer
from titanlab.models.qwen3_5.moe_args import Qwen35MoEModelArgs, qwen3_5_moe_flavors

__all__ = [
    "Qwen35MoEModelArgs",
    "Qwen35ModelArgs",
    "Qwen35Transformer",
    "qwen3_5_flavors",
    "qwen3_5_moe_flavors",
]
