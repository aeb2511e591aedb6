"""The recorder: exact FLOPs and bytes of a rank's own ops (DTensor's local work, not its shape
propagation), module paths and phases, and collectives with their group and bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titanlab.distributed.init import destroy_distributed, init_fake_world
from titanlab.ledger.record import Recorder


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def fake_world():
    init_fake_world(4, "cpu")
    yield
    destroy_distributed(barrier=False)


def test_matmul_flops_bytes_module_paths_and_phases():
    with FakeTensorMode():
        model, x = Two(), torch.empty(8, 32)
        rec = Recorder()
        with rec:
            model(x).sum().backward()
            with rec.phase("optimizer"):
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
    mms = [op for op in rec.ops if op.op == "aten.mm.default"]
    fwd = [op for op in mms if op.phase == "forward"]
    assert [(op.module, op.flops) for op in fwd] == [
        ("up", 2 * 8 * 32 * 64),
        ("down", 2 * 8 * 64 * 16),
    ]
    assert fwd[0].bytes_read == 4 * (8 * 32 + 32 * 64) and fwd[0].bytes_written == 4 * 8 * 64
    bwd = [op for op in mms if op.phase == "backward"]
    # down: grad input and grad weight; up: grad weight only (x needs no gradient)
    assert sum(op.flops for op in bwd) == 2 * (2 * 8 * 64 * 16) + 2 * 8 * 32 * 64
    assert {op.phase for op in rec.ops} >= {"forward", "backward", "optimizer"}
    assert all(op.kind == "gemm" and op.dtype == "float32" for op in mms)
    views = [op for op in rec.ops if op.op == "aten.t.default"]
    assert views and all(op.kind == "view" and op.bytes_read == 0 for op in views)


def test_tensor_parallel_records_the_ranks_shard_not_the_global_shape(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (4,))
    model = parallelize_module(Two(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(8, 32)
        rec = Recorder()
        with rec:
            model(x)
    mms = [op for op in rec.ops if op.op == "aten.mm.default"]
    # each rank multiplies by its quarter of each weight; the global-shape products DTensor
    # runs to propagate shapes are not this rank's work
    assert [op.flops for op in mms] == [2 * 8 * 32 * 16, 2 * 8 * 16 * 16]
    reduces = [op for op in rec.ops if op.kind == "collective"]
    assert [(op.collective, op.group_size, op.bytes_read) for op in reduces] == [
        ("all_reduce", 4, 4 * 8 * 16)
    ]
    assert reduces[0].group == mesh.get_group().group_name


def test_fsdp_all_gathers_and_reduce_scatters_name_their_group_and_bytes(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (4,))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Two()
        fully_shard(model, mesh=mesh)
        rec = Recorder()
        with rec:
            model(torch.empty(8, 32)).sum().backward()
    kinds = [(op.collective, op.phase, op.group_size) for op in rec.ops if op.kind == "collective"]
    assert ("all_gather", "forward", 4) in kinds and ("reduce_scatter", "backward", 4) in kinds
    gather = next(op for op in rec.ops if op.collective == "all_gather")
    assert gather.bytes_read == 4 * (32 * 64 + 64 * 16)  # the whole unit, gathered
    assert dist.is_initialized()
