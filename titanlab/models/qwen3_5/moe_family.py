"""The qwen3_5_moe family for the model registry (`titanlab.models.registry`): Qwen3.5's
hybrid decoder with MoE blocks, kept in the qwen3_5 folder beside the dense family."""

from __future__ import annotations

from titanlab.models.qwen3_5.counting import qwen3_5_flops_per_token
from titanlab.models.qwen3_5.model import Qwen35Transformer
from titanlab.models.qwen3_5.moe_args import Qwen35MoEModelArgs, qwen3_5_moe_flavors
from titanlab.models.qwen3_5.moe_hf import HF
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="qwen3_5_moe",
    description="Qwen3.5-MoE hybrid (Qwen3.5's linear and gated full attention; softmax "
    "top-k routed experts plus a gated shared expert)",
    args_cls=Qwen35MoEModelArgs,
    flavors=qwen3_5_moe_flavors,
    model_cls=Qwen35Transformer,
    flops_per_token=qwen3_5_flops_per_token,
    hf=HF,
)
