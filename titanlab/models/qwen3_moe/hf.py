"""Qwen3-MoE args ⇄ a Hugging Face `Qwen3MoeForCausalLM` config.json.

Any Qwen3-MoE-architecture config imports (its args derived from the fields, sparse-step and
dense-layer rules included). `router_aux_loss_coef` maps to the load-balance weight. Fields
titanlab's Qwen3-MoE cannot honour (attention bias, sliding windows, rope scaling, an activation
other than silu) are refused with one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titanlab.models.common.hf_config import HFMapping, refuse_unsupported, require_int
from titanlab.models.common.moe import MoEArgs
from titanlab.models.qwen3 import hf as qwen3_hf
from titanlab.models.qwen3.args import Qwen3ModelArgs
from titanlab.models.qwen3_moe.args import Qwen3MoEModelArgs


def to_config(
    args: Qwen3MoEModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `Qwen3MoeForCausalLM` of shape `args` (vocab resolved).

    Raises:
        ValueError: unresolved vocab size, an unsupported dtype, or MoE settings Hugging Face's
            Qwen3-MoE cannot express (sigmoid scores, shared experts, a route scale,
            group-limited routing, a routing bias).
    """
    moe = args.moe
    if (
        moe.score_func != "softmax"
        or moe.num_shared_experts
        or moe.route_scale != 1.0
        or moe.n_groups != 1
        or moe.route_bias
    ):
        raise ValueError(
            "Qwen3MoeForCausalLM routes with softmax over all experts, no shared experts, "
            f"route_scale 1 and no routing bias; these args have score_func={moe.score_func!r}, "
            f"num_shared_experts={moe.num_shared_experts}, route_scale={moe.route_scale}, "
            f"n_groups={moe.n_groups}, route_bias={moe.route_bias}"
        )
    dense = {f.name: getattr(args, f.name) for f in dataclasses.fields(Qwen3ModelArgs)}
    cfg = qwen3_hf.to_config(Qwen3ModelArgs(**dense), dtype, max_position_embeddings, bos, eos)
    return {
        **cfg,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "norm_topk_prob": moe.route_norm,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "router_aux_loss_coef": moe.load_balance_coeff,
        "output_router_logits": False,
    }


def from_config(cfg: dict[str, Any]) -> Qwen3MoEModelArgs:
    """Qwen3-MoE args of any `Qwen3MoeForCausalLM` config (vocab size from the config).

    Raises:
        ValueError: one line naming the first field titanlab's Qwen3-MoE cannot honour, or a
            missing size.
    """
    refuse_unsupported(cfg, {"model_type": "qwen3_moe"}, "qwen3_moe")
    dense = qwen3_hf.from_config({**cfg, "model_type": "qwen3"})
    moe = MoEArgs(
        # Published files say num_experts; transformers >= 5 writes num_local_experts.
        num_experts=require_int(cfg, "num_experts", cfg.get("num_local_experts")),
        top_k=require_int(cfg, "num_experts_per_tok"),
        hidden_dim=require_int(cfg, "moe_intermediate_size"),
        score_func="softmax",
        route_norm=bool(cfg.get("norm_topk_prob", False)),
        load_balance_coeff=float(cfg.get("router_aux_loss_coef", 0.001)),
    )
    return Qwen3MoEModelArgs(
        **dataclasses.asdict(dense),
        moe=moe,
        decoder_sparse_step=require_int(cfg, "decoder_sparse_step", 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


HF = HFMapping(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    to_config=to_config,
    from_config=from_config,
)
