"""What a model contributes to the performance model (`titanlab.planning.perf_model`):
parameter counts, attention shape and Muon's matrices, read from a meta-device model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the model contributes to the performance model (parameter counts, not bytes)."""

    n_layers: int
    dim: int
    n_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    active_params: int
    """Parameters one token's matmuls meet, the embedding table excluded (a tied head
    included): the trainer's `count_active_params(model, exclude_embedding=True)`."""
    output_params: int
    """The output head's matmul weights (a tied head's are the embedding's)."""
    expert_params: int
    """All routed experts of all MoE layers together."""
    moe_layers: int
    top_k: int
    num_experts: int
    total_params: int
    attention_width: int = 0
    """Dqk + Dv of one head (2 · head_dim for GQA; multi-head latent attention's own); 0: 2 ·
    head_dim."""
    boundary_width: int = 1
    """Vectors of width dim a pipeline boundary carries per token: 1, plus one per trained
    multi-token prediction depth (their embeddings ride along, `titanlab.models.common.mtp`)."""
    muon_params: int = 0
    """Elements of the matrices Muon would update (`titanlab.components.muon.takes_muon`)."""
    muon_expert_params: int = 0
    """Of those, the routed experts' (split by ep)."""
    muon_ns_flops: int = 0
    """Newton–Schulz FLOPs of one iteration over all of them, whole matrices
    (`titanlab.components.muon_sharded.ns_flops`)."""

    def __post_init__(self) -> None:
        if not self.attention_width:
            object.__setattr__(self, "attention_width", 2 * self.head_dim)

    @classmethod
    def of(cls, model_args) -> ModelShape:
        """From a registered family's args (the estimator's cached meta model is counted)."""
        from titanlab.components.muon import takes_muon
        from titanlab.components.muon_sharded import ns_flops
        from titanlab.models.common.decoder import moe_layers
        from titanlab.models.common.counting import count_active_params, count_params
        from titanlab.models.common.mtp import boundary_width
        from titanlab.planning.memory import _meta_model

        model = _meta_model(model_args)
        moes = moe_layers(model)
        out = getattr(model, "output", None)
        muon = [(n, p) for n, p in model.named_parameters() if takes_muon(n, p)]
        return cls(
            n_layers=model_args.n_layers,
            dim=model_args.dim,
            n_heads=model_args.n_heads,
            kv_heads=model_args.kv_heads,
            head_dim=model_args.head_dim,
            vocab_size=model_args.vocab_size,
            active_params=count_active_params(model, exclude_embedding=True),
            output_params=out.weight.numel() if out is not None else 0,
            expert_params=sum(count_params(m.experts) for m in moes),
            moe_layers=len(moes),
            top_k=moes[0].args.top_k if moes else 0,
            num_experts=moes[0].args.num_experts if moes else 0,
            total_params=count_params(model),
            attention_width=getattr(model_args, "qk_head_dim", model_args.head_dim)
            + getattr(model_args, "v_head_dim", model_args.head_dim),
            boundary_width=boundary_width(model_args),  # common/mtp.py
            muon_params=sum(p.numel() for _, p in muon),
            muon_expert_params=sum(p.numel() for n, p in muon if ".experts." in n),
            muon_ns_flops=sum(ns_flops(tuple(p.shape), 1) for _, p in muon),
        )

    @property
    def block_active_params(self) -> float:
        """One block's share of the active parameters (the final norm's few weights included)."""
        return (self.active_params - self.output_params) / self.n_layers

    def attention_flops_per_token(self, seq_len: int) -> int:
        """L · 6·H·(Dqk + Dv)·s: the score and value matmuls, forward and backward, no causal
        discount (12·L·H·Q·s for GQA; `titanlab.models.common.counting.attention_flops_per_token`)."""
        return self.n_layers * 6 * self.n_heads * self.attention_width * seq_len

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token without recomputation (what MFU counts): the trainer's
        `titanlab.models.common.counting.flops_per_token`."""
        return 6 * self.active_params + self.attention_flops_per_token(seq_len)
