"""The ZeRO stage table of `tools/benchmark.py --matrix zero`: for each stage (and ZeRO-Offload),
the memory a rank holds, predicted and measured, the bytes it communicates and its step time.

Every row is the same work: `debugmodel_deep` on 2 data-parallel ranks (gloo), seq 64, 2
microbatches of 2 samples per rank per step (`tools/lib/comm_predict.py`'s "ZeRO-N, dp 2,
grad accum 2" layouts), the plain cross-entropy, fp32. Per row two launches:
- a 2-step run with the communication counter (`TITANLAB_COMM_COUNT`) and the CPU memory
  timeline of step 2 (`profiling.enable_memory_snapshot`: the profiler's peak of live tensors,
  parameters and optimizer state included, rank 0); its bytes are checked against the closed
  forms (`comm_predict.predict`) and summed as ZeRO's §7 counts them (`parameter_traffic`, in
  Ψ = the parameter bytes);
- a timing run without profiler or counter, whose median step time after `WARMUP` steps is
  reported.
The prediction is `titanlab.planning.memory.estimate_memory(...).peak_tensors` of the same
config, the number the pre-flight check uses.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass

from tools.lib import comm_measure, comm_predict
from tools.lib.runs import launch

STAGES = ((0, False), (1, False), (2, False), (3, False), (2, True), (3, True))
"""(ZeRO stage, offload) of each row."""
TIMED_STEPS, WARMUP = 12, 2
SNAPSHOT = [
    "--profiling.enable_memory_snapshot",
    "true",
    "--profiling.profile_freq",
    str(comm_predict.STEPS),
    "--profiling.profiler_warmup",
    "0",
    "--profiling.profiler_active",
    "1",
]


@dataclass
class StageRow:
    """One row of the table (bytes per rank; seconds per step)."""

    stage: int
    offload: bool
    predicted_bytes: int
    measured_bytes: int
    comm_bytes: int
    comm_as_predicted: bool
    traffic_psi: float
    step_s: float
    measured_min: int = 0
    measured_median: int = 0

    @property
    def name(self) -> str:
        return f"ZeRO-{self.stage}" + (" + offload" if self.offload else "")

    @property
    def memory_error(self) -> float:
        """(predicted - measured) / measured, measured the largest peak over the repeats."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


DESCRIPTION = (
    "`debugmodel_deep` (951,360 parameters, Ψ = 3,805,440 bytes in fp32) on 2 data-parallel "
    "ranks (gloo), seq 64, 2 microbatches of 2 samples per rank per step, fp32. Memory: the "
    "peak of every live tensor of rank 0 and 1 in step 2 (`peak_live_bytes` of the CPU memory "
    "timeline) over the repeats: the largest (what must fit: the estimate is a peak the run "
    "must not exceed), the median and the smallest; the pre-flight estimate's `peak_tensors` "
    "is compared with the largest. Where the peak falls moves between runs by up to a block's "
    "gathered weights (FSDP's prefetched all-gather lands on gloo's own thread before or after "
    "the running block frees its own). Communication: step 2 of rank 0, every call's size checked against the "
    "closed form (tools/lib/comm_predict.py); the parameter + gradient traffic as a "
    "bandwidth-optimal ring sends it, in Ψ (ZeRO §7: 2Ψ for DDP and stages 1-2 with one "
    "reduction a step, 3Ψ for stage 3; here 2 microbatches, so stage 2 reduce-scatters "
    "twice and stage 3 gathers twice). Step time: median of steps 3-12 of a run without "
    "profiler or counter. On CPU the offload policy moves nothing (host memory is the "
    "device's), so its rows show the policy's cost, not its saving."
)


def layout(stage: int) -> comm_predict.Layout:
    return next(
        lay for lay in comm_predict.LAYOUTS if lay.name == f"ZeRO-{stage}, dp 2, grad accum 2"
    )


def offload_args(offload: bool) -> list[str]:
    return ["--training.enable_cpu_offload", "true"] if offload else []


