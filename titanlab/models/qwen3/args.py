"""Qwen3 (dense) architecture hyper-parameters and the published model sizes ("flavors").

Published dimensions are those of the released checkpoints' Hugging Face `config.json`
(Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B; Yang et al. 2025, "Qwen3 Technical Report", Table 1). The
parameter counts they give on the meta device are pinned in
`tests/unit/models/qwen3/test_qwen3_args.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.models.common.rope import RopeScaling

QWEN3_VOCAB_SIZE = 151936
"""Rows of the published embedding (the tokenizer's 151,669 ids, padded)."""


@dataclass
class Qwen3ModelArgs:
    """Shape of a Qwen3 dense decoder: Llama's layout plus per-head RMSNorm on q and k before
    RoPE, an explicit head_dim and an explicit SwiGLU width."""

    dim: int = 4096
    """Model (residual stream) width (HF `hidden_size`)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Width of one attention head; Qwen3 sets it apart from dim // n_heads (0.6B: 1024 / 16 heads
    of 128)."""
    hidden_dim: int = 12288
    """SwiGLU hidden width (HF `intermediate_size`)."""
    vocab_size: int = -1
    """Vocabulary size; -1 means "set from the tokenizer when the model is built"."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the q/k norms included."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Qwen3 ships without RoPE scaling (YaRN is opt-in and not supported here)."""
    max_seq_len: int = 2048
    """The model's context length in tokens (config.json's `max_position_embeddings`): the
    flavor's, or the imported config's. Training sizes the RoPE table to `training.seq_len`;
    checkpoints and exports record the context length."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding (0.6B, 1.7B, 4B). A tied model cannot
    be split across pipeline stages."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes every q and k head (RMSNorm over head_dim) before RoPE."""
        return True

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads."""
        return self.n_kv_heads

    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden width: `hidden_dim`, as published (no rounding rule)."""
        return self.hidden_dim

    def validate(self) -> None:
        """Check the arguments describe a buildable model.

        Raises:
            ValueError: one line naming the first bad value.
        """
        for name in ("dim", "n_layers", "n_heads", "head_dim", "hidden_dim", "max_seq_len"):
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
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive"
            )
        if self.rope_scaling is not None:
            raise ValueError(f"rope_scaling={self.rope_scaling} is not supported for Qwen3")


def _published(**kwargs) -> Qwen3ModelArgs:
    # 40,960: the published Qwen3 config.json's max_position_embeddings.
    return Qwen3ModelArgs(
        vocab_size=QWEN3_VOCAB_SIZE, n_kv_heads=8, head_dim=128, max_seq_len=40960, **kwargs
    )


# Shared instances: copy with `dataclasses.replace(qwen3_flavors[name], ...)` before changing one.
qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Tiny model that trains on CPU; head_dim 48 ≠ dim / n_heads = 32, like the published sizes.
    "debugmodel": Qwen3ModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=48, hidden_dim=640
    ),
    # 8 thin layers: enough stages for 4-rank interleaved pipelines in CPU parity tests.
    "debugmodel_deep": Qwen3ModelArgs(
        dim=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=160
    ),
    "0.6B": _published(
        dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie_word_embeddings=True
    ),
    "1.7B": _published(
        dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie_word_embeddings=True
    ),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie_word_embeddings=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600),
}
