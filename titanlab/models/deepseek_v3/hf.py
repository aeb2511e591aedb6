"""DeepSeek-V3 args ⇄ a Hugging Face `DeepseekV3ForCausalLM` config.json.

Written in the form of DeepSeek's published config (a legacy `rope_scaling` dict of type "yarn",
which vLLM reads, and the remote-code keys `scoring_func`, `topk_method`, `moe_layer_freq`).
Any DeepSeek-V3-architecture config imports (Moonlight's included): the args come from its
fields. Fields titanlab cannot honour are refused with one line; a DeepSeek-V2 config
(`model_type` deepseek_v2: softmax routing without the bias) does not import.
"""

from __future__ import annotations

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
from titanlab.models.common.moe import MoEArgs
from titanlab.models.common.rope import YarnScaling
from titanlab.models.deepseek_v3.args import DeepSeekV3ModelArgs

_HONOURED = {
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "pretraining_tp": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "rope_interleave": True,
}


def to_config(
    args: DeepSeekV3ModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `DeepseekV3ForCausalLM` of shape `args` (vocab resolved).

    Raises:
        ValueError: unresolved vocab size, an unsupported dtype, or routing Hugging Face's
            DeepSeek-V3 cannot express (softmax scores, the bias left out of the selection).
    """
    moe = args.moe
    if moe.score_func != "sigmoid" or not moe.route_bias:
        raise ValueError(
            "DeepseekV3ForCausalLM routes with sigmoid scores and the selection bias; these args "
            f"have score_func={moe.score_func!r}, route_bias={moe.route_bias}"
        )
    cfg = common_config(args, dtype, max_position_embeddings, bos, eos)
    del cfg["head_dim"]  # transformers derives it (qk_rope_head_dim)
    s = args.rope_scaling
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **cfg,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "first_k_dense_replace": args.n_dense_layers,
        "moe_intermediate_size": moe.hidden_dim,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.num_shared_experts,
        "num_experts_per_tok": moe.top_k,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "routed_scaling_factor": moe.route_scale,
        "norm_topk_prob": moe.route_norm,
        "rope_scaling": None if s is None else yarn_to_config(s),
        "rope_interleave": True,
        "num_nextn_predict_layers": args.mtp_layers,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }


def from_config(cfg: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """DeepSeek-V3 args of any `DeepseekV3ForCausalLM` config (vocab size from the config).

    Training defaults for what a config does not hold: the bias update speed 0.001 (the
    paper's γ), no auxiliary loss.

    Raises:
        ValueError: one line naming the first field titanlab's DeepSeek-V3 cannot honour (see
            `_HONOURED`; key-value heads other than the heads; a quantized checkpoint; a rope
            type other than default/yarn) or a missing size.
    """
    refuse_unsupported(cfg, _HONOURED, "deepseek_v3")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"config.json quantization_config (quant_method={method!r}) is not supported by "
            "titanlab's deepseek_v3; convert the checkpoint to bf16 first"
        )
    heads = require_int(cfg, "num_attention_heads")
    kv_heads = require_int(cfg, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise ValueError(
            f"config.json num_key_value_heads={kv_heads} is not supported by titanlab's "
            f"deepseek_v3 (needs num_attention_heads = {heads})"
        )
    theta, scaling = rope_from_config(cfg, ("default", "yarn"))
    assert scaling is None or isinstance(scaling, YarnScaling)
    moe = MoEArgs(
        num_experts=require_int(cfg, "n_routed_experts", cfg.get("num_local_experts")),
        top_k=require_int(cfg, "num_experts_per_tok"),
        hidden_dim=require_int(cfg, "moe_intermediate_size"),
        score_func="sigmoid",
        route_norm=bool(cfg.get("norm_topk_prob", False)),
        route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        n_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        route_bias=True,
        load_balance_coeff=0.0,
        load_balance_type="sequence",
        bias_update_speed=0.001,
    )
    return DeepSeekV3ModelArgs(
        dim=require_int(cfg, "hidden_size"),
        n_layers=require_int(cfg, "num_hidden_layers"),
        n_heads=heads,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=require_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=require_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=require_int(cfg, "qk_rope_head_dim"),
        v_head_dim=require_int(cfg, "v_head_dim"),
        hidden_dim=require_int(cfg, "intermediate_size"),
        n_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
        moe=moe,
        mtp_layers=int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0),
        vocab_size=require_int(cfg, "vocab_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=require_int(cfg, "max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


HF = HFMapping(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    to_config=to_config,
    from_config=from_config,
)
