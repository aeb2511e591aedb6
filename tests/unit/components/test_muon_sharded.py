"""Owner-balanced Newton–Schulz on DTensor shards (titanlab.components.muon_sharded): on 4 gloo
ranks, every placement the layouts produce (FSDP × TP's strided shards, 2-D TP's two shard
dimensions, HSDP's replicas, expert stacks) orthogonalizes as the whole matrix does, the
all-to-all bytes are the closed form, and the owners split the FLOPs evenly."""

from __future__ import annotations

import json
import os
import sys

import torch

from titanlab.components.muon import orthogonalize_all, orthogonalized
from titanlab.components.muon_sharded import buckets, comm_bytes, ns_flops, owners
from titanlab.distributed.init import destroy_distributed

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))
from gloo_group import init_gloo, spawn

# (global shape, placements on a (2, 2) mesh named ("a", "b")); uneven sizes on purpose
CASES = [
    ((12, 10), ("Shard(0)", "Shard(0)")),  # FSDP 2 over dp, nothing on b
    ((12, 10), ("Shard(0)", "Shard(1)")),  # FSDP × TP rowwise
    ((12, 10), ("_StridedShard(0, 2)", "Shard(0)")),  # FSDP × TP colwise (strided)
    ((9, 7), ("Replicate()", "Shard(0)")),  # HSDP: replicas on a
    ((4, 6, 5), ("Shard(0)", "Shard(1)")),  # expert stack: EP on a, FSDP on b
    ((4, 6, 5), ("Shard(0)", "Replicate()")),  # experts whole on each rank: no exchange
    ((13, 3), ("Shard(1)", "Shard(0)")),  # more ranks than rows of a piece: empty shards
]


def _placement(text: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if text.startswith("_StridedShard"):
        dim, split = (int(x) for x in text[14:-1].split(","))
        return _StridedShard(dim, split_factor=split)
    return Replicate() if text == "Replicate()" else Shard(int(text[6:-1]))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        from titanlab.distributed.comm_counter import CommCounter

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        torch.manual_seed(0)  # the same whole tensors on every rank
        wholes = [torch.randn(shape) for shape, _ in CASES]
        updates = [
            distribute_tensor(w, mesh, [_placement(p) for p in pls], src_data_rank=None)
            for w, (_, pls) in zip(wholes, CASES, strict=True)
        ]
        bks, _ = buckets(updates, 5)
        want_bytes = sum(comm_bytes(b, 4) for b in bks)
        with CommCounter() as counter:
            got, flops, _ = orthogonalize_all(updates, 5, torch.float32)
        errors = [
            (g.full_tensor() - orthogonalized(w, 5, torch.float32)).abs().max().item()
            for g, w in zip(got, wholes, strict=True)
        ]
        worst = max(errors)
        sent = counter.summary().get("all_to_all", {}).get("bytes", 0)
        result = {
            "errors": errors,
            "worst": worst,
            "sent": sent,
            "want": want_bytes,
            "flops": flops,
        }
        # An equal mesh that is another object on rank 0 only (a process's history can make
        # one, as a warm test worker's did): every rank must still form the same buckets, or
        # the all-to-alls mismatch (they did when buckets were keyed by the mesh object).
        import copy

        from torch.distributed.tensor import DTensor

        twin = copy.copy(mesh)  # equal, the same process groups, another object
        mixed = [
            DTensor.from_local(u.to_local(), twin, u.placements, shape=u.shape, stride=u.stride())
            if rank == 0 and i % 2 else u
            for i, u in enumerate(updates)
        ]  # fmt: skip
        result["buckets"] = len(buckets(mixed, 5)[0])
        again, _, _ = orthogonalize_all(mixed, 5, torch.float32)
        result["mixed_worst"] = max(
            (a.full_tensor() - g.full_tensor()).abs().max().item()
            for a, g in zip(again, got, strict=True)
        )
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_every_placement_orthogonalizes_as_the_whole_matrix(tmp_path):
    spawn(_worker, (4, str(tmp_path / "init"), str(tmp_path)), 4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["worst"] <= 1e-6, r
        assert r["sent"] == r["want"] > 0, r
        assert r["buckets"] == results[0]["buckets"] and r["mixed_worst"] == 0.0, r
    # Each piece is orthogonalized once per class: the FLOPs over the 4 ranks are those of the
    # whole matrices, counted once per replica (HSDP) and once per expert group.
    whole = sum(ns_flops(shape, 5) for shape, _ in CASES)
    replicated = ns_flops((9, 7), 5) + ns_flops((4, 6, 5), 5)  # HSDP's and the EP-only stack
    assert sum(r["flops"] for r in results) == whole + replicated


def test_owners_balance_the_debug_models_matrices():
    """LPT over the debug model's Muon matrices: the busiest rank within 1.2× the mean."""
    from titanlab.models.llama3.args import TransformerModelArgs
    from titanlab.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(TransformerModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048))
    costs = [ns_flops(tuple(p.shape), 5) for n, p in model.named_parameters()
             if n.startswith("layers.") and p.ndim == 2]  # fmt: skip
    for n in (2, 4, 8):
        load = [0] * n
        for cost, owner in zip(costs, owners(costs, n), strict=True):
            load[owner] += cost
        assert max(load) <= 1.2 * sum(load) / n, (n, load)


def test_ns_flops_closed_form():
    # 5 iterations of 4·m²·k + 2·m³ with m = 3 ≤ k = 8, per matrix of a stack of 2
    assert ns_flops((8, 3), 5) == ns_flops((3, 8), 5) == 5 * (4 * 9 * 8 + 2 * 27)
    assert ns_flops((2, 3, 8), 5) == 2 * ns_flops((3, 8), 5)
