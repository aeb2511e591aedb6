"""Qwen3.5-MoE args ⇄ a Hugging Face `Qwen3_5MoeForCausalLM` config.json (`model_type`
"qwen3_5_moe_text"; a published multimodal "qwen3_5_moe" config's `text_config` imports too,
as for the dense family: `hf.py`). `router_aux_loss_coef` maps to the load-balance weight.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlab.models.common.hf_config import HFMapping, refuse_unsupported, require_int
from titanlab.models.qwen3_5 import hf as dense_hf
from titanlab.models.qwen3_5.moe_args import Qwen35MoEModelArgs, qwen3_5_moe


def to_config(
    args: Qwen35MoEModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `Qwen3_5MoeForCausalLM` of shape `args` (vocab resolved).

    Raises:
        ValueError: unresolved vocab size, an unsupported dtype, or MoE settings the Hugging
            Face model cannot express (anything but softmax top-k renormalized, one gated
            shared expert, route scale 1, no group-limited routing or routing bias).
    """
    moe = args.moe
    if (
        moe.score_func != "softmax" or not moe.route_norm or moe.num_shared_experts != 1
        or not moe.shared_gate or moe.route_scale != 1.0 or moe.n_groups != 1 or moe.route_bias
        or moe.gate_bias or moe.activation != "swiglu"
    ):  # fmt: skip
        raise ValueError(
            "Qwen3_5MoeForCausalLM routes by softmax top-k renormalized with one gated shared "
            f"expert; these args have score_func={moe.score_func!r}, route_norm={moe.route_norm}"
            f", num_shared_experts={moe.num_shared_experts}, shared_gate={moe.shared_gate}, "
            f"route_scale={moe.route_scale}, n_groups={moe.n_groups}, "
            f"route_bias={moe.route_bias}, gate_bias={moe.gate_bias}"
        )
    cfg = dense_hf.to_config(args, dtype, max_position_embeddings, bos, eos)
    del cfg["intermediate_size"]  # no dense block
    return {
        **cfg,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "shared_expert_intermediate_size": moe.shared_hidden_dim or moe.hidden_dim,
        "router_aux_loss_coef": moe.load_balance_coeff,
        "output_router_logits": False,
    }


def from_config(cfg: dict[str, Any]) -> Qwen35MoEModelArgs:
    """Qwen3.5-MoE args of any `Qwen3_5MoeForCausalLM` (or multimodal) config.

    Raises:
        ValueError: one line naming the first field titanlab cannot honour, or a missing size.
    """
    cfg = dense_hf.text_config(cfg, "qwen3_5_moe")
    refuse_unsupported(cfg, {"model_type": "qwen3_5_moe_text"}, "qwen3_5_moe")
    moe_dim = require_int(cfg, "moe_intermediate_size")
    moe = qwen3_5_moe(
        require_int(cfg, "num_experts"),
        require_int(cfg, "num_experts_per_tok"),
        moe_dim,
        require_int(cfg, "shared_expert_intermediate_size"),
    )
    moe.load_balance_coeff = float(cfg.get("router_aux_loss_coef", 0.001))
    return Qwen35MoEModelArgs(
        **dense_hf.dense_fields(cfg, "qwen3_5_moe"),
        hidden_dim=require_int(cfg, "intermediate_size", moe_dim),
        moe=moe,
    )


HF = HFMapping(
    model_type="qwen3_5_moe_text",
    architecture="Qwen3_5MoeForCausalLM",
    to_config=to_config,
    from_config=from_config,
    aliases=("qwen3_5_moe",),
)
