"""Expert parallel's capacity-bounded exchange (titanlab/distributed/expert_capacity.py): with a
capacity no expert can exceed, an MoE layer split over 2 and 4 gloo ranks gives every token the
output, and every weight the gradient, of the unsplit layer, and drops nothing; with a small
capacity it drops exactly the slots past each expert's first C of a rank (counted), and every
token gets what the unsplit layer gives it from the slots kept (a reference written here, slot
by slot). Overlapped in 2 chunks (`parallelism.expert_dispatch_chunks`), the same, with the
capacity rounded up to a multiple of the chunks. The exchange's shapes depend on the slot
count only, not on the routing."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gloo_group import init_gloo, spawn
from titanlab.distributed.expert_capacity import (
    chunk_major,
    chunked_capacity,
    expert_capacity,
    place_slots,
)
from titanlab.distributed.init import destroy_distributed
from titanlab.models.common.moe import MoE, MoEArgs

DIM, EXPERTS, TOP_K = 16, 8, 2
TOKENS = 7  # per rank: every rank of a training step holds as many (batch × seq_len)
NEVER_DROPS = EXPERTS / TOP_K  # one expert takes each token at most once
SMALL = 0.5


def _layer() -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=TOP_K, hidden_dim=12, num_shared_experts=1))
    moe.init_weights(0.05)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
        moe.expert_bias[0] = 5.0  # expert 0 is every token's first choice: over capacity
    moe.args.route_bias = True
    return moe


def _kept_reference(moe: MoE, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """The unsplit layer's output for x (1, T, dim) from the kept slots only: of each expert's
    slots, in token order, the first `capacity`."""
    xt = x.reshape(-1, DIM)
    weights, experts, _ = moe.router(xt, moe.expert_bias)
    out = torch.zeros_like(xt)
    taken = [0] * EXPERTS
    for e in range(EXPERTS):
        for t in range(xt.shape[0]):
            for j in range(TOP_K):
                if experts[t, j].item() != e:
                    continue
                taken[e] += 1
                if taken[e] > capacity:
                    continue
                w = moe.experts
                h = F.silu(xt[t] @ w.w1[e].t()) * (xt[t] @ w.w3[e].t())
                out[t] += weights[t, j] * (h @ w.w2[e].t())
    return (out + moe.shared_experts(xt)).view_as(x)


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, factor: float, chunks: int
) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from titanlab.distributed.expert_parallel import apply_ep

        reference, sharded = _layer(), _layer()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        apply_ep(sharded, mesh, factor, dispatch_chunks=chunks)
        torch.manual_seed(100 + rank)  # each rank its own tokens, as many as the others
        x = torch.randn(1, TOKENS, DIM)
        grad = torch.randn_like(x)
        xi = x.clone().requires_grad_()
        out = sharded(xi)
        out.backward(grad)
        results = {"out": out.detach(), "dropped": sharded.tokens_dropped.clone()}
        grads = {n: p.grad for n, p in sharded.named_parameters()}
        results["grads"] = {n: g.full_tensor() if hasattr(g, "full_tensor") else g
                            for n, g in grads.items()}  # fmt: skip
        for n, g in results["grads"].items():
            if not n.startswith("experts."):  # dense weights are replicated: summed as usual
                dist.all_reduce(g)
        xr = x.clone().requires_grad_()
        ref_out = reference(xr)
        ref_out.backward(grad)
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        for g in ref_grads.values():  # the unsplit layer's gradient of all ranks' tokens
            dist.all_reduce(g)
        results["reference"] = {"out": ref_out.detach(), "grads": ref_grads}
        results["x"] = x
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("world, chunks", [(2, 1), (4, 1), (2, 2), (4, 3)])
def test_a_capacity_no_expert_exceeds_equals_the_unsplit_layer(world, chunks, tmp_path):
    spawn(_worker, (world, str(tmp_path / "init"), str(tmp_path), NEVER_DROPS, chunks), world)
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["dropped"].item() == 0
        torch.testing.assert_close(r["out"], r["reference"]["out"], atol=1e-6, rtol=1e-5)
        assert r["grads"].keys() == r["reference"]["grads"].keys()
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, r["reference"]["grads"][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_small_capacity_drops_exactly_the_slots_past_it_and_counts_them(chunks, tmp_path):
    world = 2
    spawn(_worker, (world, str(tmp_path / "init"), str(tmp_path), SMALL, chunks), world)
    reference = _layer()
    total = 0
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        slots = r["x"].shape[1] * TOP_K
        capacity = -(-math.ceil(SMALL * slots / EXPERTS) // chunks) * chunks
        with torch.no_grad():
            want = _kept_reference(reference, r["x"], capacity)
            _, experts, _ = reference.router(r["x"].reshape(-1, DIM), reference.expert_bias)
        counts = torch.bincount(experts.flatten(), minlength=EXPERTS)
        dropped = (counts - capacity).clamp(min=0).sum().item()
        assert dropped > 0  # expert 0 takes every token: more than its capacity
        assert r["dropped"].item() == dropped
        torch.testing.assert_close(r["out"], want, atol=1e-6, rtol=1e-5)
        total += dropped
    print(f"capacity factor {SMALL}: {total} slots dropped over {world} ranks, as counted")


def test_place_slots_keeps_each_experts_first_c_slots_in_order():
    counts = torch.tensor([3, 0, 1, 2])  # slots sorted by expert: 0 0 0 2 3 3
    dest, dropped = place_slots(counts, 6, capacity=2)
    assert dest.tolist() == [0, 1, 8, 4, 6, 7]  # row e·C + i; the third slot of 0 to row E·C
    assert dropped.item() == 1


def test_capacity_is_the_ceiling_of_factor_times_slots_per_expert():
    assert expert_capacity(10, 8, 1.0) == 2
    assert expert_capacity(16, 8, 1.25) == 3
    assert expert_capacity(1, 8, 0.1) == 1  # at least one slot
    with pytest.raises(ValueError, match="capacity_factor=0"):
        expert_capacity(16, 8, 0)


def test_chunked_capacity_rounds_up_to_a_multiple_of_the_chunks():
    assert chunked_capacity(16, 8, 1.25, 1) == 3
    assert chunked_capacity(16, 8, 1.25, 2) == 4
    assert chunked_capacity(32768, 128, 1.25, 2) == 320  # Qwen3-30B-A3B, seq 4096, top-8


def test_chunk_major_puts_each_chunk_of_every_expert_in_one_block():
    # E = 2 experts, C = 4 slots each, 2 chunks of 2: rows e·C + i -> j·E·2 + e·2 + i % 2
    dest = torch.tensor([0, 1, 2, 3, 4, 6, 8])  # expert 0's four slots, expert 1's 0 and 2
    assert chunk_major(dest, 2, 4, 2).tolist() == [0, 1, 4, 5, 2, 6, 8]  # 8 = E·C: dropped
