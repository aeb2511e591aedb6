"""The llama3 family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.common.counting import flops_per_token
from titanlab.models.llama3.args import TransformerModelArgs, llama3_flavors
from titanlab.models.llama3.hf import HF
from titanlab.models.llama3.model import Transformer
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="llama3",
    description="Llama 3 / 3.1 / 3.2 (GQA, RoPE with Llama 3.1 scaling, SwiGLU)",
    args_cls=TransformerModelArgs,
    flavors=llama3_flavors,
    model_cls=Transformer,
    flops_per_token=flops_per_token,
    hf=HF,
)
