"""The ledger against the GPU rows measured so far: predicted and measured step time of every
titanlab row of docs/performance.md, with the error.

    python tools/ledger_calibration.py [--write]

Each row is `titanlab ledger` of the run `tools/gpu_check.py` timed (train_configs/llama_8b.toml
on Llama 3.1 8B's dims with 11 of 32 blocks, vocab 128,256, seq_len 8192, local batch 1, one
GPU), on the code that ran then: the H100 rows of 2026-11-23 before the fused loss existed
(`--loss.fused_linear_cross_entropy false`), the H200 rows of 2026-11-27 with the fused loss
as it ran then (`before_2026_11_28`: the head's weight cast in every chunk, its gradient summed
chunk by chunk as fp32 GEMMs); every row with RoPE in real pairs, as it ran eagerly until
2026-11-30 (`real_pair_rope`; compiled, it still does). `tools/ledger_ab.py` predicts the A/B with the code as it is
now. `--write`
puts the table in docs/performance.md (block `ledger-calibration`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from titanlab.ledger.price import dtype_key
import torch

from tools.lib.bench import write_block
from tools.lib.llama_blocks import LAYERS, model_args

PLAIN_LOSS = ("--loss.fused_linear_cross_entropy", "false")
FLOAT8_TW = ("--float8.enable", "true", "--float8.recipe_name", "tensorwise")
FLOAT8_RW = ("--float8.enable", "true", "--float8.recipe_name", "rowwise")
SELECTIVE = ("--activation_checkpoint.mode", "selective")
EAGER = ("--compile.enable", "false")


@dataclasses.dataclass(frozen=True)
class Row:
    """A measured GPU row: its name, device profile, measured step seconds, where it is
    recorded, the ledger's options, and whether the fp32 weight-gradient defect ran."""

    name: str
    device: str
    measured_s: float
    source: str
    args: tuple[str, ...]
    fp32_head_grad: bool = False
    profile_ms: tuple[tuple[str, float], ...] = ()
    """GPU ms of the row's profiled step by kernel kind (docs/performance.md, `gpu-check`):
    the rows the efficiencies are fitted on."""


ROWS = (
    Row("bf16 · compile · AC none", "h100", 0.333, "H100 2026-11-23", PLAIN_LOSS,
        profile_ms=(("attention", 42), ("gemm", 189), ("optimizer", 53), ("fused", 32))),
    Row("float8 tensorwise · compile · AC none", "h100", 0.304, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW, profile_ms=(("gemm", 162),)),
    Row("float8 rowwise · compile · AC none", "h100", 0.337, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_RW, profile_ms=(("gemm", 190),)),
    Row("bf16 · compile · AC selective", "h100", 0.366, "H100 2026-11-23", PLAIN_LOSS + SELECTIVE),
    Row("float8 tensorwise · compile · AC selective", "h100", 0.301, "H100 2026-11-23",
        PLAIN_LOSS + FLOAT8_TW + SELECTIVE),
    Row("bf16 · eager · AC none", "h100", 0.395, "H100 2026-11-23", PLAIN_LOSS + EAGER),
    # the H200 rows of the torchtitan A/B: 8,192 tokens over titanlab's tokens/s
    Row("bf16 · compile · AC none (fused loss, fp32 head gradient)", "h200", 8192 / 14954,
        "H200 2026-11-27", (), fp32_head_grad=True),
    Row("float8 tensorwise · compile · AC none (fused loss, fp32 head gradient)", "h200",
        8192 / 16219, "H200 2026-11-27", FLOAT8_TW, fp32_head_grad=True),
    Row("bf16 · compile · AC selective (fused loss, fp32 head gradient)", "h200", 8192 / 14198,
        "H200 2026-11-27", SELECTIVE, fp32_head_grad=True),
)  # fmt: skip


class PerChunkFp32Sums:
    """The fused loss's weight gradient as it ran until 2026-11-28 (`RowGradients`' interface):
    each chunk's rows of G in the hidden states' dtype (fp32 under autocast), added to a
    zero-initialized fp32 sum at once with an fp32 GEMM (`addmm_`)."""

    def __init__(self, xs, vocab, chunk_size, dtype) -> None:
        self.xs, self.vocab, self.g = xs, vocab, None
        self.sums = [x.new_zeros((vocab, x.shape[1]), dtype=torch.float32) for x in xs]

    def next_rows(self, c: int):
        self.g = self.xs[0].new_empty(c, self.vocab)
        return self.g

    def keep(self, g):
        self.g = g.to(self.xs[0].dtype)
        return self.g

    def flush(self, end: int) -> None:
        rows = self.g.shape[0]
        for total, x in zip(self.sums, self.xs):
            total.addmm_(self.g.t().float(), x[end - rows : end].float())

    def results(self):
        return self.sums


@contextlib.contextmanager
def before_2026_11_28(on: bool):
    """The fused loss as the H200 rows of 2026-11-27 ran it: autocast casting the head's fp32
    weight in every chunk's GEMMs, and the weight gradient summed chunk by chunk as fp32
    GEMMs."""
    import titanlab.components.fused_ce as fused_ce

    before = fused_ce._operands, fused_ce.RowGradients
    if on:
        fused_ce._operands = lambda h, w: ((h[:1] @ w[:1].t()).dtype, h, w)
        fused_ce.RowGradients = PerChunkFp32Sums
    try:
        yield
    finally:
        fused_ce._operands, fused_ce.RowGradients = before


