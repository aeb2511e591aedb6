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

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial

from titanlab.components.fused_ce_chunks import (
    _compiled_chunk,
    _eager_chunk,
    _eager_local_chunk,
)
from titanlab.components.head_gradient import RowGradients
from titanlab.data.labels import IGNORE_INDEX


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
    grads: tuple[bool, ...], group: Any = None, offset: int = 0,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None, compiled: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(Σ CE, d/d hidden, d/d weight) of hidden (N, D) against labels (N,) through weight
    (V_local, D), rows [offset, offset + V_local) of the vocabulary (all of it without
    `group`); a gradient is an empty tensor unless asked for in `grads`. With a tp `group`,
    one MAX and one SUM all-reduce per chunk give the log-sum-exp over the whole vocabulary,
    and the hidden states' gradient is this rank's partial sum.

    `low_rank` = (u (N, r), b (V, r)) adds u bᵀ to the logits (a LoRA adapter on the head:
    u = scaling · A x); then also (d/d u, d/d b) are returned, as `grads[2:]` asks.

    `compiled` (without `group`, when a gradient is asked for): each chunk's work between its
    GEMMs runs as one `torch.compile`d function (`_chunk_loss_and_grad`), fused into a few
    kernels instead of eager passes over the (c, V) logits."""
    n, v_local = hidden.shape[0], weight.shape[0]
    grad_h = torch.empty_like(hidden) if grads[0] else hidden.new_empty(0)
    # Without `low_rank`, empty stand-ins that nothing reads.
    u, b = low_rank if low_rank is not None else (hidden.new_empty(0), weight.new_empty(0))
    want_u, want_b = (grads[2], grads[3]) if low_rank is not None else (False, False)
    grad_u = torch.empty_like(u) if want_u else hidden.new_empty(0)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    compute, hidden, weight = _operands(hidden, weight)
    # the weight gradients Gᵀ hidden (and Gᵀ u), a group of chunks' rows of G at a time
    xs = ([hidden] if grads[1] else []) + ([u] if want_b else [])
    summed = RowGradients(xs, v_local, chunk_size, compute) if xs else None
    for start in range(0, n, chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        logits = h @ weight.t()
        if low_rank is not None:
            logits = logits + u[start : start + chunk_size] @ b.t()
        if compiled and group is None and any(grads):  # upcast inside, g in `compute`
            out = summed.next_rows(h.shape[0]) if summed is not None else None
            piece, g = _compiled_chunk()(logits, y, out)
        elif group is None and any(grads):  # eager without tensor parallel: fewer passes
            out = summed.next_rows(h.shape[0]) if summed is not None else None
            piece, g = _eager_local_chunk(logits, y, out)
            g = g if out is not None else g.to(h.dtype)
        else:  # (c, V_local) in fp32: the only vocabulary-sized tensor
            piece, g = _eager_chunk(logits.float(), y, any(grads), group, offset, v_local)
            if any(grads):
                g = summed.keep(g) if summed is not None else g.to(h.dtype)
        total += piece
        if any(grads):
            if grads[0]:
                grad_h[start : start + chunk_size] = g @ weight
            if want_u:
                grad_u[start : start + chunk_size] = g @ b
            if summed is not None:
                summed.flush(start + h.shape[0])
    products = summed.results() if summed is not None else []
    grad_w = products.pop(0) if grads[1] else weight.new_empty(0)
    grad_b = products.pop(0) if want_b else b.new_empty(0)
    if low_rank is None:
        return total, grad_h, grad_w
    return total, grad_h, grad_w, grad_u, grad_b


def _operands(
    hidden: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    """(the GEMMs' dtype, hidden, weight) with both cast to it once: autocast's dtype where it
    is on (one GPU: fp32 weights, bf16 GEMMs), else theirs. Autocast would cast the head's
    weight again in every chunk's two GEMMs (3.2 GB of traffic each for Llama 3's head)."""
    compute = (hidden[:1] @ weight[:1].t()).dtype
    return compute, hidden.to(compute), weight.to(compute)


class _GradientsInForward(torch.autograd.Function):
    """A loss whose gradients w.r.t. its tensors (hidden, weight[, u, b]) are computed with it,
    in forward, by `compute(grads) -> (total, *gradients)` (`_chunked`, `_distill_chunks`);
    backward scales them by the incoming gradient, each cast to its tensor's dtype."""

    @staticmethod
    def forward(ctx, compute, *tensors):  # type: ignore[override]
        total, *grads = compute(tuple(bool(n) for n in ctx.needs_input_grad[1:]))
        ctx.save_for_backward(*grads)
        ctx.dtypes = [t.dtype for t in tensors]
        return total

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        out: list[torch.Tensor | None] = [None]
        for g, need, dtype in zip(ctx.saved_tensors, ctx.needs_input_grad[1:], ctx.dtypes):
            if not need:
                out.append(None)
                continue
            scaled = torch.empty(g.shape, dtype=dtype, device=g.device)  # scale and cast, one pass
            out.append(torch.mul(g, grad_out.to(g.dtype), out=scaled))
        return tuple(out)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    compiled: bool = False,
) -> torch.Tensor:
    """Σ over tokens of cross_entropy(hidden @ weightᵀ, labels), without materializing the
    logits: equal to `cross_entropy_sum(F.linear(hidden, weight), labels)` (fp32 softmax).

    Args:
        hidden: (..., D) float, the final norm's output; weight: (V, D), the output head's;
        labels: (...) int64, -100 ignored; chunk_size: tokens per chunk (> 0); compiled: each
        chunk's softmax and gradient through torch.compile (the `compile.components` "loss").
    Returns:
        0-dim fp32 tensor, differentiable w.r.t. hidden and weight.
    Raises:
        ValueError: chunk_size <= 0.
    """
    return _apply(hidden, weight, labels, chunk_size, None, 0, compiled)


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


