"""Qwen3.5-MoE architecture hyper-parameters and the published model sizes ("flavors").

Qwen3.5's hybrid decoder (`args.py`) whose every block's FFN is a Mixture-of-Experts layer:
softmax top-k routing renormalized over the chosen experts, and one shared SwiGLU expert whose
output a per-token sigmoid gate scales (`MoEArgs.shared_gate`), load-balance loss weight 0.001.
Published dimensions are the text part of the released `config.json` files
(Qwen/Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B); the total and active parameter counts are
pinned in `tests/unit/models/qwen3_5/test_qwen3_5_moe_args.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlab.models.common.moe import MoEArgs
from titanlab.models.qwen3_5.args import QWEN3_5_VOCAB_SIZE, Qwen35ModelArgs, qwen3_5_flavors


@dataclass
class Qwen35MoEModelArgs(Qwen35ModelArgs):
    """Qwen3.5 with an MoE layer in every block. `hidden_dim` (the dense SwiGLU width) is
    unused: no block is dense."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    """The MoE layers' shape and routing."""

    def moe_layer(self, layer_id: int) -> MoEArgs | None:
        """The MoE args of block `layer_id`: every block is MoE."""
        return self.moe

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        super().validate()
        self.moe.validate()


def qwen3_5_moe(num_experts: int, top_k: int, hidden_dim: int, shared_dim: int) -> MoEArgs:
    """The MoE layer of a Qwen3.5-MoE config: `moe_intermediate_size` `hidden_dim`, one shared
    expert of `shared_expert_intermediate_size` `shared_dim`."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        route_norm=True,
        num_shared_experts=1,
        shared_hidden_dim=shared_dim,
        shared_gate=True,
        load_balance_coeff=0.001,
    )


def _with_moe(dense: Qwen35ModelArgs, moe: MoEArgs) -> Qwen35MoEModelArgs:
    """`dense`'s shape with `moe` in every block."""
    fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(Qwen35ModelArgs)}
    return Qwen35MoEModelArgs(**fields, moe=moe)


def _published(**kwargs) -> Qwen35MoEModelArgs:
    return Qwen35MoEModelArgs(vocab_size=QWEN3_5_VOCAB_SIZE, head_dim=256, max_seq_len=262144,
                              n_kv_heads=2, linear_key_heads=16, linear_key_dim=128,
                              linear_value_dim=128, **kwargs)  # fmt: skip


# Shared instances: copy with `dataclasses.replace` before changing one.
qwen3_5_moe_flavors: dict[str, Qwen35MoEModelArgs] = {
    # The dense debug models' shapes with MoE blocks: 8 experts, top-2, a gated shared expert.
    "debugmodel": _with_moe(qwen3_5_flavors["debugmodel"], qwen3_5_moe(8, 2, 128, 128)),
    "debugmodel_deep": _with_moe(qwen3_5_flavors["debugmodel_deep"], qwen3_5_moe(8, 2, 32, 48)),
    "35B-A3B": _published(
        dim=2048,
        n_layers=40,
        n_heads=16,
        hidden_dim=512,
        linear_value_heads=32,
        moe=qwen3_5_moe(256, 8, 512, 512),
    ),
    "122B-A10B": _published(
        dim=3072,
        n_layers=48,
        n_heads=32,
        hidden_dim=1024,
        linear_value_heads=64,
        moe=qwen3_5_moe(256, 8, 1024, 1024),
    ),
    "397B-A17B": _published(
        dim=4096,
        n_layers=60,
        n_heads=32,
        hidden_dim=1024,
        linear_value_heads=64,
        moe=qwen3_5_moe(512, 10, 1024, 1024),
    ),
}
