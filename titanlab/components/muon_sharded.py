"""Muon's Newton–Schulz on sharded updates: each whole matrix assembled on one owner rank,
orthogonalized there, and its shards returned (`orthogonalize_sharded`).

Under FSDP2 / HSDP / ZeRO 1–2, tensor parallel, expert parallel and pipeline parallel a Muon
parameter's update is a DTensor. Its mesh dimensions are of two kinds:
- **gather dimensions** shard one of the matrix dimensions (the last two): the ranks along them
  hold pieces of the same matrices, which must be assembled;
- **independent dimensions** replicate the update (HSDP's dp_replicate) or split an expert
  stack by expert (EP's Shard(0)): the ranks along them hold other, or the same, whole
  matrices, and never exchange anything. Each slice of them (a "class") orthogonalizes its own
  piece (its experts; for HSDP every replica computes the same thing, which keeps all traffic
  inside the shard group).

Within one gather group of n ranks, parameters are assigned to owners by cost, largest first to
the least-loaded rank (LPT, Graham 1969), so that every rank does about 1/n of the
Newton–Schulz FLOPs. One `all_to_all_single` brings each owner its matrices' pieces, a second
returns the orthogonalized shards: per step and rank the bytes sent are

    Σ_{i not owned} s_i  +  Σ_{i owned} (P_i − s_i)        (elements × element size)

with s_i this rank's shard of parameter i and P_i the piece its class holds; evenly sharded,
a total of 2·Σ P_i·(n−1)/n over the group, where gathering every matrix on every rank
(`DTensor.full_tensor`) moves Σ P_i·(n−1) (`comm_bytes`, checked by the communication
counter in tests/unit/components/test_muon_sharded.py).

Which elements a rank holds comes from torch's own placements (`Placement._split_tensor`, the
function `distribute_tensor` shards with), applied to an index tensor in mesh order, so
uneven, strided (FSDP × TP's `_StridedShard`) and multi-dimensional shardings are all covered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Shard, _StridedShard


def ns_flops(shape: tuple[int, ...], ns_steps: int) -> int:
    """FLOPs of the quintic Newton–Schulz iteration on a matrix (rows, cols), or on each matrix
    of a stack (E, rows, cols): per iteration, with m ≤ k the short and long sides,
    A = XXᵀ (2m²k), A·A (2m³) and (bA + cA²)·X (2m²k)."""
    *stack, rows, cols = shape
    m, k = min(rows, cols), max(rows, cols)
    return math.prod(stack) * ns_steps * (4 * m * m * k + 2 * m**3)


def gather_dims(update: DTensor) -> tuple[int, ...]:
    """Mesh dimensions whose placement shards one of the update's matrix dimensions (the last
    two); Shard(0) of a 3-D expert stack splits by expert, so it is not one."""
    ndim = update.ndim
    out = []
    for i, p in enumerate(update.placements):
        if isinstance(p, Shard | _StridedShard):  # a _StridedShard is not is_shard()
            d = p.dim % ndim
            if d >= ndim - 2:
                out.append(i)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Where the pieces of one parameter's update lie within its gather group: the class's
    piece shape and, per group rank (row-major over the gather dimensions), the flat indices
    of the piece that rank holds."""

    piece_shape: tuple[int, ...]
    indices: tuple[Tensor, ...]
    spans: tuple[slice | None, ...] = ()
    """Per group rank, the same elements as a slice where they are one contiguous run (Shard(0)
    of a matrix: FSDP's and colwise TP's pieces), so they are copied without an index."""

    def piece_numel(self) -> int:
        return math.prod(self.piece_shape)

    def where(self, rank: int) -> Tensor | slice:
        """Rank `rank`'s elements of the flattened piece: a slice, else the index tensor."""
        span = self.spans[rank] if self.spans else None
        return span if span is not None else self.indices[rank]


def _layout_of(update: DTensor, dims: tuple[int, ...]) -> Layout:
    mesh, placements = update.device_mesh, update.placements
    outside = [Replicate() if i in dims else p for i, p in enumerate(placements)]
    piece_shape, _ = compute_local_shape_and_global_offset(update.shape, mesh, outside)
    return _split_indices(tuple(piece_shape), tuple(placements[i] for i in dims),
                          tuple(mesh.size(i) for i in dims))  # fmt: skip


@lru_cache(maxsize=4096)
def _split_indices(
    piece_shape: tuple[int, ...], placements: tuple[Placement, ...], sizes: tuple[int, ...]
) -> Layout:
    pieces = [torch.arange(math.prod(piece_shape)).view(piece_shape)]
    for placement, n in zip(placements, sizes, strict=True):
        pieces = [
            c
            for piece in pieces
            for c in placement._split_tensor(piece, n, with_padding=False)[0]  # type: ignore[attr-defined]
        ]
    flat = tuple(p.reshape(-1) for p in pieces)
    return Layout(piece_shape, flat, tuple(_as_span(i) for i in flat))


def _as_span(indices: Tensor) -> slice | None:
    n = indices.numel()
    if n == 0:
        return slice(0, 0)
    first = int(indices[0])
    if int(indices[-1]) - first + 1 == n and bool((indices.diff() == 1).all()):
        return slice(first, first + n)
    return None


def owners(costs: list[int], n: int) -> list[int]:
    """Owner (group rank) of each item: largest cost first, to the least-loaded rank (ties: the
    lower rank), the same on every rank."""
    load = [0] * n
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += costs[i]
    return out


