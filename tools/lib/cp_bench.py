"""Ring against Ulysses context parallel, one attention call (forward + backward) per rank on
gloo: step time, bytes (counted by `CommCounter`, against the closed forms of
`closed_form_bytes`), and the activation bytes attention saves for backward, for a window of
mixed-length documents. Used by `tools/benchmark_cp.py` and its test.

The call: q, k, v (bs, H, S/cp, d) fp32 of this rank's tokens (the `work` balancer's for ring,
contiguous for Ulysses), a document mask with restarted positions; `ContextParallelAttention`
(titanlab/distributed/context_parallel/documents.py) as the trainer runs it. cp 1 is SDPA with the
whole mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time

import torch

METHODS = ("ring-allgather", "ring-alltoall", "ulysses")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 1
    heads: int = 8
    seq: int = 1024
    head_dim: int = 64


def documents(seq: int, batch: int, seed: int = 0) -> torch.Tensor:
    """(batch, seq) ids of mixed-length documents: one of about seq/2 tokens, the rest 8 to
    seq/6, in a random order (some cross the shard boundaries)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = [seq // 2 + int(torch.randint(0, seq // 8, (1,), generator=g))]
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(8, max(9, seq // 6), (1,), generator=g)))
        order = torch.randperm(len(lengths), generator=g).tolist()
        rows.append(torch.cat([torch.full((lengths[i],), k) for k, i in enumerate(order)])[:seq])
    return torch.stack(rows)


def closed_form_bytes(method: str, shape: Shape, cp: int) -> dict[str, int]:
    """Bytes per kind (`CommCounter`'s definition) of one forward + backward on one rank.

    B = bs·H·(S/cp)·d·4 (one fp32 shard of q, k, v or the output); the mask's ids and positions
    add two all-gathers of (bs, S) int64 in every method.
    - ring allgather: all_gather k and v (2·cp·B), backward all_reduce their gathered
      gradients (2·cp·B);
    - ring alltoall: cp−1 shifts of k and v forward and again backward (recomputation), and
      cp shifts of their gradients (the last one home): send and recv (4·(cp−1) + 2·cp)·B;
    - Ulysses: all_to_all of q, k, v and the output forward, of their gradients backward: 8·B.
    """
    shard = shape.batch * shape.heads * (shape.seq // cp) * shape.head_dim * 4
    ids = 2 * shape.batch * shape.seq * 8
    if method == "ring-allgather":
        return {"all_gather": 2 * cp * shard + ids, "all_reduce": 2 * cp * shard}
    if method == "ring-alltoall":
        sent = (4 * (cp - 1) + 2 * cp) * shard
        return {"all_gather": ids, "send": sent, "recv": sent}
    return {"all_gather": ids, "all_to_all": 8 * shard}


def _inputs(shape: Shape, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape.batch, shape.heads, shape.seq, shape.head_dim, generator=g)
            for _ in range(3)]  # fmt: skip
    segments = documents(shape.seq, shape.batch, seed)
    from titanlab.distributed.context_parallel.balance import index_in_document

    return full, segments, index_in_document(segments)


class _Saved:
    """Bytes of the distinct storages autograd saves for backward inside the context."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def run_rank(rank: int, cp: int, method: str, shape: Shape, repeats: int, out: str) -> None:
    """One rank of a `cp`-rank gloo group (rank 0 writes `out`): the figures of `method`."""
    import torch.distributed as dist

    from titanlab.distributed.comm_counter import CommCounter
    from titanlab.distributed.context_parallel.balance import shard_order
    from titanlab.distributed.context_parallel.documents import ContextParallelAttention, allowed

    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", rank=rank, world_size=cp)
    (q, k, v), segments, positions = _inputs(shape)
    mode, _, rotate = method.partition("-")
    if cp > 1:
        balancer = "none" if mode == "ulysses" else "work"
        order = shard_order(segments, shape.seq, shape.batch, cp, balancer)
        mine = order[:, rank * (shape.seq // cp) : (rank + 1) * (shape.seq // cp)]
        idx = mine[:, None, :, None].expand(-1, shape.heads, -1, shape.head_dim)
        q, k, v = (t.gather(2, idx) for t in (q, k, v))
        segments, positions = segments.gather(1, mine), positions.gather(1, mine)
        group = dist.group.WORLD
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))

    def call(saved: _Saved | None = None) -> None:
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
            if saved
            else contextlib.nullcontext()
        )
        with hooks:
            if cp == 1:
                mask = allowed(segments, positions, segments, positions)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                attention = ContextParallelAttention(segments, positions, group, mode, rotate)
                out = attention.attend(q, k, v)
        out.sum().backward()

    counter, saved = CommCounter(), _Saved()
    with counter if cp > 1 else contextlib.nullcontext():  # forward and backward
        call(saved)
    times = []
    for _ in range(repeats):
        if cp > 1:
            dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    result = {
        "method": method if cp > 1 else "one process",
        "cp": cp,
        "seconds": statistics.median(times),
        "saved_bytes": saved.bytes,
        "kinds": {k: v["bytes"] for k, v in counter.summary().items()},
        "closed_form": closed_form_bytes(method, shape, cp) if cp > 1 else {},
    }
    if cp > 1:
        gathered = [None] * cp
        dist.all_gather_object(gathered, result)
        result["seconds"] = max(r["seconds"] for r in gathered)  # the slowest rank
        result["saved_bytes"] = max(r["saved_bytes"] for r in gathered)
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f)


def measure(cp: int, method: str, shape: Shape, repeats: int, tmp: str) -> dict:
    """Run `method` on `cp` spawned ranks (1: one process); rank 0's figures."""
    import torch.multiprocessing as mp

    out = os.path.join(tmp, f"{method}-cp{cp}.json")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from tools.lib.fork_launch import _free_port

    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(run_rank, args=(cp, method, shape, repeats, out), nprocs=cp, join=True)
    with open(out, encoding="utf-8") as f:
        return json.load(f)
