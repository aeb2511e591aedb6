"""titanlab `TransformerModelArgs` ⇄ a Hugging Face Llama `config.json` dict.

`to_hf_config` writes the keys that `transformers.LlamaConfig` and vLLM read, in the form of
Meta's published Llama 3.1 / 3.2 folders (`rope_scaling` of type `llama3` next to `rope_theta`).
`from_hf_config` reads that form and the one transformers >= 5 writes (`rope_parameters`), and
checks the config against the titanlab flavor the weights are meant for: titanlab builds its
models from flavors (`titanlab.models.llama3.llama3_flavors`), so a published checkpoint is usable
when its config equals a flavor's up to the vocabulary size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from titanlab.models.llama3.args import RopeScaling, TransformerModelArgs, llama3_flavors

DEFAULT_MAX_POSITION_EMBEDDINGS = 131072
"""`max_position_embeddings` written by default: the context length of Llama 3.1 and 3.2."""

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NUM_SPECIAL_TOKENS = 256  # titanlab tokenizers put Llama 3's 256 special tokens after the BPE ranks


def special_token_ids(vocab_size: int) -> tuple[int, int]:
    """(bos, eos) ids of a titanlab vocabulary: `<|begin_of_text|>` and `<|end_of_text|>` are the
    first two of the 256 special tokens that follow the BPE ranks (128000 / 128001 for Meta's)."""
    bos = vocab_size - NUM_SPECIAL_TOKENS
    return bos, bos + 1


def to_hf_config(
    args: TransformerModelArgs,
    *,
    dtype: torch.dtype,
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS,
) -> dict[str, Any]:
    """The `config.json` dict of a `LlamaForCausalLM` with the shape of `args`.

    Args:
        args: model shape; `vocab_size` must be resolved (> 0).
        dtype: dtype of the weights written next to it (`torch_dtype`): fp32, bf16 or fp16.
        max_position_embeddings: context length announced to the consumer (vLLM sizes its
            default max_model_len from it); titanlab's own `max_seq_len` is a training-time
            table length, not a property of the weights.
    Raises:
        ValueError: unresolved vocab size or an unsupported dtype.
    """
    if args.vocab_size <= 0:
        raise ValueError(
            f"vocab_size={args.vocab_size} must be resolved (> 0) to write config.json"
        )
    if dtype not in HF_DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} is not supported; valid: float32, bfloat16, float16")
    bos, eos = special_token_ids(args.vocab_size)
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
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": HF_DTYPE_NAMES[dtype],
    }


def generation_config(args: TransformerModelArgs) -> dict[str, Any]:
    """`generation_config.json`: the bos/eos ids, nothing else (sampling is the user's choice)."""
    bos, eos = special_token_ids(args.vocab_size)
    return {"bos_token_id": bos, "eos_token_id": eos}


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float | None, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers >= 5) or `rope_theta` +
    `rope_scaling` (Meta's published folders). Raises ValueError for a rope type titanlab lacks."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json rope type {kind!r} is not supported; valid: llama3, default")
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"config.json llama3 rope scaling lacks {e.args[0]!r}") from None


def _expected(args: TransformerModelArgs) -> dict[str, Any]:
    """The config values that must equal a flavor's (everything but vocab and context length)."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_hidden_dim(),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def _actual(cfg: dict[str, Any]) -> dict[str, Any]:
    heads = cfg.get("num_attention_heads")
    theta, scaling = _rope_from_hf(cfg)
    return {
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim")
        or (cfg["hidden_size"] // heads if cfg.get("hidden_size") and heads else None),
        "intermediate_size": cfg.get("intermediate_size"),
        "rms_norm_eps": cfg.get("rms_norm_eps"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def mismatch(cfg: dict[str, Any], args: TransformerModelArgs) -> str | None:
    """The first config.json value that differs from `args` ("key=value (flavor has X)"), or
    None when the config describes a model of shape `args` (vocab size aside)."""
    actual = _actual(cfg)
    for key, want in _expected(args).items():
        if not _same(actual[key], want):
            return f"{key}={actual[key]!r} (the flavor has {want!r})"
    return None


def _check_architecture(cfg: dict[str, Any]) -> None:
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json model_type={cfg.get('model_type')!r}; valid: 'llama'")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={cfg.get('hidden_act')!r}; valid: 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"config.json {key}=true; titanlab's Llama 3 has no biases")
    if not isinstance(cfg.get("vocab_size"), int) or cfg["vocab_size"] <= 0:
        raise ValueError(f"config.json vocab_size={cfg.get('vocab_size')!r} must be a positive int")


def from_hf_config(
    cfg: dict[str, Any],
    flavor: str | None = None,
    *,
    model_args: TransformerModelArgs | None = None,
) -> tuple[str, TransformerModelArgs]:
    """Resolve the titanlab model a Hugging Face Llama config describes.

    Args:
        cfg: the parsed `config.json`.
        flavor: a key of `llama3_flavors` the config must match; None: the flavor it matches.
        model_args: check against these args instead of a flavor (named "custom").
    Returns:
        (flavor name, args of that flavor with the config's vocab_size).
    Raises:
        ValueError: one line: unknown flavor, a non-Llama or biased config, an unsupported
            rope type, or the first config value that differs from the flavor (with both values).
    """
    _check_architecture(cfg)
    vocab = cfg["vocab_size"]
    if model_args is not None:
        candidates = {"custom": model_args}
    elif flavor is not None:
        if flavor not in llama3_flavors:
            raise ValueError(f"flavor={flavor!r} is unknown; valid: {', '.join(llama3_flavors)}")
        candidates = {flavor: llama3_flavors[flavor]}
    else:
        candidates = dict(llama3_flavors)
    for name, args in candidates.items():
        bad = mismatch(cfg, args)
        if bad is None:
            return name, dataclasses.replace(args, vocab_size=vocab)
        if len(candidates) == 1:
            raise ValueError(f"config.json does not match flavor {name!r}: {bad}")
    a = _actual(cfg)
    raise ValueError(
        f"config.json (hidden_size={a['hidden_size']}, num_hidden_layers={a['num_hidden_layers']}, "
        f"num_attention_heads={a['num_attention_heads']}) matches no titanlab flavor; valid: "
        f"{', '.join(llama3_flavors)} (pass --flavor to see the first differing value)"
    )
