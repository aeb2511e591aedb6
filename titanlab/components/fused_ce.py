"""Chunked fused linear + cross-entropy: the output projection and the token cross-entropy over
chunks of tokens, so the (tokens × vocab) logits never exist whole, in forward or in backward.

The method of Liger Kernel's FusedLinearCrossEntropy and of Wijmans et al. 2024 ("Cut Your
Losses in Large-Vocabulary Language Models", arXiv:2411.09009), in plain PyTorch: for each chunk
of c tokens the logits (c × V) are computed, their log-sum-exp and the label's logit give the
chunk's loss, and, since the loss is the last op of the step, the gradient is computed right
there: d(Σ CE)/d(logits) = softmax(logits) − onehot(label) (0 on ignored positions), then
d/d(hidden) = g W and d/d(W) += gᵀ h. Backward only scales the stored gradients by the incoming
one. Peak extra memory: one chunk's logits (c × V fp32) instead of all of them (twice: the
logits and their gradient), at the cost of nothing recomputed.

On CPU and for every dtype: the logits of a chunk are computed in the input's dtype (as the
unfused head does under autocast) and the softmax / log-sum-exp in fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from titanlab.data.labels import IGNORE_INDEX


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
    grads: tuple[bool, bool], group: Any = None, offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(Σ CE, d/d hidden, d/d weight) of hidden (N, D) against labels (N,) through weight
    (V_local, D), rows [offset, offset + V_local) of the vocabulary (all of it without
    `group`); a gradient is an empty tensor unless asked for in `grads`. With a tp `group`,
    one MAX and one SUM all-reduce per chunk give the log-sum-exp over the whole vocabulary,
    and the hidden states' gradient is this rank's partial sum."""
    n, v_local = hidden.shape[0], weight.shape[0]
    grad_h = torch.empty_like(hidden) if grads[0] else hidden.new_empty(0)
    grad_w = (
        weight.new_zeros(weight.shape, dtype=torch.float32) if grads[1] else weight.new_empty(0)
    )
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        logits = (h @ weight.t()).float()  # (c, V_local): the only vocabulary-sized tensor
        keep = y != IGNORE_INDEX
        local = y - offset
        mine = keep & (local >= 0) & (local < v_local)  # the label's row is on this rank
        index = local.clamp(0, v_local - 1)[:, None]
        peak = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        picked = torch.where(mine, logits.gather(1, index)[:, 0], 0.0)
        g = logits.sub_(peak[:, None]).exp_()  # in place: one (c, V) tensor in all
        sums = torch.stack([g.sum(-1), picked])
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = peak + torch.log(sums[0])
        total += torch.where(keep, lse - sums[1], 0.0).sum()
        if grads[0] or grads[1]:  # d(Σ CE)/d logits = softmax − onehot, 0 where ignored
            g.mul_(torch.exp(peak - lse)[:, None])
            g.scatter_add_(1, index, torch.where(mine, -1.0, 0.0)[:, None])
            g = g.mul_(keep[:, None]).to(h.dtype)
            if grads[0]:
                grad_h[start : start + chunk_size] = g @ weight
            if grads[1]:
                grad_w.add_(g.t().float() @ h.float())
    return total, grad_h, grad_w


