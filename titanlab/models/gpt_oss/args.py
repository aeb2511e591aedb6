"""gpt-oss architecture hyper-parameters and the published model sizes ("flavors").

gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925; Hugging Face's
`GptOssForCausalLM`): grouped-query attention with biases on its projections and one learned
sink logit per head, in blocks that alternate a 128-token sliding window with full attention
(`layer_types`); YaRN RoPE (θ 150,000, factor 32 over 4,096 tokens, untruncated ramp); every
block an MoE of biased experts with the clamped SwiGLU (α 1.702, limit 7), routed by a biased
gate to the top 4 experts with a softmax over the chosen logits. Published dimensions are those
of the released `config.json` files (openai/gpt-oss-20b, openai/gpt-oss-120b); their total and
active parameter counts are pinned in `tests/unit/models/gpt_oss/test_gpt_oss_args.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlab.models.common.moe import MoEArgs
from titanlab.models.common.rope import YarnScaling

GPT_OSS_VOCAB_SIZE = 201088
"""Rows of the published embedding (the o200k_harmony tokenizer, padded)."""

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The attention of a block, in Hugging Face's `layer_types` words."""


def alternating_layers(n_layers: int) -> tuple[str, ...]:
    """gpt-oss's (and Hugging Face's default) pattern: sliding, full, sliding, full, ..."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


def gpt_oss_moe(num_experts: int, top_k: int, hidden_dim: int, coeff: float = 0.0) -> MoEArgs:
    """gpt-oss's MoE layer: softmax over the top-k biased gate logits (a softmax over all then
    renormalized over the chosen k, the same numbers), biased clamped-SwiGLU experts."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=coeff,
        gate_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )


@dataclass
class GptOssModelArgs:
    """Shape of a gpt-oss decoder (see the module docstring)."""

    dim: int = 2880
    """Model (residual stream) width (HF `hidden_size`)."""
    n_layers: int = 24
    """Number of transformer blocks."""
    n_heads: int = 64
    """Number of query heads."""
    n_kv_heads: int = 8
    """Number of key/value heads."""
    head_dim: int = 64
    """Width of one attention head."""
    vocab_size: int = -1
    """Vocabulary size; -1 means "set from the tokenizer when the model is built"."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 150_000.0
    """RoPE base frequency."""
    rope_scaling: YarnScaling | None = field(
        default_factory=lambda: YarnScaling(
            factor=32.0, original_max_position_embeddings=4096, truncate=False
        )
    )
    """YaRN, as published (mscale unset: cos/sin times 0.1 ln 32 + 1)."""
    max_seq_len: int = 131072
    """The model's context length in tokens (config.json's `max_position_embeddings`)."""
    sliding_window: int = 128
    """Window W of the sliding layers: a query sees itself and the W - 1 tokens before."""
    layer_types: tuple[str, ...] = ()
    """Each block's attention, "sliding_attention" or "full_attention"; empty: alternating,
    sliding first (`alternating_layers`)."""
    attention_bias: bool = True
    """q/k/v/o projections carry biases."""
    attention_sinks: bool = True
    """One learned sink logit per head joins every softmax."""
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32, 4, 2880))
    """Every block's MoE layer."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding (gpt-oss does not)."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""

    @property
    def qk_norm(self) -> bool:
        """gpt-oss has no per-head q/k norms."""
        return False

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads."""
        return self.n_kv_heads

    def ffn_hidden_dim(self) -> int:
        """One expert's SwiGLU width (there is no dense block)."""
        return self.moe.hidden_dim

    def moe_layer(self, layer_id: int) -> MoEArgs:
        """Every block is MoE."""
        return self.moe

    def resolved_layer_types(self) -> tuple[str, ...]:
        """`layer_types`, or the alternating default when empty."""
        return self.layer_types or alternating_layers(self.n_layers)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of block `layer_id`, None for a full-attention block."""
        kind = self.resolved_layer_types()[layer_id]
        return self.sliding_window if kind == "sliding_attention" else None

    def validate(self) -> None:
        """Check the arguments describe a buildable model.

        Raises:
            ValueError: one line naming the first bad value.
        """
        for name in ("dim", "n_layers", "n_heads", "head_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.vocab_size <= 0:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be positive (set it from the tokenizer)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}"
            )
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries; it needs one per block "
                f"(n_layers={self.n_layers}) or none"
            )
        for kind in self.layer_types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types entry {kind!r}; valid: {', '.join(LAYER_TYPES)}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling} must be YaRN or None for gpt-oss")
        self.moe.validate()


def _published(n_layers: int, num_experts: int) -> GptOssModelArgs:
    return GptOssModelArgs(
        n_layers=n_layers,
        vocab_size=GPT_OSS_VOCAB_SIZE,
        moe=gpt_oss_moe(num_experts, 4, 2880),
    )


def _debug(**kwargs) -> GptOssModelArgs:
    moe = kwargs.pop("moe")
    return GptOssModelArgs(
        rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=64, truncate=False),
        max_seq_len=2048,
        moe=moe,
        **kwargs,
    )


# Shared instances: copy with `dataclasses.replace` before changing one.
gpt_oss_flavors: dict[str, GptOssModelArgs] = {
    # Tiny model that trains on CPU: 8 experts, top-2, window 32.
    "debugmodel": _debug(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        sliding_window=32,
        moe=gpt_oss_moe(8, 2, 128),
    ),
    # 8 thin layers: enough stages for 4-rank pipelines in CPU parity tests.
    "debugmodel_deep": _debug(
        dim=64,
        n_layers=8,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        sliding_window=16,
        moe=gpt_oss_moe(8, 2, 32),
    ),
    "20b": _published(24, 32),
    "120b": _published(36, 128),
}


def with_layer_types(args: GptOssModelArgs) -> GptOssModelArgs:
    """`args` with `layer_types` spelled out (what config.json records)."""
    return dataclasses.replace(args, layer_types=args.resolved_layer_types())
