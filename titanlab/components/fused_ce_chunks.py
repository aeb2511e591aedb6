"""One chunk of the fused linear cross-entropy (`titanlab.components.fused_ce`): the chunk's
summed cross-entropy and its gradient w.r.t. the logits, softmax − onehot (0 on ignored
positions), in three forms: with tensor parallel (`_eager_chunk`: the vocabulary split over
ranks, the log-sum-exp all-reduced), eager on one rank's whole vocabulary
(`_eager_local_chunk`), and compiled (`_compiled_chunk`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from titanlab.components.compiled import compile_function
from titanlab.data.labels import IGNORE_INDEX


def _eager_chunk(
    logits: torch.Tensor, y: torch.Tensor, grad: bool, group: Any, offset: int, v_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ CE of the chunk, d(Σ CE)/d logits if `grad`) of fp32 `logits` (c, V_local), computed
    in place on them: one (c, V) tensor in all. With a tp `group`, one MAX and one SUM
    all-reduce give the log-sum-exp over the whole vocabulary."""
    keep = y != IGNORE_INDEX
    local = y - offset
    mine = keep & (local >= 0) & (local < v_local)  # the label's row is on this rank
    index = local.clamp(0, v_local - 1)[:, None]
    peak = logits.max(dim=-1).values
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    picked = torch.where(mine, logits.gather(1, index)[:, 0], 0.0)
    g = logits.sub_(peak[:, None]).exp_()
    sums = torch.stack([g.sum(-1), picked])
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    lse = peak + torch.log(sums[0])
    piece = torch.where(keep, lse - sums[1], 0.0).sum()
    if grad:  # d(Σ CE)/d logits = softmax − onehot, 0 where ignored (mine ⊆ keep)
        g.mul_((torch.exp(peak - lse) * keep)[:, None])
        g.scatter_add_(1, index, torch.where(mine, -1.0, 0.0)[:, None])
    return piece, g


def _eager_local_chunk(
    logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ CE of the chunk in fp32, d(Σ CE)/d logits) of `logits` (c, V) in the GEMMs' dtype,
    without tensor parallel, in eager mode, in as few passes over the (c, V) logits as eager
    kernels allow: the row maximum, exp(logits − max) in fp32 (the upcast in the subtraction's
    pass), its row sum, the label's term (c elements), and the scaling to the softmax with the
    ignored rows' zeros and the cast to `out`'s dtype in one pass (written into `out` when
    given, else in place). The label's −1 is added before the scaling (as −1 / scale), so it is
    rounded to `out`'s dtype once, with the rest."""
    keep = y != IGNORE_INDEX
    index = y.clamp(0, logits.shape[1] - 1)[:, None]
    peak = logits.max(dim=-1).values.float()  # exact in the logits' own dtype
    picked = logits.gather(1, index)[:, 0].float()
    e = torch.sub(logits, peak[:, None]).exp_()  # fp32 (peak is), the upcast in the same pass
    lse = peak + torch.log(e.sum(-1))
    piece = torch.where(keep, lse - picked, 0.0).sum()
    scale = torch.exp(peak - lse)  # softmax = e · scale; lse − peak <= log V, so scale > 0
    e.scatter_add_(1, index, torch.where(keep, -1.0 / scale, 0.0)[:, None])
    row_scale = (scale * keep)[:, None]
    if out is None:
        return piece, e.mul_(row_scale)
    return piece, torch.mul(e, row_scale, out=out)


def _chunk_loss_and_grad(
    logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """`_eager_chunk`'s arithmetic without tensor parallel, for torch.compile: (Σ CE of the
    chunk in fp32, d(Σ CE)/d logits in the logits' dtype, written into `out` when given) of
    logits (c, V) in the GEMMs' dtype against labels (c,). The upcast to fp32 and the
    gradient's cast back happen inside the compiled kernels: the (c, V) fp32 logits are never
    written to memory, and the gradient goes straight to `out` (`RowGradients`' rows)."""
    out_dtype = logits.dtype
    logits = logits.float()
    keep = y != IGNORE_INDEX
    index = y.clamp(0, logits.shape[1] - 1)[:, None]
    peak = logits.max(dim=-1).values
    e = (logits - peak[:, None]).exp()
    lse = peak + torch.log(e.sum(-1))
    piece = torch.where(keep, lse - logits.gather(1, index)[:, 0], 0.0).sum()
    g = (e * torch.exp(peak - lse)[:, None]).scatter_add(
        1, index, torch.where(keep, -1.0, 0.0)[:, None]
    )
    g = (g * keep[:, None]).to(out_dtype)
    if out is None:
        return piece, g
    out.copy_(g)
    return piece, out


@functools.cache
def _compiled_chunk():
    """`_chunk_loss_and_grad` compiled once per process (a new chunk length, the last chunk's,
    compiles a dynamic-shape graph once)."""
    return compile_function(_chunk_loss_and_grad)
