"""Gate 4 (docs/ledger.md): titanlab's step priced for an H100 is at most torchtitan 0.2.2's
on every row of the GPU A/B (`tools/benchmark_torchtitan.py`: bf16 compiled, float8
tensorwise, compiled with selective AC, bf16 eager, float8 rowwise), on the same work: Llama 3 8B's dims with 2
blocks, seq_len 8192, one GPU, and bf16 compiled as rank 0 of FSDP over 8 GPUs; torchtitan's
own model, loss, optimizer and clipping
(`tools/lib/torchtitan_ledger.py`) under the same recorder and prices. Gate 5's second half:
the fused loss's fp32 weight gradient of 2026-11-27, put back, fails it."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from tests.unit.ledger.test_gates import REPO, blocks_of
from titanlab.ledger.loop import ledger_of_loop
from titanlab.ledger.run import build_ledger
from tools.lib.ab_rows import GPU_ROWS
from tools.lib.torchtitan_ledger import Shape, step_builder

# torchtitan is a peer (the dev extra): found, never imported by titanlab
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan (the dev extra)"
    ),
    pytest.mark.xdist_group("ledger"),  # one worker: the ledgers' first-build costs paid once
]
ROWS = {row.name: row for row in GPU_ROWS}  # the A/B's rows, the first three measured on the H200


def titanlab_step(row, ranks: int = 1) -> float:
    with tempfile.TemporaryDirectory() as folder:
        return build_ledger(
            ["--job.config_file", os.path.join(REPO, "train_configs", "llama_8b.toml"),
             *blocks_of(folder), "--comm.fake_world_size", str(ranks), *row.titanlab_args()],
            "h100",
        ).priced.step_s  # fmt: skip


def torchtitan_step(row, ranks: int = 1) -> float:
    """torchtitan's step on one GPU or, with `ranks` > 1, as rank 0 of FSDP over `ranks`
    (a fake world, as titanlab's ledger runs in)."""
    from titanlab.distributed.init import destroy_distributed, init_fake_world

    shape = Shape()
    if ranks > 1:
        init_fake_world(ranks, "cpu")
    try:
        build = step_builder(shape, row.torchtitan_args(), dp_shard=ranks)
        return ledger_of_loop(
            build, "h100", shape.seq_len, 0.0, "torchtitan", shape.seq_len
        ).priced.step_s
    finally:
        if ranks > 1:
            destroy_distributed(barrier=False)


@pytest.mark.parametrize("name", list(ROWS))
def test_titanlab_is_at_most_torchtitan(name):
    row = ROWS[name]
    ours, theirs = titanlab_step(row), torchtitan_step(row)
    print(f"{name}: titanlab {ours * 1e3:.1f} ms, torchtitan {theirs * 1e3:.1f} ms, "
          f"{theirs / ours:.3f}×")  # fmt: skip
    assert ours <= theirs


def test_titanlab_is_at_most_torchtitan_under_fsdp_over_8_gpus():
    """The multi-GPU timing gate: both steps as rank 0 of FSDP 8 (bf16, compiled, no AC), their
    all-gathers and reduce-scatters priced by the same overlap model (measured: 106.1 against
    106.6 ms)."""
    row = ROWS["bf16 · compile · AC none"]
    ours, theirs = titanlab_step(row, 8), torchtitan_step(row, 8)
    print(f"FSDP 8: titanlab {ours * 1e3:.1f} ms, torchtitan {theirs * 1e3:.1f} ms")
    assert ours <= theirs


def test_the_fp32_weight_gradient_of_2026_11_27_fails_the_ab(monkeypatch):
    import titanlab.components.head_gradient as head_gradient

    def fp32_everywhere(a, b, dtype):  # the product before the fix: an in-place fp32 GEMM,
        # which autocast leaves in fp32
        return a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.float32).addmm_(
            a.float(), b.float()
        )

    row = ROWS["bf16 · compile · AC none"]
    theirs = torchtitan_step(row)
    monkeypatch.setattr(head_gradient, "product", fp32_everywhere)
    ours = titanlab_step(row)
    print(f"the defect put back: titanlab {ours * 1e3:.1f} ms, torchtitan {theirs * 1e3:.1f} ms")
    assert ours > theirs
