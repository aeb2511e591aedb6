"""Load balancers of titanlab's context-parallel attention: each rank's attention work (the
(query, key) pairs the mask allows among its queries, and the non-empty 16 × 16 tiles of its
rows of the mask) for a batch of mixed document lengths, some crossing the shard boundaries.
The `work` balancer keeps max/mean ≤ 1.10 where contiguous shards do not; the figures print."""

from __future__ import annotations

import pytest
import torch

from titanlab.distributed.context_parallel.balance import (
    index_in_document,
    rank_blocks,
    rank_work,
    shard_order,
)


def mixed_documents(seq: int = 1024, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """(batch, seq) document ids: lengths drawn from 8 to seq/2, one long document per row."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = [seq // 2 + int(torch.randint(0, seq // 8, (1,), generator=g))]
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(8, seq // 6, (1,), generator=g)))
        g_perm = torch.randperm(len(lengths), generator=g).tolist()
        ids = torch.cat([torch.full((lengths[i],), k) for k, i in enumerate(g_perm)])
        rows.append(ids[:seq])
    return torch.stack(rows)


def spread(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_work_balancer_keeps_every_rank_within_10_percent(cp):
    segments = mixed_documents()
    figures = {}
    for balancer in ("none", "head_tail", "work"):
        order = shard_order(segments, 1024, 2, cp, balancer)
        assert torch.equal(order.sort(dim=1).values, torch.arange(1024).expand(2, 1024))
        figures[balancer] = (
            spread(rank_work(segments, order, cp)),
            spread([float(b) for b in rank_blocks(segments, order, cp)]),
        )
    print(
        f"\ncp {cp}, 2 rows of 1024 tokens, mixed documents: max/mean attention work "
        + ", ".join(f"{b} {w:.3f} (tiles {t:.3f})" for b, (w, t) in figures.items())
    )
    assert figures["work"][0] <= 1.10 and figures["work"][1] <= 1.10
    assert figures["none"][0] > 1.10  # contiguous shards are not balanced


def test_one_causal_document_head_tail_is_exact():
    order = shard_order(None, 64, 1, 4, "head_tail")
    assert rank_work(None, order, 4) == [520.0] * 4


def test_index_in_document_and_bad_input():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert index_in_document(segments).tolist() == [[0, 1, 2, 0, 1, 0]]
    with pytest.raises(ValueError, match="unknown load balancer 'lpt'; valid: work, head_tail"):
        shard_order(segments, 6, 1, 2, "lpt")
    with pytest.raises(ValueError, match="not divisible by 2·cp = 4"):
        shard_order(segments, 6, 1, 2, "head_tail")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_torchs_per_document_head_tail_against_work(cp):
    """torch 2.13's FlexAttention CP balancer for documents (`_PerDocumentHeadTailLoadBalancer`:
    chunks r and 2·cp−1−r of every document) needs each document's length a multiple of 2·cp
    (lengths that are not, as packed data gives, it refuses; `work` takes any). On such rows
    (the mixed lengths rounded up), sharded as torch shards a rearranged buffer (contiguous
    pieces: `_context_parallel_buffers`), its order keeps each document's chunks together, so
    ranks get whole documents' worth of work: max/mean 1.6-1.8 here, where `work` stays within
    1%. The figures print."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer,
    )

    rows, lengths = [], []
    for row in mixed_documents():
        sizes = [
            -(-int(n) // (2 * cp)) * 2 * cp for n in row.unique_consecutive(return_counts=True)[1]
        ]
        kept, total = [], 0
        for n in sizes:
            kept.append(min(n, 1024 - total))
            total += kept[-1]
            if total == 1024:
                break
        lengths.append(kept)
        rows.append(torch.cat([torch.full((n,), k) for k, n in enumerate(kept)]))
    segments = torch.stack(rows)
    torch_order = _PerDocumentHeadTailLoadBalancer(lengths, cp, "cpu")._generate_indices()
    figures = {
        "torch per-document head-tail": spread(rank_work(segments, torch_order, cp)),
        "work": spread(rank_work(segments, shard_order(segments, 1024, 2, cp, "work"), cp)),
    }
    print(f"\ncp {cp}, documents of lengths a multiple of {2 * cp}: max/mean attention work "
          + ", ".join(f"{b} {w:.3f}" for b, w in figures.items()))  # fmt: skip
    assert figures["work"] <= 1.10 < figures["torch per-document head-tail"]
    odd = [[5, 1024 - 5]]  # a 5-token document
    with pytest.raises(AssertionError):
        _PerDocumentHeadTailLoadBalancer(odd, cp, "cpu")._generate_indices()
