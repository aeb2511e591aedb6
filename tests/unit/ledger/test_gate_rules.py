"""The gates' rules on hand-made steps (`titanlab.ledger.gates`): what counts as a sequence-square
attention tensor (a 64 MiB mask included, a convolution's output of matching dims not), host
syncs named and counted, a fallback kernel named; and the report's flags (a memory peak above
the device, shares of at most 100%)."""

from __future__ import annotations

from titanlab.ledger import gates
from titanlab.ledger.price import price
from titanlab.ledger.record import OpRecord
from titanlab.ledger.report import op_rows, render
from titanlab.ledger.run import Ledger
from titanlab.planning.cluster import PROFILES

H100 = PROFILES["h100"]
SEQ = 8192


def ledger(ops: list[OpRecord], peak: float = 0.0, dims: dict | None = None) -> Ledger:
    return Ledger(ops, price(ops, H100, dims), H100, SEQ, 1e12, "hand-made", peak, SEQ, 1,
                  dims or {})  # fmt: skip


def op(name, module="layers.0.attention", kind="pointwise", shape=(SEQ, SEQ), dtype="bfloat16",
       inputs=(), outputs=(), **kw) -> OpRecord:  # fmt: skip
    return OpRecord(name, module, "forward", kind, shape=shape, dtype=dtype, inputs=inputs,
                    outputs=outputs, bytes_read=kw.pop("bytes_read", 1), **kw)  # fmt: skip


def test_a_mask_of_exactly_64_mib_is_a_sequence_square():
    mask = op("aten.ones.default", dtype="bool", outputs=(1,))  # 8192² bytes: 64 MiB
    assert gates.attention_matrices(ledger([mask])) == [
        "aten.ones.default layers.0.attention forward (8192, 8192) bool 64 MiB"
    ]


def test_scores_and_what_is_computed_from_them_count_and_a_convolution_does_not():
    scores = op("aten.bmm.default", kind="gemm", shape=(32, SEQ, SEQ), inputs=(1, 2),
                outputs=(3,), flops=1)  # fmt: skip
    softmax = op("aten._softmax.default", shape=(32, SEQ, SEQ), dtype="float32", inputs=(3,),
                 outputs=(4,))  # fmt: skip
    conv = op("aten.convolution.default", kind="gemm", shape=(1, SEQ, SEQ), inputs=(5, 6),
              outputs=(7,), flops=1)  # fmt: skip
    silu = op("aten.silu.default", shape=(1, SEQ, SEQ), inputs=(7,), outputs=(8,))
    # a projection inside the attention module whose width equals seq_len is not one either
    proj = op("aten.mm.default", module="layers.0.attention.wqkv", kind="gemm", inputs=(9, 10),
              outputs=(11,), flops=1)  # fmt: skip
    found = gates.attention_matrices(ledger([scores, softmax, conv, silu, proj]))
    assert [f.split()[0] for f in found] == ["aten._softmax.default", "aten.bmm.default"]


def test_host_syncs_are_named_by_what_where_and_how_often():
    syncs = [
        op("aten._local_scalar_dense.default", module="", kind="sync", shape=()),
        op("aten._local_scalar_dense.default", module="", kind="sync", shape=()),
        op("Tensor.cpu", module="layers.3.feed_forward", kind="sync", shape=(4,)),
        op("expert_parallel.splits", module="layers.1.moe.experts", kind="sync", shape=(8,)),
    ]
    got = gates.host_syncs(ledger(syncs))
    assert got == {"aten._local_scalar_dense.default - forward": 2,
                   "Tensor.cpu layers.*.feed_forward forward": 1}  # fmt: skip
    assert gates.check(ledger(syncs))["host_syncs"].startswith("3 host syncs in the step: ")


def test_a_fallback_kernel_is_named_with_its_modules_and_time():
    solve = op("aten.linalg_solve_triangular.default", kind="other", shape=(1, 8, 64, 64),
               bytes_read=10**9)  # fmt: skip
    line = gates.check(ledger([solve]))["fallback_kernels"]
    assert "fla's chunk_gated_delta_rule" in line and "1 aten.linalg_solve_triangular" in line
    assert "in layers.*.attention" in line


def test_the_report_flags_a_peak_above_the_device_and_keeps_shares_at_most_whole():
    gemm = op("aten.mm.default", kind="gemm", flops=int(1e12), shape=(8, 8))
    gather = OpRecord("c10d._allgather_base_.default", "layers.0", "forward", "collective",
                      collective="all_gather", group_size=8, group="g",
                      bytes_read=2**33, bytes_written=2**33)  # fmt: skip
    big = ledger([gemm, gather], peak=100 * 2**30, dims={"g": "dp_shard"})
    text = render(big)
    assert "ABOVE the h100's 79.6 GiB: it would not fit" in text.splitlines()[1]
    assert all(0 <= r["share"] <= 1 for r in op_rows(big))
    assert "ABOVE" not in render(ledger([gemm], peak=10 * 2**30))
