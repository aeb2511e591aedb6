"""Qwen3.5 (dense) architecture hyper-parameters and the published model sizes ("flavors").

A hybrid decoder: three Gated DeltaNet linear-attention layers (`common/linear_attention.py`)
for every gated full-attention layer (`full_attention_interval` 4), Qwen3's per-head q/k norms,
RoPE on a quarter of each head (`partial_rotary_factor` 0.25, rope_theta 1e7), and every RMSNorm
zero-centered (weight stored as an offset from one, `common/norms.py`). Published dimensions are
the text part of the released `config.json` files (Qwen/Qwen3.5-0.8B ... Qwen/Qwen3.5-27B,
`text_config`); the parameter counts they give on the meta device, vision tower and
multi-token prediction head aside, are pinned in `tests/unit/models/qwen3_5/test_qwen3_5_args.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titanlab.models.common.norms import ZeroCenteredRMSNorm
from titanlab.models.qwen3.args import Qwen3ModelArgs

QWEN3_5_VOCAB_SIZE = 248320
"""Rows of the published embedding."""
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class Qwen35ModelArgs(Qwen3ModelArgs):
    """Qwen3's fields (the full-attention layers' heads, the SwiGLU width) plus the linear
    layers' shape and the layer schedule."""

    rope_theta: float = 10_000_000.0
    """RoPE base frequency."""
    partial_rotary_factor: float = 0.25
    """Share of each full-attention head that RoPE rotates (`rotary_dim`)."""
    full_attention_interval: int = 4
    """Every `full_attention_interval`-th layer (layer_id + 1 divisible by it) is full
    attention, the others linear (Hugging Face's rule when `layer_types` is absent)."""
    layer_types: tuple[str, ...] = ()
    """Each layer's type, "linear_attention" or "full_attention", overriding the interval
    (config.json's `layer_types`); empty: from the interval."""
    linear_key_heads: int = 16
    """Key (and query) heads H_k of a linear layer (HF `linear_num_key_heads`)."""
    linear_value_heads: int = 32
    """Value heads H_v of a linear layer, a multiple of H_k (HF `linear_num_value_heads`)."""
    linear_key_dim: int = 128
    """d_k of a linear layer's head (HF `linear_key_head_dim`)."""
    linear_value_dim: int = 128
    """d_v of a linear layer's head (HF `linear_value_head_dim`)."""
    linear_conv_kernel: int = 4
    """Taps K of the linear layers' causal depthwise convolution (HF `linear_conv_kernel_dim`)."""

    @property
    def rotary_dim(self) -> int:
        """Dims of a full-attention head that RoPE rotates: int(head_dim · partial factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_output_gate(self) -> bool:
        """The full-attention layers gate their output by σ(gate) per head (`Attention`)."""
        return True

    @property
    def norm_class(self) -> type[nn.Module]:
        """Every RMSNorm is zero-centered (`norms.ZeroCenteredRMSNorm`)."""
        return ZeroCenteredRMSNorm

    def layer_type(self, layer_id: int) -> str:
        """ "linear_attention" or "full_attention" for block `layer_id`."""
        if self.layer_types:
            return self.layer_types[layer_id]
        full = (layer_id + 1) % self.full_attention_interval == 0
        return "full_attention" if full else "linear_attention"

    def validate(self) -> None:
        """Raises ValueError: one line naming the first bad value."""
        super().validate()
        for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim",
                     "linear_value_dim", "linear_conv_kernel", "full_attention_interval"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(
                f"linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"linear_key_heads={self.linear_key_heads}"
            )
        r = self.rotary_dim
        if r < 2 or r % 2 or r > self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={r}; it "
                f"must be even and in 2..head_dim ({self.head_dim})"
            )
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"layer_types entry {bad[0]!r}; valid: {', '.join(LAYER_TYPES)}")


def _published(**kwargs) -> Qwen35ModelArgs:
    # The released text configs: head_dim 256, linear heads of 128 with 16 key heads, a
    # 4-tap convolution, 262,144 max_position_embeddings.
    return Qwen35ModelArgs(vocab_size=QWEN3_5_VOCAB_SIZE, head_dim=256, max_seq_len=262144,
                           linear_key_heads=16, linear_key_dim=128, linear_value_dim=128,
                           **kwargs)  # fmt: skip


# Shared instances: copy with `dataclasses.replace` before changing one.
qwen3_5_flavors: dict[str, Qwen35ModelArgs] = {
    # Tiny hybrid that trains on CPU: layers 0-2 linear, 3 full, 4-5 linear; key heads ≠ value
    # heads, and linear head dims ≠ the full layers'.
    "debugmodel": Qwen35ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_dim=48,
        hidden_dim=640,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_key_dim=32,
        linear_value_dim=24,
    ),
    # 8 thin layers (two full): enough stages for 4-rank interleaved pipelines.
    "debugmodel_deep": Qwen35ModelArgs(
        dim=64,
        n_layers=8,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        hidden_dim=160,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_dim=16,
        linear_value_dim=16,
    ),
    "0.8B": _published(
        dim=1024,
        n_layers=24,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=3584,
        linear_value_heads=16,
        tie_word_embeddings=True,
    ),
    "2B": _published(
        dim=2048,
        n_layers=24,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=6144,
        linear_value_heads=16,
        tie_word_embeddings=True,
    ),
    "4B": _published(
        dim=2560,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        hidden_dim=9216,
        linear_value_heads=32,
        tie_word_embeddings=True,
    ),
    "9B": _published(
        dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, hidden_dim=12288, linear_value_heads=32
    ),
    "27B": _published(
        dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, hidden_dim=17408, linear_value_heads=48
    ),
}
