"""The qwen3_moe family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.common.counting import flops_per_token
from titanlab.models.qwen3_moe.args import Qwen3MoEModelArgs, qwen3_moe_flavors
from titanlab.models.qwen3_moe.hf import HF
from titanlab.models.qwen3_moe.model import Qwen3MoETransformer
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_moe",
    description="Qwen3-MoE (Qwen3 attention; token-choice top-k routed SwiGLU experts)",
    args_cls=Qwen3MoEModelArgs,
    flavors=qwen3_moe_flavors,
    model_cls=Qwen3MoETransformer,
    flops_per_token=flops_per_token,
    hf=HF,
)
