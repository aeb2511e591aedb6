"""Llama 3 model: architecture arguments, published flavors, and the plain-PyTorch model."""

from titanlab.models.llama3.args import RopeScaling, TransformerModelArgs, llama3_flavors
from titanlab.models.llama3.model import (
    Transformer,
    count_params,
    flops_per_token,
    get_nparams_and_flops,
)

__all__ = [
    "RopeScaling",
    "Transformer",
    "TransformerModelArgs",
    "count_params",
    "flops_per_token",
    "get_nparams_and_flops",
    "llama3_flavors",
]
