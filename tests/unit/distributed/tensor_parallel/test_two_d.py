"""2D tensor parallel on a 2 × 2 grid of 4 spawned gloo ranks: the loss and every gradient equal
one process's, each weight holds 1/q² of the Linear on each rank, gradients keep their
parameters' placements; and the grid side of a tp degree."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn
from titanlab.distributed.tensor_parallel.two_d import block_comm_bytes, grid_side


def test_grid_side_is_the_square_root_of_a_square_degree():
    assert [grid_side(n) for n in (4, 9, 16)] == [2, 3, 4]
    assert [grid_side(n) for n in (1, 2, 3, 8, 12)] == [None] * 5
    assert grid_side(8, depth=2) == 2 and grid_side(18, depth=2) == 3 and grid_side(8, 3) is None


def _worker(rank: int, init_file: str, out: str, depth: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlab.distributed.init import destroy_distributed
    from titanlab.distributed.tensor_parallel.two_d import GRID, apply_tp_2d, summa_loss
    from tp_grid_case import against_one_process

    init_gloo(rank, 4 * depth, init_file)
    ok = False
    try:
        mesh = init_device_mesh("cpu", (depth, 2, 2), mesh_dim_names=GRID)  # 2D: depth 1
        model, args, result = against_one_process(
            lambda m: apply_tp_2d(m, mesh), lambda fn: summa_loss(fn, mesh), batch=4 * depth
        )
        # One block's forward and backward, counted.
        from titanlab.distributed.comm_counter import CommCounter

        block = model.layers["0"]
        x = torch.randn(2, 32, args.dim // 2, requires_grad=True)  # (b/(q·d), s, d/q)
        with CommCounter() as counter:
            block(x, model.rope_cos, model.rope_sin).sum().backward()
        counted = {k: v["bytes"] for k, v in counter.summary().items()}
        if rank == 0:
            with open(out, "w") as f:
                dims = [args.dim, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim()]
                json.dump({**result, "block": counted, "args": dims}, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


FULL_ONLY = pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)


@pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")
# 2D; 2.5D on 8 ranks. CI meets 2D's loss, gradients and per-block bytes in
# tests/unit/tooling/test_tp_mode_bench.py and 2D × FSDP in test_grid_dp.py.
@pytest.mark.parametrize("depth", [pytest.param(d, marks=FULL_ONLY) for d in (1, 2)])
def test_a_2x2_grid_trains_like_one_process(tmp_path, depth):
    out = str(tmp_path / "result.json")
    spawn(_worker, (str(tmp_path / "init"), out, depth), nprocs=4 * depth)
    with open(out) as f:
        r = json.load(f)
    want, got = r["loss"]
    assert abs(got - want) / r["tokens"] < 1e-6  # the mean token loss
    assert r["worst"] < 1e-5 and r["moved"] == []
    full, local = r["shapes"]["layers.0.attention.wq.weight"]
    assert local == [full[0] // 2, full[1] // 2]  # 1/q² of the weight: out and in split
    full, local = r["shapes"]["tok_embeddings.weight"]
    assert local == [full[0], full[1] // 2]  # the features split over the grid columns
    dim, heads, kv, head_dim, hidden = r["args"]
    tokens = 2 * 32 * 2 * depth  # each rank's 2 rows × q × depth
    predicted = block_comm_bytes(dim, heads, kv, head_dim, hidden, tokens, q=2, depth=depth)
    assert r["block"] == predicted
