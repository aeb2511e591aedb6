"""Llama 3 architecture hyper-parameters and the published model sizes ("flavors").

Published dimensions follow Meta's released checkpoints (Llama 3.1 8B/70B/405B, Llama 3.2 1B/3B;
see each model's `params.json` / Hugging Face `config.json`). The counts they give on the meta
device are pinned in `tests/unit/models/llama3/test_llama3_args.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.models.common.rope import RopeScaling


LLAMA31_SCALING = RopeScaling(factor=8.0)
LLAMA32_SCALING = RopeScaling(factor=32.0)


@dataclass
class TransformerModelArgs:
    """Shape of a Llama 3 decoder-only transformer."""

    dim: int = 4096
    """Model (residual stream) width."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads; head_dim = dim // n_heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_heads (plain MHA)."""
    vocab_size: int = -1
    """Vocabulary size; -1 means "set from the tokenizer when the model is built"."""
    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Optional multiplier on the default SwiGLU hidden width int(8 * dim / 3)."""
    hidden_dim: int | None = None
    """Explicit SwiGLU hidden width (HF `intermediate_size`); None: Meta's rule from dim,
    ffn_dim_multiplier and multiple_of. Set when a Hugging Face config is imported."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1-style RoPE frequency scaling, or None for plain RoPE."""
    max_seq_len: int = 2048
    """The model's context length in tokens (config.json's `max_position_embeddings`): the
    flavor's, or the imported config's. Training sizes the RoPE table to `training.seq_len`;
    checkpoints and exports record the context length."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding (Llama 3.2 1B/3B). A tied model cannot
    be split across pipeline stages."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""

    @property
    def qk_norm(self) -> bool:
        """Llama has no per-head q/k norms."""
        return False

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads with the None default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden width by Meta's rule (llama-models `FeedForward`).

        hidden = int(2 * 4 * dim / 3); if ffn_dim_multiplier: hidden = int(ffn_dim_multiplier *
        hidden); then round up to a multiple of `multiple_of`. E.g. 8B: 14336.
        """
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def validate(self) -> None:
        """Check the arguments describe a buildable model.

        Raises:
            ValueError: one line naming the first bad value.
        """
        for name in ("dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.vocab_size <= 0:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be positive (set it from the tokenizer)"
            )
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} (dim // n_heads) must be even for RoPE")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must be positive and divide n_heads={self.n_heads}"
            )
        if self.hidden_dim is not None and self.hidden_dim <= 0:
            raise ValueError(f"hidden_dim={self.hidden_dim} must be positive")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise ValueError(f"ffn_dim_multiplier={self.ffn_dim_multiplier} must be positive")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive"
            )
        s = self.rope_scaling
        if s is not None and not (
            s.factor >= 1
            and 0 < s.low_freq_factor < s.high_freq_factor
            and s.original_max_position_embeddings > 0
        ):
            raise ValueError(
                f"rope_scaling={s} needs factor >= 1, 0 < low_freq_factor < high_freq_factor "
                "and original_max_position_embeddings > 0"
            )


def _published(**kwargs) -> TransformerModelArgs:
    # 131,072: the context length of Llama 3.1 and 3.2 (their config.json's
    # max_position_embeddings); training sizes the RoPE table to training.seq_len.
    return TransformerModelArgs(
        vocab_size=128256, rope_theta=500000.0, max_seq_len=131072, **kwargs
    )


# Shared instances: copy with `dataclasses.replace(llama3_flavors[name], ...)` before changing one.
llama3_flavors: dict[str, TransformerModelArgs] = {
    # Tiny GQA model that trains on CPU; scaling on so that code path runs in every test.
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        multiple_of=64,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_SCALING,
        max_seq_len=131072,  # what Llama 3.1's scaling serves
    ),
    # 8 thin layers: enough stages for 4-rank interleaved pipelines in CPU parity tests.
    "debugmodel_deep": TransformerModelArgs(
        dim=64,
        n_layers=8,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_SCALING,
        max_seq_len=131072,  # what Llama 3.1's scaling serves
    ),
    # 2 thin layers: reinforcement-learning tests train it to a task in a few hundred steps.
    "debugmodel_tiny": TransformerModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    "1B": _published(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=LLAMA32_SCALING,
        tie_word_embeddings=True,
    ),
    "3B": _published(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=LLAMA32_SCALING,
        tie_word_embeddings=True,
    ),
    "8B": _published(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=LLAMA31_SCALING,
    ),
    "70B": _published(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=LLAMA31_SCALING,
    ),
    "405B": _published(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_scaling=LLAMA31_SCALING,
    ),
}
