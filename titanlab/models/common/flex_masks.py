"""Block-sparse masks for FlexAttention, built block by block: no (queries × keys) tensor.

FlexAttention (`torch.nn.attention.flex_attention`; Dong et al. 2024, "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", arXiv:2412.05496) computes only
the (128 × 128) tiles its `BlockMask` lists: *full* tiles run without a mask, *partial* tiles
apply the `mask_mod` element-wise, the rest are skipped. torch's `create_block_mask` finds the
tiles by evaluating `mask_mod` on every (query, key) pair, an S × S boolean tensor unless it is
compiled; here the tiles come from per-tile ranges instead, so building a mask costs
(S / 128)² comparisons and works on any device and on fake tensors (the ledger):

- Each token has a document id (`segments`) and a position (`positions`: its index when
  positions run on through the window, else restarting per document). Query i may attend key
  j when both are in the same document, position_j ≤ position_i and, with a window of W,
  position_i − position_j < W (the rule of
  `titanlab.distributed.context_parallel.documents.allowed`, which holds for any order of the
  tokens, as context parallel's load balancing reorders them).
- A tile can hold an allowed pair only if the query block's and key block's id ranges overlap,
  the keys' smallest position is ≤ the queries' largest, and (window) the queries' smallest
  position minus the keys' largest is < W: otherwise it is skipped. It is *full* when both
  blocks hold one and the same document, every key precedes every query, and (window) the
  queries' largest position minus the keys' smallest is < W. Everything else is partial, so the
  mask_mod decides there: the result is exact whatever the tiling (a tile listed as partial
  that holds no allowed pair only costs its compute).

Without documents (`segments` None) the rule is the causal band on indices, the queries being
the last `q_len` of `kv_len` positions (a cache's tail), with the window when given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128
"""Query and key rows per tile (FlexAttention's default `BLOCK_SIZE`)."""


def _block_ranges(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each block of `block` entries along dim 1 of (bs, n) int64 `values`; the
    last block's missing entries repeat its last value (so they change neither)."""
    bs, n = values.shape
    pad = -n % block
    if pad:
        values = torch.cat([values, values[:, -1:].expand(bs, pad)], dim=1)
    tiles = values.view(bs, -1, block)
    return tiles.amin(-1), tiles.amax(-1)


def _indices(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (bs, 1, nq) int32, indices (bs, 1, nq, nk) int32) of the True tiles of each row
    of `allowed` (bs, nq, nk) bool, listed first in ascending order (FlexAttention's layout)."""
    nk = allowed.shape[-1]
    count = allowed.sum(-1, dtype=torch.int32)
    order = torch.arange(nk, device=allowed.device)
    # True tiles keep their index, False ones sort after them: key nk + index
    keys = torch.where(allowed, order, order + nk)
    indices = keys.argsort(dim=-1).to(torch.int32)
    return count[:, None], indices[:, None]


def tile_classes(
    q_segments: torch.Tensor,
    q_positions: torch.Tensor,
    k_segments: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): (bs, ⌈q_len/block⌉, ⌈kv_len/block⌉) bool tiles of the document rule
    (module docstring) for queries with ids and positions q_* (bs, q_len) int64 and keys k_*
    (bs, kv_len) int64."""
    qs_lo, qs_hi = _block_ranges(q_segments, block)
    qp_lo, qp_hi = _block_ranges(q_positions, block)
    ks_lo, ks_hi = _block_ranges(k_segments, block)
    kp_lo, kp_hi = _block_ranges(k_positions, block)
    qs_lo, qs_hi, qp_lo, qp_hi = (t[:, :, None] for t in (qs_lo, qs_hi, qp_lo, qp_hi))
    ks_lo, ks_hi, kp_lo, kp_hi = (t[:, None, :] for t in (ks_lo, ks_hi, kp_lo, kp_hi))
    some = (qs_lo <= ks_hi) & (ks_lo <= qs_hi) & (kp_lo <= qp_hi)
    one_document = (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    full = one_document & (kp_hi <= qp_lo)
    if window is not None:
        some &= qp_lo - kp_hi < window
        full &= qp_hi - kp_lo < window
    return some & ~full, full


def document_mask_mod(
    q_segments: torch.Tensor,
    q_positions: torch.Tensor,
    k_segments: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
) -> Callable:
    """The element-wise rule (module docstring) as a FlexAttention `mask_mod(b, h, q, kv)`."""

    def mask_mod(b, h, q, kv):
        allowed = (q_segments[b, q] == k_segments[b, kv]) & (
            k_positions[b, kv] <= q_positions[b, q]
        )
        if window is not None:
            allowed = allowed & (q_positions[b, q] - k_positions[b, kv] < window)
        return allowed

    return mask_mod


def band_mask_mod(q_len: int, kv_len: int, window: int | None) -> Callable:
    """Causal (and, with `window`, banded) attention of the last `q_len` of `kv_len` positions,
    as a FlexAttention `mask_mod(b, h, q, kv)`."""
    offset = kv_len - q_len

    def mask_mod(b, h, q, kv):
        allowed = kv <= q + offset
        if window is not None:
            allowed = allowed & (q + offset - kv < window)
        return allowed

    return mask_mod


def _blocks(partial: torch.Tensor, full: torch.Tensor, mask_mod: Callable, q_len: int,
            kv_len: int, block: int) -> BlockMask:  # fmt: skip
    count, indices = _indices(partial)
    full_count, full_indices = _indices(full)
    return BlockMask.from_kv_blocks(
        count, indices, full_count, full_indices, BLOCK_SIZE=block, mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )  # fmt: skip


def document_block_mask(
    q_segments: torch.Tensor,
    q_positions: torch.Tensor,
    k_segments: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None = None,
    block: int = BLOCK,
) -> BlockMask:
    """The `BlockMask` of the document rule for queries q_* (bs, q_len) and keys k_* (bs,
    kv_len), int64 ids and positions on one device; for (bs, any heads, q_len, kv_len)."""
    partial, full = tile_classes(q_segments, q_positions, k_segments, k_positions, window, block)
    mask_mod = document_mask_mod(q_segments, q_positions, k_segments, k_positions, window)
    return _blocks(partial, full, mask_mod, q_segments.shape[1], k_segments.shape[1], block)


def band_block_mask(
    q_len: int,
    kv_len: int,
    window: int | None,
    device: torch.device,
    block: int = BLOCK,
) -> BlockMask:
    """The `BlockMask` of causal (banded, with `window`) attention of the last `q_len` of
    `kv_len` positions; batch and heads broadcast."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[None]
    k_pos = torch.arange(kv_len, device=device)[None]
    partial, full = tile_classes(
        torch.zeros_like(q_pos), q_pos, torch.zeros_like(k_pos), k_pos, window, block
    )
    return _blocks(partial, full, band_mask_mod(q_len, kv_len, window), q_len, kv_len, block)


def computed_fraction(mask: BlockMask) -> float:
    """The share of the (q_len × kv_len) plane's tiles the kernel computes (full and partial),
    averaged over the batch: 1.0 for no mask, (n + 1) / 2n causal, about 2W / S for a window of
    W tokens at sequence S (Beltagy et al. 2020, "Longformer", §3.1)."""
    nq, nk = mask.kv_indices.shape[-2:]
    computed = mask.kv_num_blocks.sum()
    if mask.full_kv_num_blocks is not None:
        computed = computed + mask.full_kv_num_blocks.sum()
    return float(computed) / (mask.kv_num_blocks.shape[0] * mask.kv_num_blocks.shape[1] * nq * nk)


def band_fraction(q_len: int, kv_len: int, window: int | None, block: int = BLOCK) -> float:
    """`computed_fraction` of `band_block_mask(q_len, kv_len, window)`, from the shapes alone
    (no tensor: the ledger prices fake tensors, whose values it cannot read). A document mask
    computes at most this many tiles (its tiles are a subset of the band's)."""
    offset = kv_len - q_len
    nq, nk = -(-q_len // block), -(-kv_len // block)
    computed = 0
    for i in range(nq):
        last_q = min((i + 1) * block, q_len) - 1 + offset  # the block's last query position
        first_q = i * block + offset
        hi = min(last_q // block, nk - 1)  # keys up to the last query's position
        lo = 0 if window is None else max(0, (first_q - window + 1) // block)
        computed += max(0, hi - lo + 1)
    return computed / (nq * nk)


def kind_of(window: int | None) -> str:
    """The layer kind a mask serves, as the run summary names it: "full" or "window W"."""
    return "full" if window is None else f"window {window}"


class TileCounter:
    """The tiles FlexAttention computed, by layer kind, over the masks a run built: the run
    summary's block sparsity. Counts stay on the device (adding one costs no host sync);
    `fractions` reads them once. Masks of fake tensors (the ledger, the memory estimator) are
    not counted."""

    def __init__(self) -> None:
        self.computed: dict[str, torch.Tensor] = {}
        self.total: dict[str, int] = {}

    def add(self, kind: str, mask: BlockMask) -> None:
        """Count `mask`'s computed tiles (full and partial) under `kind` (`kind_of`)."""
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(mask.kv_num_blocks):
            return
        computed = mask.kv_num_blocks.sum(dtype=torch.int64)
        if mask.full_kv_num_blocks is not None:
            computed = computed + mask.full_kv_num_blocks.sum(dtype=torch.int64)
        bs, heads, nq = mask.kv_num_blocks.shape
        before = self.computed.get(kind)
        self.computed[kind] = computed if before is None else before + computed
        self.total[kind] = self.total.get(kind, 0) + bs * heads * nq * mask.kv_indices.shape[-1]

    def fractions(self) -> dict[str, float]:
        """{kind: share of its tiles computed} (one host sync per kind)."""
        return {k: float(self.computed[k]) / self.total[k] for k in sorted(self.total)}


TILES = TileCounter()
"""The process's counter: the Decoder's masks (`document_mask.attention_masks`) and context
parallel's (`titanlab.distributed.context_parallel.documents`) are added as they are built."""
