"""Qwen3 dense model: architecture arguments, published flavors, and the plain-PyTorch model."""

from titanlab.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from titanlab.models.qwen3.model import Qwen3Transformer

__all__ = ["Qwen3ModelArgs", "Qwen3Transformer", "qwen3_flavors"]
