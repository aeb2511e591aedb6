"""Qwen3-MoE model: architecture arguments, published flavors, and the plain-PyTorch model."""

from titanlab.models.qwen3_moe.args import Qwen3MoEModelArgs, qwen3_moe_flavors
from titanlab.models.qwen3_moe.model import Qwen3MoETransformer

__all__ = ["Qwen3MoEModelArgs", "Qwen3MoETransformer", "qwen3_moe_flavors"]
