"""Expert parallel's dispatch/combine is exact: on 2 and 4 gloo ranks, each holding different
tokens, an MoE layer with its experts split over the ranks gives every token the output, and every
weight the gradient, of the unsplit layer (gradients summed over the ranks), with uneven loads and
an expert nobody routes to."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed
from titanlab.models.common.moe import MoE, MoEArgs

DIM, EXPERTS = 16, 8


def _layer() -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, MoEArgs(num_experts=EXPERTS, top_k=2, hidden_dim=12, bias_update_speed=0.01))
    moe.init_weights(0.05)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.5)
        moe.expert_bias[0] = 5.0  # expert 0 takes every token: uneven loads
        moe.expert_bias[EXPERTS - 1] = -5.0  # expert 7 gets none
    return moe


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from titanlab.distributed.expert_parallel import apply_ep

        reference, sharded = _layer(), _layer()
        apply_ep(sharded, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
        torch.manual_seed(100 + rank)  # each rank its own tokens, a different count per rank
        x = torch.randn(1, 5 + 3 * rank, DIM)
        grad = torch.randn_like(x)
        results = {}
        for name, moe in (("reference", reference), ("ep", sharded)):
            xi = x.clone().requires_grad_()
            out = moe(xi)
            out.backward(grad)
            grads = {n: p.grad for n, p in moe.named_parameters()}
            grads = {
                n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()
            }
            if name == "reference":  # the unsplit layer's gradient of all ranks' tokens
                for g in grads.values():
                    dist.all_reduce(g)
            else:  # dense weights are replicated: their gradients sum over the ranks as usual
                for n, g in grads.items():
                    if not n.startswith("experts."):
                        dist.all_reduce(g)
            results[name] = {"out": out.detach(), "dx": xi.grad, **grads}
        results["local_w1"] = sharded.experts.w1.to_local().detach()
        results["tokens_per_expert"] = sharded.tokens_per_expert.clone()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_equal_the_unsplit_layer(world, tmp_path):
    init = str(tmp_path / "init")
    spawn(_worker, (world, init, str(tmp_path)), world)
    reference = _layer()
    worst = 0.0
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        ref, ep = r["reference"], r["ep"]
        assert ref.keys() == ep.keys()
        for key in ref:  # output, input gradient, every weight's gradient
            assert torch.allclose(ep[key], ref[key], atol=1e-6, rtol=1e-5), (rank, key)
            worst = max(worst, (ep[key] - ref[key]).abs().max().item())
        block = EXPERTS // world  # rank r holds experts [r·E/ep, (r+1)·E/ep)
        want = reference.experts.w1[rank * block : (rank + 1) * block]
        assert torch.equal(r["local_w1"], want)
        counts = r["tokens_per_expert"]
        assert counts.sum().item() == (5 + 3 * rank) * 2  # no slot dropped
        assert counts[0].item() == 5 + 3 * rank and counts[EXPERTS - 1].item() == 0
    print(f"ep{world}: worst |Δ| of outputs and gradients against the unsplit layer {worst:.3g}")