class _GradientsInForward(torch.autograd.Function):
    """A loss whose gradients w.r.t. (hidden, weight) are computed with it, in forward, by
    `compute(grads) -> (total, grad_h, grad_w)` (`_chunked`, `_distill_chunks`); backward
    scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, compute):  # type: ignore[override]
        grads = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        total, grad_h, grad_w = compute(grads)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        dh = grad_h * grad_out.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        dw = (grad_w * grad_out).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024
) -> torch.Tensor:
    """Σ over tokens of cross_entropy(hidden @ weightᵀ, labels), without materializing the
    logits: equal to `cross_entropy_sum(F.linear(hidden, weight), labels)` (fp32 softmax).

    Args:
        hidden: (..., D) float, the final norm's output; weight: (V, D), the output head's;
        labels: (...) int64, -100 ignored; chunk_size: tokens per chunk (> 0).
    Returns:
        0-dim fp32 tensor, differentiable w.r.t. hidden and weight.
    Raises:
        ValueError: chunk_size <= 0.
    """
    return _apply(hidden, weight, labels, chunk_size, None, 0)


def vocab_parallel_linear_cross_entropy_sum(
    hidden: DTensor, weight: DTensor, labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """`linear_cross_entropy_sum` under tensor parallel: `hidden` (..., D) a DTensor replicated
    over the 1-D tp mesh of `weight` (V, D), a DTensor sharded by rows (`Shard(0)`, as
    ColwiseParallel splits a head); `labels` the same on every tp rank. Returns the 0-dim fp32
    sum, equal on every tp rank (a plain tensor); the gradients reach `hidden` as partial sums
    (reduced by its DTensor) and `weight` as its shards."""
    mesh = weight.device_mesh
    v, per = weight.shape[0], -(-weight.shape[0] // mesh.size())  # torch.chunk's split
    offset = min(mesh.get_local_rank() * per, v)
    h = hidden.to_local(grad_placements=[Partial()])
    return _apply(h, weight.to_local(), labels, chunk_size, mesh.get_group(), offset)


def _apply(hidden, weight, labels, chunk_size: int, group, offset: int) -> torch.Tensor:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    compute = functools.partial(_chunked, flat, weight, flat_labels, chunk_size, group=group,
                                offset=offset)  # fmt: skip
    return _with_gradients(flat, weight, compute)


def _with_gradients(hidden: torch.Tensor, weight: torch.Tensor, compute) -> torch.Tensor:
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _GradientsInForward.apply(hidden, weight, compute)
    return compute((False, False))[0]


def _distill_chunks(
    hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, alpha: float,
    temperature: float, grads: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(Σ distillation loss, d/d hidden, d/d weight) over target tokens, chunk by chunk: the
    loss of `titanlab.posttrain.distill` (α · CE + (1 − α) · T² · KL(p_t,T ‖ p_s,T)), whose
    gradient w.r.t. the student's logits is α (softmax(s) − onehot) + (1 − α) T (softmax(s/T)
    − softmax(t/T)) on target positions, 0 elsewhere."""
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if grads[0] else hidden.new_empty(0)
    grad_w = (
        weight.new_zeros(weight.shape, dtype=torch.float32) if grads[1] else weight.new_empty(0)
    )
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    t = temperature
    for start in range(0, n, chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        student = (h @ weight.t()).float()  # (c, V): with the teacher's, 4 such tensors at most
        teacher = (teacher_hidden[start : start + chunk_size] @ teacher_weight.t()).float()
        keep = (y != IGNORE_INDEX)[:, None]
        index = y.clamp(min=0)[:, None]
        log_pt_t = torch.log_softmax(teacher.div_(t), dim=-1)
        del teacher
        log_ps_t = torch.log_softmax(student / t, dim=-1)
        log_p = torch.log_softmax(student, dim=-1)
        del student
        hard = -log_p.gather(1, index)
        pt_t = log_pt_t.exp()
        kl = log_pt_t.sub_(log_ps_t).mul_(pt_t).sum(-1, keepdim=True)
        del log_pt_t
        total += torch.where(keep, alpha * hard + (1.0 - alpha) * t**2 * kl, 0.0).sum()
        if grads[0] or grads[1]:
            g = log_p.exp_().mul_(alpha)
            g.scatter_add_(1, index, torch.full_like(hard, -alpha))
            g.add_(log_ps_t.exp_().sub_(pt_t), alpha=(1.0 - alpha) * t)
            g = g.mul_(keep).to(h.dtype)
            if grads[0]:
                grad_h[start : start + chunk_size] = g @ weight
            if grads[1]:
                grad_w.add_(g.t().float() @ h.float())
    return total, grad_h, grad_w


def linear_distillation_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor, labels: torch.Tensor, *, alpha: float, temperature: float,
    chunk_size: int = 1024,
) -> torch.Tensor:  # fmt: skip
    """`titanlab.posttrain.distill.distillation_loss_sum` of the student's logits hidden @
    weightᵀ and the teacher's teacher_hidden @ teacher_weightᵀ, without materializing either:
    at most one chunk of each (chunk_size × V, fp32) exists at once.

    Args:
        hidden: (..., D) the student's final-norm output; weight: (V, D) its head.
        teacher_hidden: (..., D_t) the teacher's; teacher_weight: (V, D_t) (no gradient).
        labels: (...) int64, -100 ignored. alpha in [0, 1]; temperature > 0; chunk_size > 0.
    Returns:
        0-dim fp32 tensor, differentiable w.r.t. hidden and weight.
    Raises:
        ValueError: chunk_size <= 0.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    flat = hidden.reshape(-1, hidden.shape[-1])
    compute = functools.partial(
        _distill_chunks, flat, weight, teacher_hidden.reshape(-1, teacher_hidden.shape[-1]),
        teacher_weight.detach(), labels.reshape(-1), chunk_size, alpha, temperature,
    )  # fmt: skip
    return _with_gradients(flat, weight, compute)


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weightᵀ / T)[target] per token, chunk by chunk. Unlike the loss,
    what multiplies each log-probability is known only in backward (the RL objective comes
    after), so backward recomputes each chunk's logits from the saved hidden states: one more
    head matmul, and still no (tokens × vocab) tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = (hidden[start : start + chunk_size] @ weight.t()).float() / temperature
            picked = logits.gather(1, targets[start : start + chunk_size, None])[:, 0]
            out[start : start + chunk_size] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[start : start + ctx.chunk_size]
            t, go = (
                targets[start : start + ctx.chunk_size],
                grad_out[start : start + ctx.chunk_size],
            )
            logits = (h @ weight.t()).float() / ctx.temperature
            # d logp_i / d logits_i = (onehot − softmax) / T, times the incoming gradient
            g = torch.softmax(logits, dim=-1).mul_(-go[:, None])
            g.scatter_add_(1, t[:, None], go[:, None].float())
            g = g.div_(ctx.temperature).to(h.dtype)
            if want_h:
                grad_h[start : start + ctx.chunk_size] = g @ weight
            if want_w:
                grad_w.add_(g.t().float() @ h.float())
        return grad_h, grad_w.to(weight.dtype) if want_w else None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
    chunk_size: int = 1024,
) -> torch.Tensor:  # fmt: skip
    """log softmax(hidden @ weightᵀ / temperature)[targets] per position without materializing
    the logits: equal to `titanlab.posttrain.rl.objectives.token_logprobs(F.linear(hidden,
    weight), targets, temperature)`.

    Args:
        hidden: (..., D); weight: (V, D); targets: (...) int64 (every one a vocabulary id).
    Returns:
        (...) float32, differentiable w.r.t. hidden and weight.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = _ChunkedLogprobs.apply(flat, weight, targets.reshape(-1), temperature, chunk_size)
    return out.view(targets.shape)


