"""The gpt_oss family for the model registry (`titanlab.models.registry`)."""

from __future__ import annotations

from titanlab.models.gpt_oss.args import GptOssModelArgs, gpt_oss_flavors
from titanlab.models.gpt_oss.counting import gpt_oss_flops_per_token
from titanlab.models.gpt_oss.hf import HF
from titanlab.models.gpt_oss.model import GptOssTransformer
from titanlab.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="gpt_oss",
    description=(
        "gpt-oss (sliding-window and full attention in alternation with learned sinks; "
        "biased top-k MoE with clamped SwiGLU)"
    ),
    args_cls=GptOssModelArgs,
    flavors=gpt_oss_flavors,
    model_cls=GptOssTransformer,
    flops_per_token=gpt_oss_flops_per_token,
    hf=HF,
)
