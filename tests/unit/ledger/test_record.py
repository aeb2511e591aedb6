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


def test_a_profiler_range_labels_only_the_ops_inside_it():
    """The gradient norm's and `torch.optim`'s ranges label the ops inside them (`_PHASES`); what
    runs after a range closes is the step's again. Before, a closed range was never forgotten
    (the exit op's handle is another Python object than the enter op's), so the ops after the
    norm, and after the optimizer, kept its phase, and which one won depended on id reuse."""
    with FakeTensorMode():
        model, x = Two(), torch.empty(8, 32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = Recorder()
        with rec:
            model(x).sum().backward()
            for _ in range(2):  # reused ids, if any, meet the second round
                with torch.profiler.record_function("titanlab::clip_grad_norm"):
                    torch.ones(3).mul_(2)
                torch.ones(4).add_(1)  # between the two: the step's
                optimizer.step()
                torch.ones(5).sub_(1)  # after: the step's
    phases = {op.shape: op.phase for op in rec.ops if op.op.startswith("aten.")}
    assert phases[(3,)] == "grad_norm" and phases[(4,)] == "step" and phases[(5,)] == "step"
    stepped = [op.phase for op in rec.ops if op.op.startswith("aten.add_") and op.shape == (64, 32)]
    assert stepped and set(stepped) == {"optimizer"}


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


def test_causal_attention_counts_the_tiles_a_flash_kernel_computes():
    from titanlab.ledger.flops import causal_fraction

    assert causal_fraction(8192) == pytest.approx(65 / 128)  # 64 × 64 tiles, 2080 computed
    assert causal_fraction(128) == 1.0
    assert causal_fraction(200) == pytest.approx(3 / 4)  # 2 × 2 tiles, 3 computed
    b, h, s, d = 1, 2, 256, 16
    with FakeTensorMode():
        q, k, v = (torch.empty(b, h, s, d, requires_grad=True) for _ in range(3))
        flops = {}
        for causal in (False, True):
            rec = Recorder()
            with rec:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            (op,) = [o for o in rec.ops if o.kind == "attention"]
            flops[causal] = op.flops
    assert flops[False] == 4 * b * h * s * s * d  # QK^T and PV
    assert flops[True] == int(flops[False] * causal_fraction(s))


def test_a_compiled_functions_forward_and_backward_form_one_region():
    from titanlab.components.compiled import compile_function

    def softplus_sum(x):
        return torch.log1p(torch.exp(x)).sum()

    fn = compile_function(softplus_sum)
    with FakeTensorMode(), torch.compiler.set_stance("force_eager"):
        w = torch.empty(8, 8, requires_grad=True)
        x = torch.empty(4, 8)
        rec = Recorder()
        with rec:
            h = x @ w
            fn(h * 2).backward()
    ran = [(op.op, op.phase, op.region) for op in rec.ops if op.kind != "view"]
    inside = [(op, phase) for op, phase, region in ran if region == 0]
    outside = [(op, phase) for op, phase, region in ran if region is None]
    assert [op for op, phase in inside if phase == "step"] == ["aten.exp.default",
        "aten.log1p.default", "aten.sum.default"]  # fmt: skip
    # softplus's gradient (expand, 1 + e^x, divide, multiply) joins the region; the caller's
    # ops, before the call and in backward (h * 2's and the GEMM's gradients), do not
    assert [op for op, phase in inside if phase == "backward"] == ["aten.add.Scalar",
        "aten.div.Tensor", "aten.mul.Tensor"]  # fmt: skip
    assert ("aten.mul.Tensor", "step") in outside and ("aten.mul.Tensor", "backward") in outside
    assert ("aten.mm.default", "step") in outside and ("aten.mm.default", "backward") in outside


def test_an_in_place_scatter_moves_the_rows_it_names_not_its_whole_target():
    with FakeTensorMode():
        g = torch.empty(1024, 32000)
        index, src = torch.zeros(1024, 1, dtype=torch.long), torch.empty(1024, 1)
        rec = Recorder()
        with rec:
            g.scatter_add_(1, index, src)
    (op,) = [o for o in rec.ops if o.kind != "view"]
    assert op.bytes_written == 1024 * 4  # one element per row
    assert op.bytes_read == 1024 * 8 + 1024 * 4 + 1024 * 4  # index, source, the rows' old values


def test_host_syncs_are_recorded_where_a_gpu_run_makes_them():
    """`.item()` and `.tolist()` of a device tensor, `.cpu()` and `.to("cpu")` copies, and a
    read the code skipped (`host_reads.skipped`) are syncs, with module, phase and bytes; the
    trainer's `.to(device)` (a `torch.device`) and torch.optim's CPU step counters are not."""
    from titanlab.config import host_reads
    from titanlab.config.device_path import Target
    from titanlab.ledger.step import record_loop

    def build():
        model, x = Two(), torch.empty(8, 32)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)  # CPU step counters

        def step():
            loss = model(x).sum()
            loss.backward()
            loss.item()  # 1 sync
            model.up.weight.grad.abs().max(1).values.tolist()  # 1 read per value: 64 syncs
            model.down.weight.grad.cpu()  # a copy: 1 sync of 16 × 64 × 4 bytes
            model.down.weight.grad.to("cpu")  # 1
            model.down.weight.grad.to(torch.device("cpu"))  # the trainer's move: none
            host_reads.skipped("a skipped read", loss)  # 1
            opt.step()  # reads its step counters (CPU tensors on a GPU): none
            opt.zero_grad()

        return step

    ops = record_loop(build, Target("cuda", (9, 0)))
    syncs = [(op.op, op.phase, op.bytes_read) for op in ops if op.kind == "sync"]
    assert syncs.count(("aten._local_scalar_dense.default", "step", 4)) == 65
    assert ("Tensor.cpu", "step", 16 * 64 * 4) in syncs and ("Tensor.to", "step", 4096) in syncs
    assert ("a skipped read", "step", 4) in syncs and len(syncs) == 68


def test_a_functional_collectives_wait_moves_no_memory():
    """`wait_tensor` returns its input once the collective is done: a view, priced at 0, not
    the read and write of the buffer (12.7 ms of DeepSeek-V3 16B's step before 2026-12-02)."""
    from titanlab.ledger.record import _kind

    wait = torch.ops._c10d_functional.wait_tensor.default
    assert _kind(wait, str(wait)) == "view"
