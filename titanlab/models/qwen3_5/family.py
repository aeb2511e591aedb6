"""The qwen3_5 family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.qwen3_5.counting import qwen3_5_flops_per_token
from titanlab.models.qwen3_5.args import Qwen35ModelArgs, qwen3_5_flavors
from titanlab.models.qwen3_5.hf import HF
from titanlab.models.qwen3_5.model import Qwen35Transformer
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_5",
    description="Qwen3.5 dense hybrid (3 Gated DeltaNet linear-attention layers per gated "
    "full-attention layer, partial RoPE, SwiGLU)",
    args_cls=Qwen35ModelArgs,
    flavors=qwen3_5_flavors,
    model_cls=Qwen35Transformer,
    flops_per_token=qwen3_5_flops_per_token,
    hf=HF,
)
