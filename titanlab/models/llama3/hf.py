"""Llama 3 args ⇄ a Hugging Face `LlamaForCausalLM` config.json.

Written in the form of Meta's published Llama 3.1 / 3.2 folders (`rope_scaling` of type `llama3`
next to `rope_theta`); read from that form or from the one transformers >= 5 writes
(`rope_parameters`). Any Llama-architecture config imports (SmolLM-, TinyLlama-shaped, ...):
the args are derived from its fields, not matched against the flavors.
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
)
from titanlab.models.common.rope import RopeScaling
from titanlab.models.llama3.args import TransformerModelArgs


def to_config(
    args: TransformerModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `LlamaForCausalLM` of shape `args` (vocab_size resolved).

    Raises:
        ValueError: unresolved vocab size or an unsupported dtype.
    """
    s = args.rope_scaling
    rope_scaling = (
        None
        if s is None
        else {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    )
    cfg = common_config(args, dtype, max_position_embeddings, bos, eos)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **cfg,
        "rope_scaling": rope_scaling,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def from_config(cfg: dict[str, Any]) -> TransformerModelArgs:
    """Llama args of any `LlamaForCausalLM` config (vocab_size from the config).

    Raises:
        ValueError: one line naming the first field titanlab's Llama cannot honour (biases, an
            activation other than silu, dropout, a rope type other than default/llama3, a
            head_dim other than hidden_size / num_attention_heads) or a missing size.
    """
    refuse_unsupported(
        cfg,
        {
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
        },
        "llama3",
    )
    dim = require_int(cfg, "hidden_size")
    heads = require_int(cfg, "num_attention_heads")
    head_dim = cfg.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise ValueError(
            f"config.json head_dim={head_dim} is not supported by titanlab's llama3 "
            f"(needs hidden_size / num_attention_heads = {dim / heads:g})"
        )
    theta, scaling = rope_from_config(cfg, ("default", "llama3"))
    assert scaling is None or isinstance(scaling, RopeScaling)  # "yarn" is not allowed
    return TransformerModelArgs(
        dim=dim,
        n_layers=require_int(cfg, "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=require_int(cfg, "num_key_value_heads", heads),
        vocab_size=require_int(cfg, "vocab_size"),
        hidden_dim=require_int(cfg, "intermediate_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=require_int(cfg, "max_position_embeddings", 2048),
    )


HF = HFMapping(
    model_type="llama",
    architecture="LlamaForCausalLM",
    to_config=to_config,
    from_config=from_config,
)
