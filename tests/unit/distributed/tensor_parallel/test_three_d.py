"""3D tensor parallel on a 2 × 2 × 2 cube of 8 spawned gloo ranks (`make test-parity-full`; CI
meets 3D through the layout matrix's ws8-tp8-3d row): the loss and every gradient equal one
process's, each weight holds 1/q³ of the Linear; and the cube side of a tp degree."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gloo_group
from gloo_group import init_gloo, spawn
from titanlab.distributed.tensor_parallel.three_d import cube_side


def test_cube_side_is_the_cube_root_of_a_cube_degree():
    assert [cube_side(n) for n in (8, 27, 64)] == [2, 3, 4]
    assert [cube_side(n) for n in (1, 4, 9, 16, 12)] == [None] * 5


def _worker(rank: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlab.distributed.init import destroy_distributed
    from titanlab.distributed.tensor_parallel.three_d import CUBE, apply_tp_3d, cube_loss
    from tp_grid_case import against_one_process

    init_gloo(rank, 8, init_file)
    ok = False
    try:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=CUBE)
        _, _, result = against_one_process(
            lambda m: apply_tp_3d(m, mesh), lambda fn: cube_loss(fn, mesh), batch=8
        )
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
        ok = True
    finally:
        destroy_distributed(barrier=ok)


@pytest.mark.skipif(
    os.environ.get("TITANLAB_PARITY_FULL") != "1", reason="make test-parity-full runs it"
)
def test_a_2x2x2_cube_trains_like_one_process(tmp_path):
    out = str(tmp_path / "result.json")
    spawn(_worker, (str(tmp_path / "init"), out), nprocs=8)
    with open(out) as f:
        r = json.load(f)
    want, got = r["loss"]
    assert abs(got - want) / r["tokens"] < 1e-6 and r["worst"] < 1e-5 and r["moved"] == []
    full, local = r["shapes"]["layers.0.attention.wq.weight"]
    assert full[0] * full[1] == 8 * local[0] * local[1]  # 1/q³ of the weight
