"""The qwen3 family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.common.counting import flops_per_token
from titanlab.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from titanlab.models.qwen3.hf import HF
from titanlab.models.qwen3.model import Qwen3Transformer
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3",
    description="Qwen3 dense (GQA with per-head q/k RMSNorm, explicit head_dim, SwiGLU)",
    args_cls=Qwen3ModelArgs,
    flavors=qwen3_flavors,
    model_cls=Qwen3Transformer,
    flops_per_token=flops_per_token,
    hf=HF,
)
