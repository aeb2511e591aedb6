"""Qwen3 args ⇄ a Hugging Face `Qwen3ForCausalLM` config.json.

Any Qwen3-architecture config imports: the args are derived from its fields (explicit head_dim
and intermediate_size), not matched against the flavors. Sliding-window attention and YaRN rope
scaling, which the published dense checkpoints leave off, are refused with one line.
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
from titanlab.models.qwen3.args import Qwen3ModelArgs


def to_config(
    args: Qwen3ModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `Qwen3ForCausalLM` of shape `args` (vocab_size resolved).

    Raises:
        ValueError: unresolved vocab size or an unsupported dtype.
    """
    cfg = common_config(args, dtype, max_position_embeddings, bos, eos)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **cfg,
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }


def from_config(cfg: dict[str, Any]) -> Qwen3ModelArgs:
    """Qwen3 args of any `Qwen3ForCausalLM` config (vocab_size from the config).

    Raises:
        ValueError: one line naming the first field titanlab's Qwen3 cannot honour (attention
            bias, an activation other than silu, dropout, sliding windows, rope scaling) or a
            missing size.
    """
    refuse_unsupported(
        cfg,
        {
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
        },
        "qwen3",
    )
    if any(t != "full_attention" for t in cfg.get("layer_types") or []):
        raise ValueError(
            "config.json layer_types has sliding_attention layers; titanlab's qwen3 runs full "
            "attention only"
        )
    theta, _ = rope_from_config(cfg, ("default",))
    heads = require_int(cfg, "num_attention_heads")
    return Qwen3ModelArgs(
        dim=require_int(cfg, "hidden_size"),
        n_layers=require_int(cfg, "num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=require_int(cfg, "num_key_value_heads", heads),
        head_dim=require_int(cfg, "head_dim", 128),
        hidden_dim=require_int(cfg, "intermediate_size"),
        vocab_size=require_int(cfg, "vocab_size"),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=require_int(cfg, "max_position_embeddings", 2048),
    )


HF = HFMapping(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    to_config=to_config,
    from_config=from_config,
)