def _group(mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("a DTensor sharded over several unnamed mesh dimensions")
    return mesh[tuple(names[d] for d in dims)]._flatten().get_group()


@dataclass
class Bucket:
    """The updates of one gather group (same mesh, gather dimensions and dtype)."""

    mesh: DeviceMesh
    dims: tuple[int, ...]
    items: list[int]  # positions in the caller's list
    layouts: list[Layout]
    owner: list[int]

    def group_size(self) -> int:
        return math.prod(self.mesh.size(d) for d in self.dims)

    def my_rank(self) -> int:
        coord = self.mesh.get_coordinate()
        assert coord is not None
        r = 0
        for d in self.dims:
            r = r * self.mesh.size(d) + coord[d]
        return r


def buckets(updates: list[Tensor], ns_steps: int) -> tuple[list[Bucket], list[int]]:
    """The DTensor updates that need assembling, bucketed by gather group with owners
    assigned; and the positions of the rest (plain tensors, or DTensors whose every matrix is
    whole on this rank), which are orthogonalized where they are."""
    by_key: dict[tuple, Bucket] = {}
    local: list[int] = []
    for pos, u in enumerate(updates):
        dims = gather_dims(u) if isinstance(u, DTensor) else ()
        if not dims:
            local.append(pos)
            continue
        assert isinstance(u, DTensor)
        if any(isinstance(p, Partial) for p in u.placements):
            raise ValueError(f"Muon update with a Partial placement: {u.placements}")
        # The mesh by value (its ranks, shape and names), not by object: two equal meshes
        # can be one object on one rank and two on another (a process's earlier slicing),
        # and every rank must form the same buckets, in the same order, for the all-to-alls.
        key = (u.device_mesh, dims, u.dtype)
        b = by_key.setdefault(key, Bucket(u.device_mesh, dims, [], [], []))
        b.items.append(pos)
        b.layouts.append(_layout_of(u, dims))
    for b in by_key.values():
        costs = [ns_flops(lay.piece_shape, ns_steps) for lay in b.layouts]
        b.owner = owners(costs, b.group_size())
    return list(by_key.values()), local


def comm_bytes(bucket: Bucket, element_size: int) -> int:
    """Bytes this rank sends for `bucket` (the two all-to-alls' inputs), as the module
    docstring gives them."""
    me = bucket.my_rank()
    total = 0
    for lay, owner in zip(bucket.layouts, bucket.owner, strict=True):
        mine = lay.indices[me].numel()
        total += lay.piece_numel() - mine if owner == me else mine
    return total * element_size


def _exchange(send: list[list[Tensor]], recv_numels: list[int], like: Tensor, group) -> Tensor:
    """One all_to_all_single: `send[d]` (flat tensors, in order) to group rank d; returns what
    arrived, ordered by source rank."""
    inp = torch.cat([t for ts in send for t in ts]) if any(send) else like.new_empty(0)
    out = like.new_empty(sum(recv_numels))
    dist.all_to_all_single(
        out,
        inp.contiguous(),
        output_split_sizes=recv_numels,
        input_split_sizes=[sum(t.numel() for t in ts) for ts in send],
        group=group,
    )
    return out


def orthogonalize_bucket(
    bucket: Bucket, updates: list[Tensor], fn: Callable[[Tensor], Tensor]
) -> dict[int, Tensor]:
    """Assemble each update of `bucket` on its owner, apply `fn` (the Newton–Schulz of a piece:
    a matrix or an expert stack), and return each rank's shard, as DTensors like the inputs,
    by position."""
    n, me = bucket.group_size(), bucket.my_rank()
    group = _group(bucket.mesh, bucket.dims)
    mine = [cast(DTensor, updates[pos]).to_local().reshape(-1) for pos in bucket.items]
    like = mine[0]
    idx = range(len(bucket.items))

    # 1. Pieces to their owners.
    send: list[list[Tensor]] = [[] for _ in range(n)]
    for i in idx:
        if bucket.owner[i] != me:
            send[bucket.owner[i]].append(mine[i])
    owned = [i for i in idx if bucket.owner[i] == me]
    recv = [
        0 if s == me else sum(bucket.layouts[i].indices[s].numel() for i in owned) for s in range(n)
    ]
    arrived = _exchange(send, recv, like, group)
    results: dict[int, Tensor] = {}
    offset = 0
    pieces: dict[int, Tensor] = {i: like.new_empty(bucket.layouts[i].piece_numel()) for i in owned}
    for s in range(n):
        for i in owned:
            where = bucket.layouts[i].where(s)
            if s == me:
                pieces[i][where] = mine[i]
            else:
                n_s = bucket.layouts[i].indices[s].numel()
                pieces[i][where] = arrived[offset : offset + n_s]
                offset += n_s
    for i in owned:
        pieces[i] = fn(pieces[i].view(bucket.layouts[i].piece_shape)).reshape(-1).to(like.dtype)

    # 2. Shards back.
    send = [[] for _ in range(n)]
    for d in range(n):
        if d != me:
            send[d] = [pieces[i][bucket.layouts[i].where(d)] for i in owned]
    recv = [
        0 if s == me else sum(mine[i].numel() for i in idx if bucket.owner[i] == s)
        for s in range(n)
    ]
    arrived = _exchange(send, recv, like, group)
    starts = [sum(recv[:s]) for s in range(n)]
    for i in idx:
        pos, s = bucket.items[i], bucket.owner[i]
        if s == me:
            flat = pieces[i][bucket.layouts[i].where(me)]
        else:
            flat = arrived[starts[s] : starts[s] + mine[i].numel()]
            starts[s] += mine[i].numel()
        u = updates[pos]
        assert isinstance(u, DTensor)
        results[pos] = DTensor.from_local(
            flat.view(u.to_local().shape),
            u.device_mesh,
            u.placements,
            run_check=False,
            shape=u.shape,
            stride=u.stride(),
        )
    return results
