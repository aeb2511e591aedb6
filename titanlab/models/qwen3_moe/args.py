"""Qwen3-MoE architecture hyper-parameters and the published model sizes ("flavors").

Qwen3's dense decoder (q/k norms, explicit head_dim) whose blocks replace the SwiGLU FFN by a
Mixture-of-Experts layer: softmax token-choice top-k routing renormalized over the chosen experts
(`norm_topk_prob`), no shared experts, load-balance loss weight 0.001. Published dimensions are
those of the released `config.json` files (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B; Qwen3
Technical Report, 2025); their total and active parameter counts are pinned in
`tests/unit/models/qwen3_moe/test_qwen3_moe_args.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlab.models.common.moe import MoEArgs
from titanlab.models.qwen3.args import QWEN3_VOCAB_SIZE, Qwen3ModelArgs


@dataclass
class Qwen3MoEModelArgs(Qwen3ModelArgs):
    """Qwen3 with MoE blocks. `hidden_dim` is the SwiGLU width of the dense blocks, if any."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    """The MoE layers' shape and routing."""
    decoder_sparse_step: int = 1
    """Every `decoder_sparse_step`-th block (layer_id + 1 divisible by it) is MoE."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that stay dense whatever the step."""

    def moe_layer(self, layer_id: int) -> MoEArgs | None:
        """The MoE args of block `layer_id`, or None for a dense block (HF's rule)."""
        if layer_id in self.mlp_only_layers or (layer_id + 1) % self.decoder_sparse_step:
            return None
        return self.moe

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        super().validate()
        self.moe.validate()
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")


def _moe(num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=0.001,
    )


# Shared instances: copy with `dataclasses.replace` before changing one.
qwen3_moe_flavors: dict[str, Qwen3MoEModelArgs] = {
    # Tiny MoE that trains on CPU: 8 experts, top-2.
    "debugmodel": Qwen3MoEModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_dim=48,
        hidden_dim=640,
        moe=_moe(8, 2, 128),
    ),
    # 8 thin layers: enough stages for 4-rank pipelines in CPU parity tests.
    "debugmodel_deep": Qwen3MoEModelArgs(
        dim=64,
        n_layers=8,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        hidden_dim=160,
        moe=_moe(8, 2, 32),
    ),
    # 2 thin layers of 2 experts (top-1): on 4 CPU ranks a rank group holds fewer local experts
    # than its expert-FSDP ranks, so the expert stacks shard on a dim other than the experts'.
    "debugmodel_2_experts": Qwen3MoEModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        hidden_dim=160,
        moe=_moe(2, 1, 32),
    ),
    "30B-A3B": Qwen3MoEModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        vocab_size=QWEN3_VOCAB_SIZE,
        max_seq_len=40960,  # the published config.json's max_position_embeddings
        moe=_moe(128, 8, 768),
    ),
    "235B-A22B": Qwen3MoEModelArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=12288,
        vocab_size=QWEN3_VOCAB_SIZE,
        max_seq_len=40960,
        moe=_moe(128, 8, 1536),
    ),
}