class FusedLossHead(nn.Linear):
    """The output head of a model trained with the chunked fused loss: a bias-free Linear (its
    `weight` keeps the name, so checkpoints and exports are unchanged) that returns logits as
    usual, or, while `targets(labels)` is active, the summed cross-entropy of its input against
    `labels` computed by `linear_cross_entropy_sum` (0-dim fp32), so the model's forward ends
    in the loss and the logits never exist. Swapped in from outside by `use_fused_loss`,
    before parallelism is applied, so FSDP's hooks on the head (gather, reshard, reduce-scatter)
    run as for the plain Linear."""

    returns_loss = True  # tensor parallel splits it with `FusedHeadParallel`

    def __init__(self, in_features: int, out_features: int, chunk_size: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.chunk_size = chunk_size
        self.labels: torch.Tensor | None = None
        self.temperature = 0.0  # > 0: return log-probabilities of `labels` (`fused_logprobs`)
        self.distill: tuple[torch.Tensor, torch.Tensor, float, float] | None = None
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None  # `teacher_hidden`
        self.capture = False
        self.liger = False  # `titanlab.components.liger.apply_liger`: Liger's loss kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.capture:  # `teacher_hidden`: the input and the (gathered) weight, no logits
            self.captured = (x, self.weight)
            return x
        if self.labels is None:
            return F.linear(x, self.weight)
        if self.distill is not None:  # `fused_distillation`
            assert not isinstance(self.weight, DTensor), "tensor parallel: not yet"
            t_hidden, t_weight, alpha, t = self.distill
            return linear_distillation_loss_sum(
                x, self.weight, t_hidden, t_weight, self.labels, alpha=alpha, temperature=t,
                chunk_size=self.chunk_size,
            )  # fmt: skip
        if self.temperature:  # `fused_logprobs`
            assert not isinstance(self.weight, DTensor), "tensor parallel: not yet"
            return chunked_token_logprobs(
                x, self.weight, self.labels, self.temperature, self.chunk_size
            )
        if isinstance(self.weight, DTensor):  # tensor parallel (`FusedHeadParallel`)
            assert isinstance(x, DTensor)
            return vocab_parallel_linear_cross_entropy_sum(
                x, self.weight, self.labels, self.chunk_size
            )
        if self.liger:
            from titanlab.components.liger import liger_linear_cross_entropy_sum

            return liger_linear_cross_entropy_sum(x, self.weight, self.labels)
        return linear_cross_entropy_sum(x, self.weight, self.labels, self.chunk_size)


def use_fused_loss(model: nn.Module, chunk_size: int) -> None:
    """Swap `model.output` (a bias-free nn.Linear; the model on any device, meta included) for
    a `FusedLossHead` holding the same weight Parameter."""
    old = model.output
    assert isinstance(old, nn.Linear) and old.bias is None, "the output head is a bias-free Linear"
    with torch.device("meta"):  # no initialization drawn: the weight is the old head's
        head = FusedLossHead(old.in_features, old.out_features, chunk_size)
    head.weight = old.weight
    model.output = head


@contextlib.contextmanager
def fused_targets(model: nn.Module, labels: torch.Tensor) -> Iterator[None]:
    """Within, `model(inputs)` returns the summed token cross-entropy against `labels` ((bs,
    seq) int64, -100 ignored) instead of logits."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels = labels
    try:
        yield
    finally:
        head.labels = None


@contextlib.contextmanager
def fused_logprobs(model: nn.Module, targets: torch.Tensor, temperature: float) -> Iterator[None]:
    """Within, `model(inputs)` returns log softmax(logits / temperature)[targets] per position
    ((bs, seq) float32) instead of logits: the RL and preference objectives' forward."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels, head.temperature = targets, temperature
    try:
        yield
    finally:
        head.labels, head.temperature = None, 0.0


def teacher_hidden(
    teacher: nn.Module, inputs: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's forward up to its head, for `fused_distillation`: (hidden (bs, seq, D_t),
    head weight (V, D_t)). The weight is the one the head's forward saw: under FSDP the
    all-gathered tensor of the norm + head group, which is never resharded after forward
    (`titanlab.distributed.parallelize`), so it stays valid until the next forward."""
    head = teacher.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(teacher) first"
    head.capture = True
    try:
        teacher(inputs, **kwargs)
        assert head.captured is not None
        hidden, weight = head.captured
    finally:
        head.capture, head.captured = False, None
    return hidden, weight


@contextlib.contextmanager
def fused_distillation(
    model: nn.Module, labels: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor],
    alpha: float, temperature: float,
) -> Iterator[None]:  # fmt: skip
    """Within, `model(inputs)` returns the summed distillation loss against `labels` and the
    teacher's (hidden, head weight) from `teacher_hidden` (`linear_distillation_loss_sum`)."""
    head = model.output
    assert isinstance(head, FusedLossHead), "use_fused_loss(model) first"
    head.labels, head.distill = labels, (*teacher, alpha, temperature)
    try:
        yield
    finally:
        head.labels, head.distill = None, None
