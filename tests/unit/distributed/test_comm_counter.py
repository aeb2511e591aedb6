"""CommCounter counts calls and bytes of known collectives on 2 gloo processes."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist

from titanlab.distributed import comm_counter
from titanlab.distributed.comm_counter import CommCounter, count_step_comms
from gloo_group import init_gloo, spawn
from titanlab.distributed.init import destroy_distributed

F32 = 4  # bytes per float32 element


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    init_gloo(rank, world, init_file)
    ok = False
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        x = torch.ones(6)  # 24 bytes
        with CommCounter() as counter:
            dist.all_gather_into_tensor(torch.empty(12), x)  # 48 bytes gathered
            dist.reduce_scatter_tensor(torch.empty(3), x)  # 24 bytes in
            dist.all_reduce(x)  # 24
            dist.broadcast(x, src=0)  # 24
            peer = 1 - rank
            ops = [
                dist.P2POp(dist.isend, torch.ones(5), peer),  # 20 sent
                dist.P2POp(dist.irecv, torch.empty(5), peer),
            ]  # 20 received
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            # DTensor goes through the functional collectives: an all-gather of (8, 4) fp32.
            d = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
            d.full_tensor()
            # exp of a Partial sum: DTensor all-reduces (4,) fp32 inside the op's dispatch.
            d.sum(0).exp()
        counter.write_json(os.path.join(out_dir, f"rank{rank}.json"), rank=rank)
        ok = True
    finally:
        destroy_distributed(barrier=ok)  # a barrier first: no rank leaves while a peer sends


def test_counter_bytes_two_ranks(tmp_path):
    spawn(_worker, (2, str(tmp_path / "init"), str(tmp_path)), 2)
    for rank in range(2):
        kinds = json.loads((tmp_path / f"rank{rank}.json").read_text())["kinds"]
        # distribute_tensor also scatters the source (a "scatter" entry, not checked here).
        assert kinds["all_gather"]["calls"] == 2
        assert kinds["all_gather"]["bytes"] == 12 * F32 + 8 * 4 * F32
        assert kinds["all_gather"]["wire_bytes"] == (12 * F32 + 8 * 4 * F32) // 2
        assert kinds["reduce_scatter"] == {
            "calls": 1,
            "bytes": 6 * F32,
            "wire_bytes": 3 * F32,
            "sizes": {f"{6 * F32}x2": 1},
        }
        assert kinds["all_reduce"] == {
            "calls": 2,
            "bytes": 6 * F32 + 4 * F32,
            "wire_bytes": 6 * F32 + 4 * F32,
            "sizes": {f"{4 * F32}x2": 1, f"{6 * F32}x2": 1},
        }
        assert kinds["send"]["calls"] == 1 and kinds["send"]["bytes"] == 5 * F32
        assert kinds["recv"]["calls"] == 1 and kinds["recv"]["bytes"] == 5 * F32
        assert kinds["recv"]["wire_bytes"] == 0
        assert kinds["broadcast"] == {
            "calls": 1,
            "bytes": 6 * F32,
            "wire_bytes": 3 * F32,
            "sizes": {f"{6 * F32}x2": 1},
        }


def test_count_step_comms_env(tmp_path, monkeypatch):
    monkeypatch.delenv(comm_counter.ENV_VAR, raising=False)
    assert isinstance(count_step_comms(comm_counter.COUNTED_STEP), contextlib.nullcontext)
    monkeypatch.setenv(comm_counter.ENV_VAR, str(tmp_path / "c"))
    assert isinstance(count_step_comms(comm_counter.COUNTED_STEP + 1), contextlib.nullcontext)
    with count_step_comms(comm_counter.COUNTED_STEP) as counter:
        torch.ones(3) + 1  # no communication
    assert isinstance(counter, CommCounter)
    written = json.loads((tmp_path / "c.rank0.json").read_text())
    assert written["step"] == comm_counter.COUNTED_STEP and written["kinds"] == {}


if __name__ == "__main__":  # mp.spawn re-imports this module
    pytest.main([__file__])
