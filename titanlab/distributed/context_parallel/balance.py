"""Which tokens each context-parallel rank holds: load balancers for masked attention.

Under ring context parallel every rank computes attention for its own queries against all keys,
so its work is the number of (query, key) pairs the mask allows among its queries. With a causal
mask a token at index i sees i + 1 keys; with a document mask it sees its index inside its
document + 1. Contiguous shards then load the last rank most (causal) or whichever rank holds
the long documents' tails (documents).

Balancers (`parallelism.context_parallel_load_balancer`):
- `none`: contiguous shards (rank r holds tokens [r·S/cp, (r+1)·S/cp)).
- `head_tail`: the sequence in 2·cp chunks, rank r holding chunks r and 2·cp−1−r (the
  balancer of PyTorch's causal context parallel; Megatron-Core's "load-balanced" CP split).
  Exact for one causal document, not for mixed documents.
- `work` (default): the window in blocks of equal size, each block's work read from the mask
  (Σ over its tokens of the keys they see), the blocks dealt to ranks heaviest first to the
  least-loaded rank that still has room (longest-processing-time scheduling with equal block
  counts per rank). It adapts to any mix of document lengths; the measured spread is in
  `tests/unit/distributed/context_parallel/test_balance.py` and docs/parallelism.md.

A rank's tokens need not be contiguous: masks are built from each token's document id and
position (`titanlab.distributed.context_parallel.documents`), never from its index in the shard.
"""

from __future__ import annotations

import torch

BALANCERS = ("work", "head_tail", "none")


def index_in_document(segments: torch.Tensor) -> torch.Tensor:
    """(bs, S) int64: each token's index inside its document (0 at a document's first token).
    `segments`: (bs, S) int64 document ids, non-decreasing along each row."""
    seq = segments.shape[1]
    idx = torch.arange(seq, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def token_work(segments: torch.Tensor | None, seq: int, batch: int) -> torch.Tensor:
    """(bs, S) float64: the keys each query may attend (its index in its document + 1; the
    causal index + 1 without documents)."""
    if segments is None:
        return torch.arange(1, seq + 1, dtype=torch.float64).expand(batch, seq).clone()
    return (index_in_document(segments) + 1).to(torch.float64)


def _blocks(seq: int, cp: int) -> int:
    """Blocks per window for the `work` balancer: a multiple of cp dividing seq, at most 16
    per rank (finer blocks balance better; 16 per rank already come within a few percent)."""
    for per_rank in range(16, 0, -1):
        if seq % (cp * per_rank) == 0:
            return cp * per_rank
    raise ValueError(f"seq_len {seq} is not divisible by cp {cp}")


def shard_order(segments: torch.Tensor | None, seq: int, batch: int, cp: int, balancer: str):
    """(bs, S) int64 permutation of each row's token indices: columns [r·S/cp, (r+1)·S/cp) are
    rank r's tokens, in increasing index order.

    Args:
        segments: (bs, S) int64 document ids, or None (one causal document per row).
        seq, batch: S and bs. cp: context parallel degree (divides S). balancer: one of
            `BALANCERS`.
    Raises:
        ValueError: an unknown balancer, or S not divisible by cp (2·cp for head_tail).
    """
    if balancer not in BALANCERS:
        raise ValueError(f"unknown load balancer {balancer!r}; valid: {', '.join(BALANCERS)}")
    device = segments.device if segments is not None else torch.device("cpu")
    if balancer == "none" or cp == 1:
        if seq % cp:
            raise ValueError(f"seq_len {seq} is not divisible by cp {cp}")
        return torch.arange(seq, device=device).expand(batch, seq).clone()
    if balancer == "head_tail":
        if seq % (2 * cp):
            raise ValueError(f"seq_len {seq} is not divisible by 2·cp = {2 * cp}")
        chunks = torch.arange(seq, device=device).view(2 * cp, seq // (2 * cp))
        order = torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])
        return order.expand(batch, seq).clone()
    n_blocks = _blocks(seq, cp)
    size, per_rank = seq // n_blocks, n_blocks // cp
    work = token_work(segments, seq, batch).cpu().view(batch, n_blocks, size).sum(-1)
    rows = []
    for b in range(batch):
        load = [0.0] * cp
        owned: list[list[int]] = [[] for _ in range(cp)]
        for block in sorted(range(n_blocks), key=lambda k: (-float(work[b, k]), k)):
            rank = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: load[r])
            owned[rank].append(block)
            load[rank] += float(work[b, block])
        blocks = [k for r in range(cp) for k in sorted(owned[r])]
        rows.append(torch.cat([torch.arange(k * size, (k + 1) * size) for k in blocks]))
    return torch.stack(rows).to(device)


def rank_work(segments: torch.Tensor | None, order: torch.Tensor, cp: int) -> list[float]:
    """Attention work of each rank under `order` (`shard_order`'s): Σ over the rank's queries
    of the keys the mask lets them see, summed over the batch."""
    batch, seq = order.shape
    work = token_work(segments, seq, batch).to(order.device).gather(1, order)
    return [float(w) for w in work.view(batch, cp, seq // cp).sum(dim=(0, 2))]


def rank_blocks(
    segments: torch.Tensor | None, order: torch.Tensor, cp: int, block: int = 16
) -> list[int]:
    """Non-empty (block × block) tiles of each rank's rows of the mask: the unit a blocked
    attention kernel (flash, flex) skips or computes. Rank r's queries (its columns of
    `order`, in blocks of `block`) against all keys in index order."""
    batch, seq = order.shape
    segs = segments if segments is not None else torch.zeros(batch, seq, dtype=torch.long)
    counts = [0] * cp
    keys = torch.arange(seq)
    for b in range(batch):
        allowed = (segs[b][:, None] == segs[b][None, :]) & (keys[None, :] <= keys[:, None])
        for r in range(cp):
            rows = allowed[order[b, r * seq // cp : (r + 1) * seq // cp].cpu()]  # (S/cp, S)
            tiles = rows.view(-1, block, seq // block, block).any(dim=(1, 3))
            counts[r] += int(tiles.sum())
    return counts
