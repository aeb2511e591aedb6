"""Qwen3.5 args ⇄ a Hugging Face `Qwen3_5ForCausalLM` config.json (`model_type` "qwen3_5_text").

Any Qwen3.5-architecture text config imports, its args derived from the fields. A published
checkpoint's config is the multimodal `Qwen3_5ForConditionalGeneration` one (`model_type`
"qwen3_5"): its `text_config` is read, and the import keeps the text model only (the vision
tower and the multi-token prediction head, `mtp_num_hidden_layers`, are left out:
`common/hf_hybrid.py`). The multimodal RoPE (`mrope_section`) is plain RoPE on text, where every
position axis is the token's index. Fields titanlab cannot honour (attention bias, an activation
other than silu, dropout, an ungated attention output, rope scaling) are refused with one line.
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
from titanlab.models.qwen3_5.args import Qwen35ModelArgs


def schedule_to_config(args: Qwen35ModelArgs) -> dict[str, Any]:
    """The keys of the layer schedule, the linear layers and partial RoPE."""
    return {
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "full_attention_interval": args.full_attention_interval,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_key_dim,
        "linear_value_head_dim": args.linear_value_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
        "partial_rotary_factor": args.partial_rotary_factor,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "attn_output_gate": True,
        "mamba_ssm_dtype": "float32",
    }


def to_config(
    args: Qwen35ModelArgs,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos: int | None,
    eos: int | None,
) -> dict[str, Any]:
    """The `config.json` dict of a `Qwen3_5ForCausalLM` of shape `args` (vocab resolved).

    Raises:
        ValueError: unresolved vocab size or an unsupported dtype.
    """
    cfg = common_config(args, dtype, max_position_embeddings, bos, eos)
    del cfg["rope_theta"]  # in rope_parameters
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **cfg,
        **schedule_to_config(args),
    }


def text_config(cfg: dict[str, Any], multimodal_type: str) -> dict[str, Any]:
    """The text model's config: `cfg["text_config"]` of a multimodal config (`model_type`
    `multimodal_type`), else `cfg`."""
    if cfg.get("model_type") == multimodal_type and isinstance(cfg.get("text_config"), dict):
        text = dict(cfg["text_config"])
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return text
    return cfg


def schedule_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The args fields of the layer schedule, the linear layers and partial RoPE.

    Raises:
        ValueError: a missing size, or `layer_types` of the wrong length.
    """
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    interval = require_int(cfg, "full_attention_interval", 4)
    types = tuple(cfg.get("layer_types") or ())
    if types and len(types) != n_layers:
        raise ValueError(
            f"config.json layer_types has {len(types)} entries for num_hidden_layers={n_layers}"
        )
    by_interval = tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    )
    return {
        "partial_rotary_factor": float(factor),
        "full_attention_interval": interval,
        "layer_types": () if types in ((), by_interval) else types,
        "linear_key_heads": require_int(cfg, "linear_num_key_heads"),
        "linear_value_heads": require_int(cfg, "linear_num_value_heads"),
        "linear_key_dim": require_int(cfg, "linear_key_head_dim"),
        "linear_value_dim": require_int(cfg, "linear_value_head_dim"),
        "linear_conv_kernel": require_int(cfg, "linear_conv_kernel_dim", 4),
    }


def dense_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The fields a dense and an MoE Qwen3.5 config share (`cfg` the text config).

    Raises:
        ValueError: one line naming the first field titanlab cannot honour, or a missing size.
    """
    refuse_unsupported(
        cfg,
        {"hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
         "attn_output_gate": True},
        family,
    )  # fmt: skip
    theta, _ = rope_from_config(cfg, ("default",))
    heads = require_int(cfg, "num_attention_heads")
    n_layers = require_int(cfg, "num_hidden_layers")
    return {
        "dim": require_int(cfg, "hidden_size"),
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": require_int(cfg, "num_key_value_heads", heads),
        "head_dim": require_int(cfg, "head_dim", 256),
        "vocab_size": require_int(cfg, "vocab_size"),
        "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_seq_len": require_int(cfg, "max_position_embeddings", 2048),
        **schedule_fields(cfg, n_layers),
    }


def from_config(cfg: dict[str, Any]) -> Qwen35ModelArgs:
    """Qwen3.5 args of any `Qwen3_5ForCausalLM` (or multimodal `Qwen3_5ForConditionalGeneration`)
    config, vocab size from the config.

    Raises:
        ValueError: one line naming the first field titanlab's Qwen3.5 cannot honour, or a
            missing size.
    """
    cfg = text_config(cfg, "qwen3_5")
    refuse_unsupported(cfg, {"model_type": "qwen3_5_text"}, "qwen3_5")
    return Qwen35ModelArgs(
        **dense_fields(cfg, "qwen3_5"), hidden_dim=require_int(cfg, "intermediate_size")
    )


HF = HFMapping(
    model_type="qwen3_5_text",
    architecture="Qwen3_5ForCausalLM",
    to_config=to_config,
    from_config=from_config,
    aliases=("qwen3_5",),
)