def _apply(
    hidden, weight, labels, chunk_size: int, group, offset: int, compiled: bool = False
) -> torch.Tensor:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    compute = functools.partial(_chunked, flat, weight, flat_labels, chunk_size, group=group,
                                offset=offset, compiled=compiled)  # fmt: skip
    return _with_gradients(compute, flat, weight)


def lora_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    u: torch.Tensor,
    b: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 1024,
    compiled: bool = False,
) -> torch.Tensor:
    """`linear_cross_entropy_sum` of a head with a LoRA adapter: logits = hidden Wᵀ + u Bᵀ,
    where u = scaling · A dropout(hidden) is computed by the caller (so its gradient reaches A
    and hidden through autograd), without materializing the logits.

    Args:
        hidden: (..., D); weight: (V, D), the frozen base head; u: (..., r); b: (V, r), the
        adapter's B; labels: (...) int64, -100 ignored; chunk_size: tokens per chunk (> 0);
        compiled: as `linear_cross_entropy_sum`'s.
    Returns:
        0-dim fp32 tensor, differentiable w.r.t. hidden, weight, u and b.
    Raises:
        ValueError: chunk_size <= 0.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0")
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    flat_u = u.reshape(-1, u.shape[-1])
    compute = functools.partial(_chunked, flat, weight, flat_labels, chunk_size,
                                low_rank=(flat_u, b), compiled=compiled)  # fmt: skip
    return _with_gradients(compute, flat, weight, flat_u, b)


def _with_gradients(compute, *tensors: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _GradientsInForward.apply(compute, *tensors)
    return compute((False,) * len(tensors))[0]


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
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    t = temperature
    compute, hidden, weight = _operands(hidden, weight)
    summed = RowGradients([hidden], weight.shape[0], chunk_size, compute) if grads[1] else None
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
            g = g.mul_(keep)
            g = summed.keep(g) if summed is not None else g.to(h.dtype)
            if grads[0]:
                grad_h[start : start + chunk_size] = g @ weight
            if summed is not None:
                summed.flush(start + h.shape[0])
    grad_w = summed.results()[0] if summed is not None else weight.new_empty(0)
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
    return _with_gradients(compute, flat, weight)


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
        out_dtype = weight.dtype
        compute, hidden, weight = _operands(hidden, weight)
        summed = (
            RowGradients([hidden], weight.shape[0], ctx.chunk_size, compute) if want_w else None
        )
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
            g = g.div_(ctx.temperature)
            g = summed.keep(g) if summed is not None else g.to(h.dtype)
            if want_h:
                grad_h[start : start + ctx.chunk_size] = g @ weight
            if summed is not None:
                summed.flush(start + h.shape[0])
        grad_w = summed.results()[0].to(out_dtype) if summed is not None else None
        return grad_h, grad_w, None, None, None


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
