"""The deepseek_v3 family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.common.counting import flops_per_token
from titanlab.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_flavors
from titanlab.models.deepseek_v3.hf import HF
from titanlab.models.deepseek_v3.model import DeepSeekV3Transformer
from titanlab.models.registry import ModelFamily


FAMILY = ModelFamily(
    name="deepseek_v3",
    description=(
        "DeepSeek-V3 (multi-head latent attention; dense first blocks, then shared + "
        "group-limited sigmoid-routed experts)"
    ),
    args_cls=DeepSeekV3ModelArgs,
    flavors=deepseek_v3_flavors,
    model_cls=DeepSeekV3Transformer,
    flops_per_token=flops_per_token,
    hf=HF,
)
