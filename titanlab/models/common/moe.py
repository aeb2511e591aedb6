"""Mixture-of-Experts feed-forward (token-choice top-k routing) in plain PyTorch.

- Router: a linear gate computed in fp32, `score_func` softmax or sigmoid, top-k experts per
  token, optionally renormalized over the k chosen (`route_norm`, Qwen3's `norm_topk_prob`) and
  multiplied by `route_scale`. An optional per-expert bias shifts which experts are *chosen*
  but not the weights (DeepSeek-V3's auxiliary-loss-free balancing, Wang et al. 2024).
- Group-limited top-k (`n_groups` > 1; DeepSeek-V3 tech report, arXiv:2412.19437 §2.1.2, the
  node-limited form of DeepSeek-V2's device-limited routing, arXiv:2405.04434 §2.2.2): the E
  experts form G groups of E/G consecutive ones; a group scores the sum of its two best
  selection scores, only the `topk_groups` best groups stay eligible, and the top-k is taken
  among their experts. In DeepSeek-V3 a group is the experts of one node, so each token's
  dispatch reaches at most `topk_groups` nodes.
- Experts: SwiGLU weights stacked as (num_experts, out, in); tokens are sorted by expert and run
  either with `torch._grouped_mm` or with an exact per-expert loop (same numbers within fp32
  rounding). No token is dropped here (a capacity-bounded expert-parallel dispatch applied from
  outside may drop some; it counts them in `tokens_dropped`).
- Shared experts (DeepSeek-MoE style): a dense SwiGLU every token goes through, added to the
  routed output.
- Load balance (Switch Transformer, Fedus et al. 2021; GShard): aux = E · Σ_i f_i · P_i with f_i
  the fraction of tokens' top-k slots given to expert i (Σ f_i = k) and P_i the mean routing
  probability of expert i, the form of transformers' `load_balancing_loss_func`. The statistics
  are those of the whole global microbatch: `reduce_stats` (identity here; the parallelize step
  installs an all-reduce over the data-parallel ranks) sums the token counts over the ranks, so
  every rank's f is the global one and the gradient each rank sends through its own P equals
  the global loss's. Computing it per rank would average a different, noisier loss and make the
  result depend on the layout. The term enters backward through `aux_grad_scale` (set by the
  trainer: coefficient / MoE layers / microbatches, times the ranks FSDP averages over), so it
  works unchanged when the layers are spread over pipeline stages.

The module knows nothing of parallelism: the statistics' reduction is installed from outside
(`titanlab/distributed/moe_stats.py`). Forwards that are not training microbatches (validation,
the pipeline's shape inference) and the recomputation of an activation-checkpointed block record
no statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from titanlab.models.common.aux_loss import add_loss_grad
from titanlab.models.common.experts import (
    ClampedSwiGLUExperts,
    GroupedExperts,
    grouped_mm_supported,
)
from titanlab.models.common.feed_forward import FeedForward
from titanlab.models.common.forward_counts import add_once
from titanlab.models.common.init import trunc_normal_

__all__ = ["GroupedExperts", "MoE", "MoEArgs", "Router", "grouped_mm_supported"]


@dataclass
class MoEArgs:
    """Shape and routing of one MoE layer."""

    num_experts: int = 8
    """Routed experts (E)."""
    top_k: int = 2
    """Experts each token goes to (k)."""
    hidden_dim: int = 128
    """SwiGLU width of one expert (HF `moe_intermediate_size`)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Routing scores from the gate logits: softmax over experts (Qwen3-MoE) or sigmoid (DeepSeek-V3)."""
    route_norm: bool = True
    """Renormalize the k chosen scores to sum to 1 (Qwen3's `norm_topk_prob`)."""
    route_scale: float = 1.0
    """Multiplier on the routing weights (DeepSeek-V3: 2.5)."""
    num_shared_experts: int = 0
    """Dense SwiGLU experts every token also goes through (width num_shared × hidden_dim, or
    `shared_hidden_dim`)."""
    shared_hidden_dim: int = 0
    """SwiGLU width of the shared experts together (HF `shared_expert_intermediate_size`);
    0: num_shared_experts × hidden_dim."""
    shared_gate: bool = False
    """A per-token gate σ(x · w_g) scales the shared experts' output (Qwen2-MoE and Qwen3.5-MoE's
    `shared_expert_gate`; `shared_gate.weight` (1, dim))."""
    load_balance_coeff: float = 0.0
    """Weight of the auxiliary load-balance loss (0: off; Qwen3-MoE trains with 0.001,
    DeepSeek-V3 with 0.0001 sequence-wise)."""
    load_balance_type: Literal["global", "sequence"] = "global"
    """The aux loss's form: "global", the Switch/GShard loss over the global microbatch;
    "sequence", DeepSeek-V3's sequence-wise balance loss (arXiv:2412.19437, eqs. 17-20), each
    sequence's own, averaged over the sequences."""
    bias_update_speed: float = 0.0
    """Step of the auxiliary-loss-free expert bias per optimizer step (0: off; DeepSeek-V3:
    0.001)."""
    n_groups: int = 1
    """Expert groups G for group-limited routing (HF `n_group`; 1: plain top-k over all E)."""
    topk_groups: int = 1
    """Groups each token may route into, the best by the sum of their two best selection scores
    (HF `topk_group`; used only when n_groups > 1)."""
    route_bias: bool = False
    """Always add the expert bias to the selection scores, as DeepSeek-V3's
    `e_score_correction_bias` (so an imported bias routes even with bias_update_speed 0); with
    False it is used only when bias_update_speed > 0."""

    gate_bias: bool = False
    """The router's gate carries a bias, added to its logits (gpt-oss)."""
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The experts: "swiglu" (`GroupedExperts`), or gpt-oss's biased experts with the clamped
    SwiGLU (`ClampedSwiGLUExperts`, with `swiglu_alpha` and `swiglu_limit`)."""
    swiglu_alpha: float = 1.702
    """Sigmoid gain of the clamped SwiGLU (gpt-oss: 1.702)."""
    swiglu_limit: float = 7.0
    """Clamp of the clamped SwiGLU (gpt-oss: 7.0)."""

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        if self.activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"activation={self.activation!r}; valid: swiglu, clamped_swiglu")
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit={self.swiglu_limit} must be > 0")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.hidden_dim <= 0:
            raise ValueError(f"moe hidden_dim={self.hidden_dim} must be positive")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={self.score_func!r}; valid: softmax, sigmoid")
        if self.load_balance_type not in ("global", "sequence"):
            raise ValueError(
                f"load_balance_type={self.load_balance_type!r}; valid: global, sequence"
            )
        if self.load_balance_coeff < 0 or self.bias_update_speed < 0:
            raise ValueError(
                f"load_balance_coeff={self.load_balance_coeff} and bias_update_speed="
                f"{self.bias_update_speed} must be >= 0"
            )
        e, g, gk = self.num_experts, self.n_groups, self.topk_groups
        if g < 1 or e % g:
            raise ValueError(f"n_groups={g} must be >= 1 and divide num_experts ({e})")
        if g > 1 and e // g < 2:
            raise ValueError(
                f"n_groups={g} leaves {e // g} expert per group; a group scores its top-2, so "
                f"num_experts/n_groups must be >= 2 (num_experts={e})"
            )
        if not 1 <= gk <= g:
            raise ValueError(f"topk_groups={gk} must be in 1..n_groups ({g})")
        if self.top_k > gk * (e // g):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {gk * (e // g)} experts of topk_groups={gk} "
                f"groups of {e // g}"
            )


class Router(nn.Module):
    """Token-choice top-k router, group-limited when `n_groups` > 1. `gate.weight` is
    (num_experts, dim)."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.gate_bias)

    def forward(
        self, x_td: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_td: (tokens, dim); expert_bias: (num_experts,) fp32 added to the scores that choose
        the experts (not to the weights), or None. Returns (weights (tokens, k) fp32, experts
        (tokens, k) int64, scores (tokens, num_experts) fp32 of every expert, unbiased, for the
        load-balance loss)."""
        with torch.autocast(x_td.device.type, enabled=False):  # fp32 even under autocast
            # The gate weight is fp32 (mixed precision keeps it so): a module call, so that a
            # parallel style applied from outside can wrap it.
            logits = self.gate(x_td.float())  # (tokens, E)
        scores = logits.softmax(-1) if self.args.score_func == "softmax" else logits.sigmoid()
        choose = scores if expert_bias is None else scores + expert_bias
        if self.args.n_groups > 1:
            choose = self._limit_groups(choose)
        experts = choose.topk(self.args.top_k, dim=-1).indices  # (tokens, k)
        weights = scores.gather(-1, experts)
        if self.args.route_norm:
            # No `+ 1e-20` as in transformers' DeepSeek-V3: it is a no-op in fp32 only for sums
            # >= 2^-42, and a bias can choose softmax experts whose scores sum to less.
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.args.route_scale, experts, scores

    def _limit_groups(self, choose: torch.Tensor) -> torch.Tensor:
        """choose: (tokens, E) selection scores. Returns them with -inf for every expert outside
        the token's `topk_groups` best groups (a group's score: the sum of its two best)."""
        g = self.args.n_groups
        by_group = choose.view(choose.shape[0], g, -1)  # (tokens, G, E/G)
        group_scores = by_group.topk(2, dim=-1).values.sum(-1)  # (tokens, G)
        kept = group_scores.topk(self.args.topk_groups, dim=-1).indices  # (tokens, Gk)
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, kept, False)
        return by_group.masked_fill(dropped[..., None], float("-inf")).view_as(choose)


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing a block's dense FFN.

    Args:
        dim: model width.
        args: the layer's `MoEArgs`.
    Attributes:
        reduce_stats: (tensor) -> tensor summed over the ranks that share a global microbatch;
            identity until the parallelize step installs an all-reduce.
        aux_grad_scale: factor on the load-balance gradient (the trainer sets it per step; 0:
            the loss is computed for logging only).
        last_aux: this rank's share of the layer's load-balance loss in the last forward
            (detached; the shares of the ranks sum to the global value), or None when off.
        step_aux: sum of `last_aux` over the step's microbatches (reset by `end_step`).
        tokens_per_expert: (E,) fp32 token-slot counts of this rank since the last `end_step`.
        tokens_dropped: 0-d fp32 count of this rank's token slots the experts did not run since
            the last `end_step` (0 unless a capacity-bounded dispatch applied from outside
            drops some; it adds them here).
        step_load: (E,) token-slot counts of the last step over all ranks (set by `end_step`).
    """

    tokens_per_expert: torch.Tensor
    tokens_dropped: torch.Tensor
    step_aux: torch.Tensor
    expert_bias: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        args.validate()
        self.args = args
        self.router = Router(dim, args)
        self.experts: GroupedExperts | ClampedSwiGLUExperts = (
            GroupedExperts(dim, args.hidden_dim, args.num_experts)
            if args.activation == "swiglu"
            else ClampedSwiGLUExperts(
                dim, args.hidden_dim, args.num_experts, args.swiglu_alpha, args.swiglu_limit
            )
        )
        shared_width = args.shared_hidden_dim or args.hidden_dim * args.num_shared_experts
        self.shared_experts = FeedForward(dim, shared_width) if args.num_shared_experts else None
        self.shared_gate = (
            nn.Linear(dim, 1, bias=False) if args.shared_gate and self.shared_experts else None
        )
        # Always a checkpointed buffer (zeros unless auxiliary-loss-free balancing is on or a
        # bias was imported), so checkpoints and imports have the same keys whichever balancing
        # a run uses; `route_bias` routes with it even when it is never updated.
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("tokens_dropped", torch.zeros(()), persistent=False)
        self.register_buffer("step_aux", torch.zeros(()), persistent=False)
        self.reduce_stats: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.aux_grad_scale = 0.0
        self.last_aux: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None
        self.record_stats = True
        """False while a forward must leave no trace (the pipeline's shape-inference pass)."""

    def init_weights(self, out_std: float) -> None:
        trunc_normal_(self.router.gate.weight, 0.02)
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
        if self.shared_gate is not None:
            trunc_normal_(self.shared_gate.weight, 0.02)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.tokens_dropped.zero_()
        self.step_aux.zero_()

    def forward(self, x_bsd: torch.Tensor) -> torch.Tensor:
        """(bs, seq, dim) -> (bs, seq, dim)."""
        bs, seq, dim = x_bsd.shape
        x = x_bsd.reshape(-1, dim)
        use_bias = self.args.route_bias or self.args.bias_update_speed > 0
        bias = self.expert_bias if use_bias else None
        weights, experts, scores = self.router(x, bias)
        num_experts, k = self.args.num_experts, self.args.top_k
        flat = experts.flatten()  # (tokens * k,), token t's slots at t*k .. t*k+k-1
        # Static-shape count (bincount's output size depends on the data).
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        # Counted once per microbatch: not in paused forwards, not when an activation-
        # checkpointed block recomputes this forward in backward (`add_once`).
        count = self.record_stats
        if count:
            add_once(self.tokens_per_expert, counts)
        order = flat.argsort(stable=True)
        routed = self.experts(x[order // k], counts)  # (tokens * k, dim), grouped by expert
        # The shared expert before `routed` is read: under expert parallel the combine's
        # all-to-all is still in flight (its result is waited at its first use) and runs
        # beside it.
        shared = self._shared(x)
        routed = routed.float() * weights.flatten()[order, None]
        out = torch.zeros(x.shape[0], dim, dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, routed)
        out = out.to(x.dtype)
        if shared is not None:
            out = out + shared
        if self.record_stats:  # the recomputation reruns it too: the same saved tensors
            if self.args.load_balance_type == "sequence":
                out = self._load_balance(out, counts, scores, count, experts.view(bs, seq, -1))
            else:
                out = self._load_balance(out, counts, scores, count)
        return out.view(bs, seq, dim)

    def _shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output (tokens, dim), gated when `shared_gate`; None without."""
        if self.shared_experts is None:
            return None
        shared = self.shared_experts(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return shared

    def _load_balance(
        self,
        out: torch.Tensor,
        counts: torch.Tensor,
        scores: torch.Tensor,
        count: bool,
        experts_bsk: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record the aux loss of this microbatch (global, or sequence-wise when the chosen
        experts come as `experts_bsk` (bs, seq, k)); attach its gradient when training."""
        if self.args.load_balance_coeff <= 0:
            self.last_aux = None
            return out
        if experts_bsk is not None:
            share = self._sequence_share(scores, experts_bsk)
        else:
            stats = self.reduce_stats(
                torch.cat([counts.float(), scores.new_tensor([scores.shape[0]])]).detach()
            )
            global_counts, global_tokens = stats[:-1], stats[-1]
            f = global_counts / global_tokens  # token-slot fraction per expert; sums to k
            # This rank's share of E · Σ f_i · P_i (P over the global tokens): the shares sum
            # to the global loss, and the gradient through this rank's scores is the global one.
            share = self.args.num_experts * (f * scores.sum(0)).sum() / global_tokens
        if count:  # a recomputation gives the same value again, and adds nothing
            self.last_aux = share.detach()
            add_once(self.step_aux, self.last_aux)
        if self.training and self.aux_grad_scale and torch.is_grad_enabled():
            out = add_loss_grad(out, share, self.aux_grad_scale)
        return out

    def _sequence_share(self, scores: torch.Tensor, experts_bsk: torch.Tensor) -> torch.Tensor:
        """This rank's share of DeepSeek-V3's sequence-wise balance loss, the mean over the
        global microbatch's sequences of Σ_i f_i · P_i with, per sequence of T tokens,
        f_i = E / (k·T) · (tokens choosing expert i) and P_i = mean over its tokens of the
        normalized score s_i / Σ_j s_j (arXiv:2412.19437, eqs. 17-20). A sequence's statistics
        are its own, so only the count of sequences is summed over the ranks."""
        bs, seq, k = experts_bsk.shape
        e = self.args.num_experts
        chosen = torch.zeros(bs, seq, e, device=scores.device).scatter_(-1, experts_bsk, 1.0)
        f = chosen.sum(1) * (e / (k * seq))  # (bs, E), no gradient: which experts were chosen
        normalized = scores / scores.sum(-1, keepdim=True)  # (tokens, E); softmax: unchanged
        p = normalized.view(bs, seq, e).mean(1)  # (bs, E)
        sequences = self.reduce_stats(scores.new_tensor([bs]))[0]
        return (f * p).sum() / sequences

    @torch.no_grad()
    def end_step(self, load: torch.Tensor, update_bias: bool = True) -> None:
        """After an optimizer step, with `load` (E,) the step's token-slot counts summed over
        the ranks: keep it as `step_load`; with auxiliary-loss-free balancing (DeepSeek-V3) move
        each expert's bias by `bias_update_speed` toward the mean load (up when under-loaded,
        down when over-loaded) unless `update_bias` is False (a skipped optimizer step); reset
        the step's counters."""
        self.step_load = load.clone()
        if self.args.bias_update_speed > 0 and update_bias:
            self.expert_bias += self.args.bias_update_speed * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()
        self.tokens_dropped.zero_()
        self.step_aux.zero_()
