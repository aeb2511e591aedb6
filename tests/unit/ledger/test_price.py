"""Pricing on the roofline: a GEMM at its dtype's peak, a memory-bound op at the bandwidth plus
a launch, compiled regions' pointwise ops fused (only external reads, only writes read
elsewhere), collectives in the α–β model, FSDP's overlapped and TP's waited for."""

from __future__ import annotations

import pytest

from titanlab.ledger.price import LedgerEfficiency, fused_traffic, price
from titanlab.ledger.record import OpRecord
from titanlab.planning.cluster import PROFILES
from titanlab.planning.comm_model import ring_seconds

H100 = PROFILES["h100"]
EFF = LedgerEfficiency()


def test_a_gemm_costs_its_flops_at_its_dtypes_peak():
    flops = 2 * 8192 * 4096 * 4096
    bf16 = OpRecord("aten.mm.default", "", "forward", "gemm", flops=flops, dtype="bfloat16")
    fp32 = OpRecord("aten.mm.default", "", "forward", "gemm", flops=flops, dtype="float32")
    got = price([bf16, fp32], H100).seconds
    rate = H100.efficiency.matmul
    assert got[0] == pytest.approx(flops / (989e12 * rate) + EFF.launch_s)
    assert got[1] == pytest.approx(flops / (67e12 * rate) + EFF.launch_s)  # CUDA cores, no TF32
    assert got[1] / got[0] > 14


def test_a_memory_bound_op_costs_its_bytes_at_the_bandwidth():
    add = OpRecord("aten.add.Tensor", "", "forward", "pointwise", bytes_read=2e9, bytes_written=1e9)
    (s,) = price([add], H100).seconds
    assert s == pytest.approx(3e9 / (3.35e12 * EFF.memory) + EFF.launch_s)


def test_a_compiled_regions_pointwise_chain_reads_its_inputs_and_writes_what_leaves():
    # x (id 0, from a GEMM) -> mul -> 2 -> add -> 3, read by a GEMM; 2 is read only inside
    gemm = OpRecord("aten.mm.default", "", "forward", "gemm", outputs=(0,), flops=1)
    mul = OpRecord("aten.mul.Tensor", "", "forward", "pointwise", region=7, inputs=(0,),
                   outputs=(2,), bytes_read=100, bytes_written=100)  # fmt: skip
    add = OpRecord("aten.add.Tensor", "", "forward", "pointwise", region=7, inputs=(2,),
                   outputs=(3,), bytes_read=100, bytes_written=100)  # fmt: skip
    use = OpRecord("aten.mm.default", "", "forward", "gemm", inputs=(3,), flops=1)
    assert fused_traffic([gemm, mul, add, use]) == [(0, 0), (100, 0), (0, 100), (0, 0)]
    # outside a compiled region each keeps its own traffic and launch
    eager = [OpRecord(o.op, "", "forward", o.kind, inputs=o.inputs, outputs=o.outputs,
                      bytes_read=o.bytes_read, bytes_written=o.bytes_written, flops=o.flops)
             for o in (gemm, mul, add, use)]  # fmt: skip
    assert fused_traffic(eager)[1:3] == [(100, 100), (100, 100)]
    fused, plain = price([gemm, mul, add, use], H100), price(eager, H100)
    # plain: 4 × 100 bytes at the memory efficiency and two launches; fused: 2 × 100 bytes
    assert plain.compute_s - fused.compute_s == pytest.approx(
        400 / (3.35e12 * EFF.memory) + 2 * EFF.launch_s - 200 / (3.35e12 * EFF.fused)
    )


def test_fsdp_collectives_overlap_the_compute_and_tp_ones_are_waited_for():
    gemm = OpRecord("aten.mm.default", "", "forward", "gemm", flops=int(1e15), dtype="bfloat16")
    gather = OpRecord("c10d._allgather_base_.default", "", "forward", "collective",
                      collective="all_gather", group_size=8, group="g0",
                      bytes_read=2**30, bytes_written=2**30)  # fmt: skip
    reduce = OpRecord("_c10d_functional.all_reduce.default", "", "forward", "collective",
                      collective="all_reduce", group_size=8, group="g1",
                      bytes_read=2**20, bytes_written=2**20)  # fmt: skip
    got = price([gemm, gather, reduce], H100, {"g0": "dp_shard", "g1": "tp"})
    beta = 450e9 * H100.efficiency.link
    want_gather = ring_seconds("all-gather", 8, 2**30, 1, H100.intra_latency, beta)
    want_reduce = ring_seconds("all-reduce", 8, 2**20, 1, H100.intra_latency, beta)
    assert got.seconds[1:] == pytest.approx([want_gather, want_reduce])
    assert got.exposed_comm_s == pytest.approx(want_reduce)  # the gather hides under 1.3 s of GEMM
    assert got.step_s == pytest.approx(got.compute_s + want_reduce)
    # a group larger than a node crosses the NICs
    wide = OpRecord("c10d._allgather_base_.default", "", "forward", "collective",
                    collective="all_gather", group_size=16, bytes_read=2**30)  # fmt: skip
    assert price([wide], H100).seconds[0] == pytest.approx(
        ring_seconds("all-gather", 16, 2**30, 1, H100.inter_latency, 50e9 * H100.efficiency.link)
    )


def test_float8_attention_and_fused_kernels_run_at_their_fitted_efficiencies():
    flops = int(1e12)
    tensorwise = OpRecord("aten._scaled_mm.default", "", "forward", "gemm", flops=flops,
                          dtype="float8_e4m3fn")  # fmt: skip
    rowwise = OpRecord("aten._scaled_mm.default", "", "forward", "gemm", flops=flops,
                       dtype="float8_e4m3fn", rowwise=True)  # fmt: skip
    attention = OpRecord("aten._scaled_dot_product_cudnn_attention.default", "", "forward",
                         "attention", flops=flops, dtype="bfloat16")  # fmt: skip
    fused = OpRecord("aten.mul.Tensor", "", "forward", "pointwise", region=0, inputs=(1,),
                     outputs=(2,), bytes_read=10**9, bytes_written=10**9)  # fmt: skip
    got = price([tensorwise, rowwise, attention, fused], H100).seconds
    fp8 = H100.flops("float8")
    assert got[0] == pytest.approx(flops / (fp8 * EFF.float8_tensorwise) + EFF.launch_s)
    assert got[1] == pytest.approx(flops / (fp8 * EFF.float8_rowwise) + EFF.launch_s)
    assert got[2] == pytest.approx(flops / (989e12 * EFF.attention) + EFF.launch_s)
    # its input came from outside the region and nothing reads its output: both count
    assert got[3] == pytest.approx(2e9 / (3.35e12 * EFF.fused))
