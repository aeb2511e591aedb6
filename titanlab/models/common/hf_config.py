"""Reading and writing Hugging Face `config.json` dicts: the parts every family shares.

A family's `hf.py` builds an `HFMapping` from these helpers: `to_config(args, ...)` writes the
keys its `*ForCausalLM` and vLLM read; `from_config(cfg)` derives the family's args from any
config.json of that architecture (not only the published sizes), taking every field the family
understands and refusing, with one line naming it, a field whose value it cannot honour.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titanlab.models.common.rope import RopeScaling, YarnScaling


HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NUM_SPECIAL_TOKENS = 256  # titanlab tokenizers put Llama 3's 256 special tokens after the BPE ranks


@dataclass(frozen=True)
class HFMapping:
    """How one family's args map to and from a Hugging Face config.json.

    Attributes:
        model_type: the config's `model_type` ("llama", "qwen3").
        architecture: the `architectures` entry ("LlamaForCausalLM", "Qwen3ForCausalLM").
        to_config: (args, dtype, max_position_embeddings, bos, eos) → config dict.
        from_config: config dict → args (vocab_size from the config). Raises ValueError with one
            line naming the first field it cannot honour.
        aliases: other `model_type`s `from_config` reads (Qwen3.5's multimodal "qwen3_5",
            whose `text_config` it takes).
    """

    model_type: str
    architecture: str
    to_config: Callable[[Any, torch.dtype, int, int | None, int | None], dict[str, Any]]
    from_config: Callable[[dict[str, Any]], Any]
    aliases: tuple[str, ...] = ()


def special_token_ids(vocab_size: int) -> tuple[int, int]:
    """(bos, eos) ids of a titanlab tiktoken vocabulary: `<|begin_of_text|>` and
    `<|end_of_text|>` are the first two of the 256 special tokens that follow the BPE ranks
    (128000 / 128001 for Meta's)."""
    bos = vocab_size - NUM_SPECIAL_TOKENS
    return bos, bos + 1


def dtype_name(dtype: torch.dtype) -> str:
    """The config's `torch_dtype` string. Raises ValueError for a dtype HF files do not use."""
    if dtype not in HF_DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not supported; valid: float32, bfloat16, float16")
    return HF_DTYPE_NAMES[dtype]


def rope_from_config(
    cfg: dict[str, Any], allowed: tuple[str, ...]
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(rope_theta, scaling or None) from `rope_parameters` (transformers >= 5) or `rope_theta` +
    `rope_scaling` (older files; the type under `rope_type` or `type`). Missing theta: 10000,
    transformers' default. Type "llama3" gives a `RopeScaling`, "yarn" a `YarnScaling`
    (transformers' `_compute_yarn_parameters` reading: a missing `factor` is
    max_position_embeddings / original_max_position_embeddings; an absent, null or zero
    beta_fast / beta_slow is 32 / 1; an absent mscale or mscale_all_dim is 0, unset).

    Raises:
        ValueError: a rope type not in `allowed` ("default", "llama3", "yarn"), or scaling
            lacking a key.
    """
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in allowed:
        raise ValueError(
            f"config.json rope type {kind!r} is not supported; valid: {', '.join(allowed)}"
        )
    if kind == "default":
        return theta, None
    if kind == "yarn":
        return theta, _yarn_from_params(params, cfg)
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json llama3 rope scaling lacks {e.args[0]!r}") from None


def _yarn_from_params(params: dict[str, Any], cfg: dict[str, Any]) -> YarnScaling:
    """The `YarnScaling` of a yarn `rope_parameters` / `rope_scaling` dict; see
    `rope_from_config`."""
    if params.get("original_max_position_embeddings") is None:
        raise ValueError("config.json yarn rope scaling lacks 'original_max_position_embeddings'")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # the extended context over the original one, as transformers derives it
        if cfg.get("max_position_embeddings") is None:
            raise ValueError(
                "config.json yarn rope scaling lacks 'factor' (and max_position_embeddings to "
                "derive it)"
            )
        factor = require_int(cfg, "max_position_embeddings") / original
    attention_factor = params.get("attention_factor")
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_to_config(scaling: YarnScaling) -> dict[str, Any]:
    """The legacy `rope_scaling` dict for `scaling`, in the form of DeepSeek's published
    config.json (both `type` and `rope_type` "yarn"; `attention_factor` only when set,
    `truncate` only when False). `rope_from_config` and transformers' `DeepseekV3Config` read it
    back to the same parameters."""
    out: dict[str, Any] = {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "mscale": scaling.mscale,
        "mscale_all_dim": scaling.mscale_all_dim,
    }
    if scaling.attention_factor is not None:
        out["attention_factor"] = scaling.attention_factor
    if not scaling.truncate:
        out["truncate"] = False
    return out


def require_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive int field of the config (or `default` when absent).

    Raises:
        ValueError: absent without a default, or not a positive int.
    """
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {key}={value!r} must be a positive int")
    return value


def refuse_unsupported(cfg: dict[str, Any], honoured: dict[str, Any], family: str) -> None:
    """Refuse a config field whose value the family cannot honour.

    Args:
        cfg: the config dict.
        honoured: field → the only value the family supports (a missing field is fine).
        family: name for the message.
    Raises:
        ValueError: "config.json KEY=VALUE is not supported by titanlab's FAMILY (needs X)".
    """
    for key, want in honoured.items():
        if key not in cfg or (cfg[key] is None and want in (False, 0, 0.0, None)):
            continue
        have = cfg[key]
        same = (
            math.isclose(float(have), float(want))
            if isinstance(want, float) and isinstance(have, (int, float))
            else have == want
        )
        if not same:
            raise ValueError(
                f"config.json {key}={have!r} is not supported by titanlab's {family} "
                f"(needs {want!r})"
            )


def common_config(
    args: Any, dtype: torch.dtype, max_position_embeddings: int, bos: int | None, eos: int | None
) -> dict[str, Any]:
    """The keys Llama- and Qwen-style configs share, from a `DecoderArgs`."""
    if args.vocab_size <= 0:
        raise ValueError(
            f"vocab_size={args.vocab_size} must be resolved (> 0) to write config.json"
        )
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim(),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name(dtype),
    }
