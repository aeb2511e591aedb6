"""Context parallel for the gated delta rule (`titanlab.distributed.context_parallel.linear`):
on 2 and 4 gloo ranks, each holding a contiguous piece of the sequence and starting from the
state the earlier ranks' transitions compose, the outputs and the gradients of q, k, v, g and β
equal one process's chunked rule over the whole sequence within 1e-5 (fp64 inputs)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed

SEQ = 96


def _inputs():
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.nn.functional.normalize(torch.randn(2, SEQ, 2, 8, generator=gen,
            dtype=torch.float64), dim=-1) for _ in range(2))  # fmt: skip
    v = torch.randn(2, SEQ, 4, 6, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, SEQ, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, SEQ, 4, generator=gen, dtype=torch.float64)
    grad = torch.randn(2, SEQ, 4, 6, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, grad


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        import torch.distributed as dist

        from titanlab.distributed.context_parallel.linear import starting_state
        from titanlab.models.common.delta_rule import chunked

        *tensors, grad = _inputs()
        piece = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
        mine = [t[:, piece].clone().requires_grad_() for t in tensors]
        state = starting_state(*mine[1:], dist.group.WORLD)
        out, _ = chunked(*mine, state=state, chunk=16)
        out.backward(grad[:, piece].to(out.dtype))
        result = {"out": out.detach(), "grads": [t.grad for t in mine]}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.parametrize("world", [2, 4])
def test_pieces_from_composed_states_equal_the_whole_sequence(world, tmp_path):
    from titanlab.models.common.delta_rule import chunked

    spawn(_worker, (world, str(tmp_path / "init"), str(tmp_path)), nprocs=world)
    *tensors, grad = _inputs()
    whole = [t.clone().requires_grad_() for t in tensors]
    out, _ = chunked(*whole, chunk=16)
    out.backward(grad.to(out.dtype))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    got = torch.cat([r["out"] for r in ranks], dim=1)
    torch.testing.assert_close(got, out.detach(), atol=1e-5, rtol=1e-5)
    for i, t in enumerate(whole):
        mine = torch.cat([r["grads"][i] for r in ranks], dim=1)
        torch.testing.assert_close(mine, t.grad, atol=1e-5, rtol=1e-5, msg=f"input {i}")
