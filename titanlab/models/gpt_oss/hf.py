"""gpt-oss args ⇄ a Hugging Face `GptOssForCausalLM` config.json.

Any gpt-oss-architecture config imports, the released ones included (their MXFP4 expert
weights are dequantized by the converter: `titanlab.models.common.mxfp4`). Fields titanlab's
gpt-oss cannot honour (dropout, an activation other than the clamped SwiGLU config.json calls
"silu", a quantization other than MXFP4, a RoPE type other than YaRN or none) are refused with
one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from titanlab.models.common.hf_config import (
    HFMapping,
    common_config,
    refuse_unsupported,
    require_int,
    rope_from_config,
    yarn_to_config,
)
from titanlab.models.common.rope import YarnScaling
from titanlab.models.gpt_oss.args import LAYER_TYPES, GptOssModelArgs, gpt_oss_moe

_HONOURED = {
    "model_type": "gpt_oss",
    "hidden_act": "silu",
    "attention_dropout": 0.0,
}


def to_config(
    args: GptOssModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `GptOssForCausalLM` of shape `args` (vocab resolved).

    Raises:
        ValueError: unresolved vocab size, an unsupported dtype, args without sinks, or MoE
            settings Hugging Face's gpt-oss cannot express.
    """
    moe = args.moe
    if (
        moe.activation != "clamped_swiglu"
        or not moe.gate_bias
        or moe.score_func != "softmax"
        or not moe.route_norm
        or moe.num_shared_experts
        or moe.route_scale != 1.0
        or moe.n_groups != 1
        or moe.route_bias
        or not args.attention_sinks
    ):
        raise ValueError(
            "GptOssForCausalLM has attention sinks, a biased gate with a softmax over the top-k "
            "logits and clamped-SwiGLU experts, and nothing else; these args have "
            f"attention_sinks={args.attention_sinks}, activation={moe.activation!r}, "
            f"gate_bias={moe.gate_bias}, score_func={moe.score_func!r}, "
            f"route_norm={moe.route_norm}, num_shared_experts={moe.num_shared_experts}, "
            f"route_scale={moe.route_scale}, n_groups={moe.n_groups}, route_bias={moe.route_bias}"
        )
    cfg = common_config(args, dtype, max_position_embeddings, bos, eos)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        legacy = yarn_to_config(args.rope_scaling)
        del legacy["type"]
        rope = {**legacy, "rope_theta": args.rope_theta, "truncate": args.rope_scaling.truncate}
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **cfg,
        "attention_bias": args.attention_bias,
        "rope_parameters": rope,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.resolved_layer_types()),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "experts_per_token": moe.top_k,
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.load_balance_coeff,
        "output_router_logits": False,
    }


def from_config(cfg: dict[str, Any]) -> GptOssModelArgs:
    """gpt-oss args of any `GptOssForCausalLM` config (vocab size from the config).

    Raises:
        ValueError: one line naming the first field titanlab's gpt-oss cannot honour, or a
            missing or bad size.
    """
    refuse_unsupported(cfg, _HONOURED, "gpt_oss")
    quant = cfg.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise ValueError(
            f"config.json quantization_config.quant_method={quant.get('quant_method')!r} is not "
            "supported by titanlab's gpt_oss (valid: mxfp4, dequantized on import, or none)"
        )
    theta, scaling = rope_from_config(cfg, ("default", "yarn"))
    if scaling is not None and not isinstance(scaling, YarnScaling):
        raise ValueError(f"config.json rope scaling {scaling} is not supported by gpt_oss")
    n_layers = require_int(cfg, "num_hidden_layers")
    layer_types = tuple(cfg.get("layer_types") or ())
    for kind in layer_types:
        if kind not in LAYER_TYPES:
            raise ValueError(f"config.json layer_types entry {kind!r}; valid: {LAYER_TYPES}")
    if layer_types and len(layer_types) != n_layers:
        raise ValueError(
            f"config.json layer_types has {len(layer_types)} entries for "
            f"num_hidden_layers={n_layers}"
        )
    window = require_int(cfg, "sliding_window", 128)
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4))
    moe = dataclasses.replace(
        gpt_oss_moe(
            require_int(cfg, "num_local_experts", cfg.get("num_experts")),
            require_int({"num_experts_per_tok": top_k}, "num_experts_per_tok"),
            require_int(cfg, "intermediate_size"),
            float(cfg.get("router_aux_loss_coef", 0.001)),
        ),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    args = GptOssModelArgs(
        dim=require_int(cfg, "hidden_size"),
        n_layers=n_layers,
        n_heads=require_int(cfg, "num_attention_heads"),
        n_kv_heads=require_int(cfg, "num_key_value_heads"),
        head_dim=require_int(cfg, "head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        vocab_size=require_int(cfg, "vocab_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=require_int(cfg, "max_position_embeddings"),
        sliding_window=window,
        layer_types=layer_types,
        attention_bias=bool(cfg.get("attention_bias", True)),
        moe=moe,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    args.validate()
    return args


HF = HFMapping(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    to_config=to_config,
    from_config=from_config,
)
