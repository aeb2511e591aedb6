"""titanlab's `work` balancer through PyTorch's context-parallel API: `_context_parallel_shard`
with `TitanlabLoadBalancer` gives each of 2 gloo ranks the tokens, labels and document ids
titanlab's own `shard_batch` gives it, and the restore indices undo the rearrangement."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed


def _batch():
    from tests.unit.models.common.test_flex_masks import random_documents

    gen = torch.Generator().manual_seed(4)
    segments = random_documents(gen, 2, 256)
    tokens = torch.randint(0, 1000, (2, 256), generator=gen)
    return tokens, tokens.roll(-1, 1), segments


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _context_parallel_shard,
        )

        from titanlab.distributed.context_parallel.documents import shard_batch
        from titanlab.distributed.context_parallel.torch_balancer import TitanlabLoadBalancer

        tokens, labels, segments = _batch()
        mesh = init_device_mesh("cpu", (world,))
        balancer = TitanlabLoadBalancer(segments, 256, 2, world, "work")
        theirs = _context_parallel_shard(mesh, [tokens, labels, segments], [1, 1, 1], balancer)
        inputs, targets, kwargs = shard_batch(
            tokens, labels, {"segments": segments}, world, rank, "ring", "work"
        )
        ours = [inputs, targets, kwargs["segments"]]
        torch.save({"ours": ours, "theirs": theirs}, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        destroy_distributed(barrier=ok)


def test_torchs_shard_with_the_work_balancer_equals_shard_batch(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for a, b in zip(got["ours"], got["theirs"], strict=True):
            assert torch.equal(a, b)
    from titanlab.distributed.context_parallel.torch_balancer import TitanlabLoadBalancer

    tokens, _, segments = _batch()
    balancer = TitanlabLoadBalancer(segments, 256, 2, 2)
    rearranged = tokens.gather(1, balancer._generate_indices())
    assert torch.equal(rearranged.gather(1, balancer._generate_indices(restore=True)), tokens)
    assert not torch.equal(rearranged, tokens)  # the work order is not the identity here