def predicted_bytes(stage: int, offload: bool, dataset: str) -> int:
    """`estimate_memory(...).peak_tensors` of the row's config on 2 ranks."""
    import torch

    from titanlab.components import builders
    from titanlab.config.manager import build_config
    from titanlab.planning.memory import estimate_memory

    lay = layout(stage)
    config = build_config(
        comm_measure.train_args(lay, dataset, "unused", comm_predict.STEPS) + offload_args(offload)
    )
    args = builders.build_model_args(config, builders.build_tokenizer(config).vocab_size)
    return estimate_memory(args, config, lay.nproc, torch.float32).peak_tensors


def measured_peak(dump: str, step: int = comm_predict.STEPS, rank: int = 0) -> int:
    """Peak bytes of every live tensor of `step` on `rank` (`peak_live_bytes` of the CPU
    memory timeline: titanlab.observability.profiling)."""
    path = os.path.join(dump, "memory_snapshot", f"rank{rank}_step{step}_peak.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)["peak_live_bytes"]


def step_seconds(stage: int, offload: bool, dataset: str, workdir: str) -> float:
    """Median seconds per step of a `TIMED_STEPS`-step run after `WARMUP` steps."""
    lay = layout(stage)
    dump = os.path.join(workdir, f"timed-zero{stage}{'-offload' if offload else ''}")
    args = comm_measure.train_args(lay, dataset, dump, TIMED_STEPS) + offload_args(offload)
    # torchrun, as a user launches it: the step time is the figure here
    args += ["--metrics.log_freq", "1", "--metrics.save_plot", "false"]
    proc = launch(lay.nproc, args, torchrun=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{lay.name}: timing run exited {proc.returncode}:\n{proc.stderr[-2000:]}"
        )
    with open(os.path.join(dump, "metrics.jsonl"), encoding="utf-8") as f:
        by_step = {r["step"]: r["step_time_ms"] for r in map(json.loads, f)}
    return statistics.median(by_step[s] for s in range(WARMUP + 1, TIMED_STEPS + 1)) / 1000


def run_row(stage: int, offload: bool, dataset: str, workdir: str, repeats: int = 5) -> StageRow:
    """Measure one row: `repeats` counted and profiled runs (the memory is the largest of their
    ranks' peaks, with the median and the smallest: gloo's collectives finish on their own
    thread, so where the peak falls moves by up to a block's worth between runs) and `repeats`
    timing runs."""
    lay = layout(stage)
    sub = os.path.join(workdir, "offload" if offload else "plain")
    os.makedirs(sub, exist_ok=True)
    args = comm_predict.model_args()
    predicted = comm_predict.histogram(comm_predict.predict(lay, args, 0))
    peaks, times = [], []
    for _ in range(repeats):
        measured = comm_measure.measure(
            lay, dataset, sub, extra=(*SNAPSHOT, *offload_args(offload)), warm=False
        )
        dump = comm_measure.dump_folder(lay, sub)
        peaks += [measured_peak(dump, rank=r) for r in range(lay.nproc)]
        times.append(step_seconds(stage, offload, dataset, workdir))
    return StageRow(
        stage,
        offload,
        predicted_bytes(stage, offload, dataset),
        max(peaks),
        sum(k["bytes"] for k in measured[0].values()),
        {k: v["sizes"] for k, v in measured[0].items()} == predicted,
        comm_predict.parameter_traffic(measured[0]) / comm_predict.param_bytes(args),
        statistics.median(times),
        min(peaks),
        int(statistics.median(peaks)),
    )


def render(rows: list[StageRow]) -> str:
    """The Markdown table."""
    mib = 2**20
    lines = [
        "| stage | memory predicted (MiB) | memory measured, largest (MiB) [smallest, median] "
        "| predicted − largest "
        "| comm bytes per step (rank 0) | as predicted | parameter + gradient traffic "
        "| step time (ms) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.predicted_bytes / mib:.2f} | {r.measured_bytes / mib:.2f} "
            f"[{r.measured_min / mib:.2f}, {r.measured_median / mib:.2f}] | "
            f"{r.memory_error:+.1%} | {r.comm_bytes:,} | {'yes' if r.comm_as_predicted else 'NO'} "
            f"| {r.traffic_psi:.2f} Ψ | {r.step_s * 1000:.0f} |"
        )
    return "\n".join(lines)