@contextlib.contextmanager
def real_pair_rope():
    """RoPE as every recorded row ran it: in real pairs (ten eager kernels a tensor), not the
    complex product eager runs have taken since 2026-11-30."""
    import titanlab.models.common.rope as rope

    before = rope._as_complex
    rope._as_complex = lambda x: False
    try:
        yield
    finally:
        rope._as_complex = before


def predict(row: Row, folder: str):
    from titanlab.ledger.run import build_ledger

    config = os.path.join(REPO, "train_configs", "llama_8b.toml")
    argv = ["--job.config_file", config, "--comm.fake_world_size", "1", *model_args(folder),
            "--activation_checkpoint.mode", "none"]  # fmt: skip
    then = ("--loss.chunk_size", "256") if row.fp32_head_grad else ()  # the default then
    with before_2026_11_28(row.fp32_head_grad), real_pair_rope():
        return build_ledger([*argv, *row.args, *then], row.device)


def kernel_kind(op) -> str:
    """The profile's kernel kind of a recorded op (docs/performance.md's `gpu-check` tables):
    attention, gemm, optimizer (AdamW and the gradient norm's kernels), fused (a compiled
    region's Triton kernels) or other."""
    from titanlab.ledger.price import _fuses

    if op.kind in ("attention", "gemm"):
        return op.kind
    if op.phase in ("optimizer", "grad_norm"):
        return "optimizer"
    return "fused" if _fuses(op) else "other"


def fit(recorded: dict[Row, list]) -> dict[str, float]:
    """The efficiencies the profiled rows imply: each kind's recorded work (bytes or FLOPs) over
    its measured GPU time at the device's peak. memory, fused and attention from the bf16 row;
    float8 tensorwise and rowwise from their rows' GEMM time less the bf16 GEMMs (the output
    head) at the profile's matmul efficiency."""
    from titanlab.ledger.price import fused_traffic
    from titanlab.planning.cluster import get_profile

    out: dict[str, float] = {}
    for row, ops in recorded.items():
        if not row.profile_ms:
            continue
        device, ms = get_profile(row.device), dict(row.profile_ms)
        work: dict[str, float] = {}
        float8 = other_gemm_s = 0.0
        for op, (read, written) in zip(ops, fused_traffic(ops)):
            if op.kind in ("view", "collective"):
                continue
            kind = kernel_kind(op)
            work[kind] = work.get(kind, 0.0) + (op.flops if op.flops else read + written)
            if kind == "gemm" and op.dtype.startswith("float8"):
                float8 += op.flops
            elif kind == "gemm":
                other_gemm_s += op.flops / (
                    device.flops(dtype_key(op.dtype)) * device.efficiency.matmul
                )
        if float8:
            name = "float8_rowwise" if any(o.rowwise for o in ops) else "float8_tensorwise"
            out[name] = float8 / ((ms["gemm"] / 1e3 - other_gemm_s) * device.flops("float8"))
            continue
        bandwidth = device.memory_bandwidth
        out["memory"] = work["optimizer"] / (ms["optimizer"] / 1e3 * bandwidth)
        out["fused"] = work["fused"] / (ms["fused"] / 1e3 * bandwidth)
        out["attention"] = work["attention"] / (ms["attention"] / 1e3 * device.flops("bfloat16"))
    return out


def table(results: list[tuple[Row, float]]) -> str:
    lines = [
        "| row | device | used to | measured s | predicted s | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row, predicted in results:
        error = predicted / row.measured_s - 1
        use = "fit" if row.profile_ms else "check"
        lines.append(f"| {row.name} | {row.source} | {use} | {row.measured_s:.3f} | "
                     f"{predicted:.3f} | {100 * error:+.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from titanlab.ledger.price import LedgerEfficiency, price
    from titanlab.planning.cluster import get_profile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="write the table to docs/performance.md")
    opts = p.parse_args(argv)
    start = time.time()
    recorded = {}
    with tempfile.TemporaryDirectory() as folder:
        for row in ROWS:
            recorded[row] = predict(row, folder).ops
            print(f"recorded {row.name} ({row.source})", flush=True)
    fitted = fit(recorded)
    shipped = LedgerEfficiency()
    factors = "; ".join(f"{k} {v:.3f} (shipped {getattr(shipped, k):.2f})"
                        for k, v in fitted.items())  # fmt: skip
    print(f"fitted: {factors}")
    results = [(row, price(ops, get_profile(row.device)).step_s) for row, ops in recorded.items()]
    text = table(results)
    print(text)
    if opts.write:
        head = (f"`python tools/ledger_calibration.py --write` ({time.time() - start:.0f} s on "
                "this CPU): the ledger's step against the measured one, Llama 3.1 8B dims with "
                f"{LAYERS} blocks, seq_len 8192, local batch 1, one GPU. Fitted on the rows "
                f"marked fit (their profiled kernel times): {factors}; `LedgerEfficiency` ships "
                "them rounded.\n\n")  # fmt: skip
        write_block(os.path.join(REPO, "docs", "performance.md"), "ledger-calibration",
                    head + text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
