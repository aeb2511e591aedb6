"""Adapter dropout keyed by position: about p of the elements dropped, kept ones scaled by
1/(1-p), a block of the tensor gets the block of the whole tensor's mask, and two tensor-parallel
ranks holding column shards or replicas of an input drop exactly what one process drops."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "distributed"))
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed
from titanlab.peft.dropout import PositionDropout, keep_mask


def test_the_rate_and_the_scale_are_those_of_nn_dropout():
    torch.manual_seed(0)
    drop = PositionDropout(0.3).train()
    out = drop(torch.ones(8, 64, 96))
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.7) < 0.01  # 49,152 elements: 4.6 sigma is 0.01
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7))
    assert torch.equal(drop.eval()(out), out)


def test_a_block_gets_its_part_of_the_whole_mask_and_seeds_differ():
    seed = torch.tensor(1234)
    whole = keep_mask((4, 6, 10), (4, 6, 10), (0, 0, 0), seed, 0.5)
    assert torch.equal(keep_mask((4, 6, 4), (4, 6, 10), (0, 0, 6), seed, 0.5), whole[..., 6:])
    assert torch.equal(keep_mask((2, 6, 10), (4, 6, 10), (2, 0, 0), seed, 0.5), whole[2:])
    other = keep_mask((4, 6, 10), (4, 6, 10), (0, 0, 0), torch.tensor(1235), 0.5)
    assert not torch.equal(whole, other)


def test_the_global_generator_decides_the_mask():
    """The seed comes from torch's global generator: the same state gives the same mask (what
    activation checkpointing's recompute relies on)."""
    drop = PositionDropout(0.2).train()
    x = torch.randn(3, 5, 16)
    torch.manual_seed(7)
    a = drop(x)
    torch.manual_seed(7)
    assert torch.equal(a, drop(x))
    assert not torch.equal(a, drop(x))


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        x = torch.arange(2 * 8 * 12, dtype=torch.float32).view(2, 8, 12) + 1
        drop = PositionDropout(0.4).train()
        for name, placement in (("cols", Shard(-1)), ("rows", Shard(1)), ("rep", Replicate())):
            torch.manual_seed(3)
            shared = distribute_tensor(x, mesh, [placement])
            out = drop(shared)
            assert out.placements == shared.placements
            torch.save(out.full_tensor(), os.path.join(out_dir, f"{name}-{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_tensor_parallel_ranks_drop_what_one_process_drops(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    x = torch.arange(2 * 8 * 12, dtype=torch.float32).view(2, 8, 12) + 1
    torch.manual_seed(3)
    want = PositionDropout(0.4).train()(x)
    for name in ("cols", "rows", "rep"):
        for rank in (0, 1):
            assert torch.equal(torch.load(tmp_path / f"{name}-{rank}.pt"), want), (name, rank)
    assert not dist.is_initialized()
