"""A whole Gated DeltaNet layer under context parallel
(`titanlab.distributed.context_parallel.linear.SequenceCarry`): on 2 and 4 gloo ranks, each holding
the tokens a load balancer chose (head-tail or `work`: not contiguous), the layer's outputs and
every parameter's gradient (summed over the ranks) equal one process's over the whole sequence
within 1e-5 (fp64 weights, the rule in fp32; gradients relative to their largest entry), the
convolution's 4-tap halo and the prefix state included; a mutant halo (zeros instead of the previous
piece's inputs) is caught."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed

SEQ, DIM = 96, 32


def _layer():
    from titanlab.models.common.linear_attention import GatedDeltaNet

    torch.manual_seed(3)
    layer = GatedDeltaNet(DIM, 2, 4, 8, 6, 4, 1e-6).double()
    layer.init_weights(0.02)
    with torch.no_grad():  # weights large enough that every path shows in the output
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return layer


def _inputs():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, SEQ, DIM, generator=gen, dtype=torch.float64)
    return x, torch.randn(2, SEQ, DIM, generator=gen, dtype=torch.float64)


def _worker(rank: int, world: int, init_file: str, out_dir: str, balancer: str, mutant: bool):
    init_gloo(rank, world, init_file)
    ok = False
    try:
        import torch.distributed as dist

        from titanlab.distributed.context_parallel.balance import shard_order
        from titanlab.distributed.context_parallel.linear import SequenceCarry

        x, grad = _inputs()
        order = shard_order(None, SEQ, 2, world, balancer)  # (bs, S): rank r's columns
        n = SEQ // world
        mine = order[:, rank * n : (rank + 1) * n]
        carry = SequenceCarry(mine, order, dist.group.WORLD)
        if mutant:
            carry.history = lambda mixed, taps: torch.zeros_like(mixed[:, : taps - 1])
        layer = _layer()
        x_mine = x.gather(1, mine[..., None].expand(-1, -1, DIM))
        out, _ = layer.step(x_mine, carry=carry)
        out.backward(grad.gather(1, mine[..., None].expand(-1, -1, DIM)))
        grads = {k: p.grad for k, p in layer.named_parameters()}
        torch.save({"out": out.detach(), "mine": mine, "grads": grads},
                   os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def _run(world, balancer, tmp_path, mutant=False):
    spawn(_worker, (world, str(tmp_path / "init"), str(tmp_path), balancer, mutant),
          nprocs=world)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    got = torch.zeros(2, SEQ, DIM, dtype=torch.float64)
    for r in ranks:
        got.scatter_(1, r["mine"][..., None].expand(-1, -1, DIM), r["out"])
    grads = {k: sum(r["grads"][k] for r in ranks) for k in ranks[0]["grads"]}
    return got, grads


@pytest.mark.parametrize(("world", "balancer"), [(2, "head_tail"), (4, "work")])
def test_the_layer_on_balanced_shards_equals_one_process(world, balancer, tmp_path):
    x, grad = _inputs()
    layer = _layer()
    want, _ = layer.step(x)
    want.backward(grad)
    got, grads = _run(world, balancer, tmp_path)
    torch.testing.assert_close(got, want.detach(), atol=1e-10, rtol=1e-10)
    for name, p in layer.named_parameters():  # relative to the largest entry
        worst = (grads[name] - p.grad).abs().max().item()
        assert worst <= 1e-10 * p.grad.abs().max().item(), (name, worst)


def test_a_mutant_halo_is_caught(tmp_path):
    x, _ = _inputs()
    want, _ = _layer().step(x)
    got, _ = _run(2, "head_tail", tmp_path, mutant=True)
    assert (got - want.detach()).abs().max() > 1e-3
