"""DeepSeek-V3 architecture hyper-parameters and the published model sizes ("flavors").

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), as Hugging Face's
`DeepseekV3ForCausalLM` defines it: multi-head latent attention (`common/mla.py`), dense SwiGLU
blocks for the first `n_dense_layers`, then MoE blocks of fine-grained routed experts (sigmoid
scores, group-limited top-k, the selection bias of auxiliary-loss-free balancing) plus shared
experts. Published dimensions are those of the released `config.json` files
(deepseek-ai/DeepSeek-V3, moonshotai/Moonlight-16B-A3B); their total and active parameter counts
are pinned in `tests/unit/models/deepseek_v3/test_deepseek_v3_args.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlab.models.common.moe import MoEArgs
from titanlab.models.common.rope import YarnScaling, softmax_mscale

DEEPSEEK_V3_VOCAB_SIZE = 129280
"""Rows of DeepSeek-V3's published embedding."""
MOONLIGHT_VOCAB_SIZE = 163840
"""Rows of Moonlight-16B-A3B's published embedding."""


@dataclass
class DeepSeekV3ModelArgs:
    """Shape of a DeepSeek-V3 decoder. HF names in parentheses."""

    dim: int = 7168
    """Model (residual stream) width (`hidden_size`)."""
    n_layers: int = 61
    """Number of transformer blocks (`num_hidden_layers`)."""
    n_heads: int = 128
    """Attention heads (`num_attention_heads`; MLA has as many key-value heads)."""
    q_lora_rank: int = 1536
    """Width of the compressed query; 0 for a full-rank query projection (HF null)."""
    kv_lora_rank: int = 512
    """Width of the joint key-value latent, what the generation cache holds per token."""
    qk_nope_head_dim: int = 128
    """Non-rotary width of one query/key head."""
    qk_rope_head_dim: int = 64
    """Rotary width of one query/key head (even); the key's rotary part is shared by all heads."""
    v_head_dim: int = 128
    """Width of one value head."""
    hidden_dim: int = 18432
    """SwiGLU width of the dense blocks (`intermediate_size`)."""
    n_dense_layers: int = 3
    """Blocks 0 .. n_dense_layers-1 are dense, the rest MoE (`first_k_dense_replace`)."""
    moe: MoEArgs = field(default_factory=lambda: _moe(256, 8, 2048, 1, 8, 4, 2.5))
    """The MoE blocks' shape and routing."""
    mtp_layers: int = 0
    """Multi-token prediction depths D (`num_nextn_predict_layers`; DeepSeek-V3: 1), each one
    MLA + MoE block predicting one more token ahead (`common/mtp.py`); trained, not exported
    to the model transformers runs."""
    mtp_loss_weight: float = 0.3
    """λ, the weight of the MTP loss (the paper's 0.3 for the first 10T tokens, then 0.1);
    training only, not part of config.json."""
    vocab_size: int = -1
    """Vocabulary size; -1 means "set from the tokenizer when the model is built"."""
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (`rms_norm_eps`); the latent norms use 1e-6."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: YarnScaling | None = None
    """YaRN long-context scaling of the rotary dims (DeepSeek-V3: factor 40 over 4096), or None."""
    max_seq_len: int = 2048
    """The model's context length in tokens (config.json's `max_position_embeddings`)."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding (no published size does)."""
    depth_init: bool = True
    """Output-projection init std 0.02/sqrt(2*(layer_id+1)) if True, else 0.02/sqrt(2*n_layers)."""

    @property
    def attention_type(self) -> str:
        """Always "mla": the decoder builds `MLAttention` blocks."""
        return "mla"

    @property
    def head_dim(self) -> int:
        """The width the RoPE tables are built for: the rotary part of a head."""
        return self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """MLA expands keys and values for every head."""
        return self.n_heads

    @property
    def qk_norm(self) -> bool:
        """No per-head q/k norms (the latents are normed instead)."""
        return False

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale² when the RoPE is YaRN-scaled (DeepSeek-V2
        §2.1.3; transformers' `DeepseekV3Attention.scaling`)."""
        return self.qk_head_dim**-0.5 * softmax_mscale(self.rope_scaling)

    def ffn_hidden_dim(self) -> int:
        """SwiGLU width of the dense blocks: `hidden_dim`, as published."""
        return self.hidden_dim

    def moe_layer(self, layer_id: int) -> MoEArgs | None:
        """The MoE args of block `layer_id`, or None for one of the first dense blocks."""
        return None if layer_id < self.n_dense_layers else self.moe

    def validate(self) -> None:
        """Check the arguments describe a buildable model.

        Raises:
            ValueError: one line naming the first bad value.
        """
        for name in (
            "dim", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "hidden_dim", "max_seq_len",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.vocab_size <= 0:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be positive (set it from the tokenizer)"
            )
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be >= 0 (0: no compression)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers} must be in 0..n_layers ({self.n_layers})"
            )
        if self.mtp_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError(
                f"mtp_layers={self.mtp_layers} and mtp_loss_weight={self.mtp_loss_weight} "
                "must be >= 0"
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive"
            )
        self.moe.validate()


def _moe(
    num_experts: int,
    top_k: int,
    hidden_dim: int,
    shared: int,
    n_groups: int,
    topk_groups: int,
    route_scale: float,
) -> MoEArgs:
    """DeepSeek-V3's routing: sigmoid scores, the bias always in the selection and updated by
    auxiliary-loss-free balancing (γ = 0.001, the paper's), renormalized top-k; the aux loss
    sequence-wise when turned on (the paper's α = 0.0001; off by default)."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="sigmoid",
        route_norm=True,
        route_scale=route_scale,
        num_shared_experts=shared,
        n_groups=n_groups,
        topk_groups=topk_groups,
        route_bias=True,
        load_balance_coeff=0.0,
        load_balance_type="sequence",
        bias_update_speed=0.001,
    )


# Shared instances: copy with `dataclasses.replace` before changing one.
deepseek_v3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    # Tiny model that trains on CPU: compressed query, 1 dense block, 8 experts in 2 groups.
    "debugmodel": DeepSeekV3ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        hidden_dim=640,
        n_dense_layers=1,
        moe=_moe(8, 2, 128, 1, 2, 1, 2.5),
        mtp_layers=1,
    ),
    # 8 thin layers: enough stages for 4-rank pipelines in CPU parity tests; the compressed
    # query and group-limited routing (2 groups of 4, the best one kept) as in 671B.
    "debugmodel_deep": DeepSeekV3ModelArgs(
        dim=64,
        n_layers=8,
        n_heads=4,
        q_lora_rank=16,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        hidden_dim=160,
        n_dense_layers=1,
        moe=_moe(8, 2, 32, 1, 2, 1, 2.5),
    ),
    # moonshotai/Moonlight-16B-A3B (DeepSeek-V3 architecture; 16.0B total, 3.0B active).
    "16B": DeepSeekV3ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        hidden_dim=11264,
        n_dense_layers=1,
        moe=_moe(64, 6, 1408, 2, 1, 1, 2.446),
        vocab_size=MOONLIGHT_VOCAB_SIZE,
        norm_eps=1e-5,
        rope_theta=50000.0,
        max_seq_len=8192,
    ),
    # deepseek-ai/DeepSeek-V3 (671B total, 37B active, without its one MTP depth: 11.6B more).
    "671B": DeepSeekV3ModelArgs(
        mtp_layers=1,
        vocab_size=DEEPSEEK_V3_VOCAB_SIZE,
        rope_scaling=YarnScaling(
            factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
        ),
        max_seq_len=163840,
    ),
}
