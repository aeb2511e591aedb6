"""The FlexAttention block masks (`common/flex_masks.py`), property-tested on generated
documents: every tile holding an allowed pair is computed, every tile marked full holds only
allowed pairs, and the element rule is the dense SDPA mask's; for windows that divide and do not
divide the 128-token tile, positions that run on or restart per document, and queries that are
one context-parallel rank's tokens (reordered by the load balancers) against all keys. And the
tiles' share from the shapes alone (the ledger's) equals the mask's own."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from titanlab.distributed.context_parallel.balance import shard_order
from titanlab.distributed.context_parallel.documents import allowed as allowed_pairs
from titanlab.models.common.flex_masks import (
    BLOCK,
    band_block_mask,
    band_fraction,
    computed_fraction,
    document_block_mask,
)


def random_documents(gen: torch.Generator, bs: int, seq: int) -> torch.Tensor:
    """(bs, seq) int64 document ids, lengths drawn from 1 to seq (a few long, many short)."""
    rows = []
    for _ in range(bs):
        ids, doc = [], 0
        while len(ids) < seq:
            cap = seq if torch.rand((), generator=gen) < 0.3 else 40
            length = int(torch.randint(1, cap + 1, (), generator=gen))
            ids += [doc] * length
            doc += 1
        rows.append(ids[:seq])
    return torch.tensor(rows)


def restarted(segments: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 with each document."""
    idx = torch.arange(segments.shape[1]).expand_as(segments)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(1).values
    return idx - first


def tiles(count: torch.Tensor, indices: torch.Tensor, nk: int) -> torch.Tensor:
    """(bs, nq, nk) bool of a BlockMask's listed tiles (count (bs, 1, nq), indices (bs, 1, nq, ·))."""
    bs, _, nq = count.shape
    dense = torch.zeros(bs, nq, nk, dtype=torch.bool)
    for b in range(bs):
        for i in range(nq):
            dense[b, i, indices[b, 0, i, : count[b, 0, i]].long()] = True
    return dense


def per_tile(pairs: torch.Tensor, reduce) -> torch.Tensor:
    """(bs, nq, nk) `reduce` (any / all) of (bs, q_len, kv_len) bool over each tile (the last
    tile's missing rows and columns count as allowed for all, disallowed for any)."""
    bs, q_len, kv_len = pairs.shape
    pad_q, pad_k = -q_len % BLOCK, -kv_len % BLOCK
    fill = reduce is torch.all
    padded = torch.nn.functional.pad(pairs, (0, pad_k, 0, pad_q), value=fill)
    t = padded.view(bs, (q_len + pad_q) // BLOCK, BLOCK, (kv_len + pad_k) // BLOCK, BLOCK)
    return reduce(reduce(t, dim=4), dim=2)


def check(mask, pairs: torch.Tensor) -> None:
    """`mask`'s tiles and element rule against the allowed (bs, q_len, kv_len) pairs."""
    nk = mask.kv_indices.shape[-1]
    partial = tiles(mask.kv_num_blocks, mask.kv_indices, nk)
    full = tiles(mask.full_kv_num_blocks, mask.full_kv_indices, nk)
    assert not (partial & full).any()
    some, every = per_tile(pairs, torch.any), per_tile(pairs, torch.all)
    assert not (some & ~(partial | full)).any(), "a tile with an allowed pair is skipped"
    assert not (full & ~every).any(), "a tile marked full holds a disallowed pair"
    bs, q_len, kv_len = pairs.shape
    elements = create_mask(mask.mask_mod, bs, 1, q_len, kv_len, device="cpu")[:, 0]
    assert torch.equal(elements, pairs)


@pytest.mark.parametrize("seed", range(12))
def test_document_tiles_hold_exactly_the_allowed_pairs(seed):
    gen = torch.Generator().manual_seed(seed)
    seq = int(torch.randint(1, 4, (), generator=gen)) * 128 + int(
        torch.randint(0, 128, (), generator=gen)
    )
    window = [None, 64, 100, 128, 200, 1][seed % 6]
    segments = random_documents(gen, 2, seq)
    positions = restarted(segments) if seed % 2 else torch.arange(seq).expand(2, seq)
    mask = document_block_mask(segments, positions, segments, positions, window)
    pairs = allowed_pairs(segments, positions, segments, positions)[:, 0]
    if window is not None:
        pairs &= positions[:, :, None] - positions[:, None, :] < window
    check(mask, pairs)


@pytest.mark.parametrize("balancer", ["head_tail", "work"])
@pytest.mark.parametrize("window", [None, 96])
def test_a_context_parallel_ranks_queries_against_all_keys(balancer, window):
    """Rank r's tokens (the balancer's order) as queries, every token as keys, as ring CP's
    all-gather attends them: the rule reads ids and positions, not indices."""
    gen = torch.Generator().manual_seed(7)
    seq, cp = 1024, 4
    segments = random_documents(gen, 2, seq)
    positions = restarted(segments)
    order = shard_order(segments, seq, 2, cp, balancer)
    seg_all, pos_all = segments.gather(1, order), positions.gather(1, order)
    for rank in range(cp):
        mine = slice(rank * seq // cp, (rank + 1) * seq // cp)
        seg_q, pos_q = seg_all[:, mine], pos_all[:, mine]
        mask = document_block_mask(seg_q, pos_q, seg_all, pos_all, window)
        pairs = allowed_pairs(seg_q, pos_q, seg_all, pos_all)[:, 0]
        if window is not None:
            pairs &= pos_q[:, :, None] - pos_all[:, None, :] < window
        check(mask, pairs)


@pytest.mark.parametrize(
    "q_len, kv_len, window",
    [(300, 300, None), (300, 300, 64), (1000, 1000, 100), (256, 1000, None), (129, 129, 128),
     (8192, 8192, 128), (1000, 1000, 1), (200, 700, 300)],
)  # fmt: skip
def test_the_band_from_shapes_alone(q_len, kv_len, window):
    mask = band_block_mask(q_len, kv_len, window, torch.device("cpu"))
    assert band_fraction(q_len, kv_len, window) == computed_fraction(mask)
    if kv_len <= 1000:
        q = torch.arange(kv_len - q_len, kv_len)[:, None]
        k = torch.arange(kv_len)[None, :]
        pairs = (k <= q) & ((q - k < window) if window is not None else True)
        check(mask, pairs[None])


def test_the_window_computes_about_two_windows_of_the_sequence():
    """Window 128 at 8192 tokens: each query tile meets its own and the one before, 2W/S."""
    assert band_fraction(8192, 8192, 128) == pytest.approx(2 * 128 / 8192, rel=0.01)
    assert band_fraction(131072, 131072, 128) == pytest.approx(2 * 128 / 131072, rel=0.01)
