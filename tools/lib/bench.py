"""What the benchmark scripts share: the rows (`Run`, `Result`), running the trainer under
torchrun and the baseline loop in a child of `tools/benchmark.py`, step times from
metrics.jsonl, the table, and the `<!-- benchmark:TAG -->` blocks of the docs they write.
`tools/benchmark.py`'s docstring gives the method."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from titanlab.models.registry import DEFAULT_FAMILY
from titanlab.observability.hostinfo import cpu_model, ram_gib
from tools.lib.runs import REPO, failure_line

BENCHMARK_SCRIPT = os.path.join(REPO, "tools", "benchmark.py")

CONFIG = os.path.join(REPO, "train_configs", "debug_model.toml")


SEQ, GLOBAL_BS = 256, 16


HEADER = "# Performance\n\nMeasured by `tools/benchmark.py`; see its docstring for the method.\n"


@dataclasses.dataclass(frozen=True)
class Run:
    """One row: the trainer under torchrun (`ranks` >= 1) or the plain baseline loop (`ranks` 0)."""

    compile: bool = False
    ac: str = "none"
    ranks: int = 1
    precision: str = "fp32"  # fp32 | bf16 | float8 (float8: baseline-style GPU rows only)
    fixed_malloc: bool = False
    """Baseline rows: the plain loop with the trainer's fixed glibc malloc thresholds
    (`titanlab.trainer.host_allocator`), the same allocator as titanlab's CPU runs."""

    @property
    def name(self) -> str:
        mode = "compile" if self.compile else "eager"
        if self.ranks == 0:
            loop = "plain loop, fixed malloc thresholds" if self.fixed_malloc else "plain loop"
            return f"baseline ({loop}) · {mode} · {self.precision}"
        ranks = "1 rank" if self.ranks == 1 else f"{self.ranks} ranks FSDP"
        return f"titanlab · {mode} · AC {self.ac} · {ranks} · {self.precision}"


@dataclasses.dataclass
class Result:
    """Summary of one run. `step_s`: median seconds/step; `tps`: median tokens/s of one rank;
    `peak_gib`: peak memory in GiB; `threads`: intra-op threads per rank; `error`: why it failed."""

    run: Run
    step_s: float = float("nan")
    tps: float = float("nan")
    peak_gib: float = float("nan")
    threads: int = 1
    ratio: float | None = None
    mfu: float | None = None
    error: str = ""
    spread: tuple[float, float] | None = None  # min and max per-repeat median step time (s)


def combine(repeats: list[Result]) -> Result:
    """One row from the same run repeated: medians over repeats, with the step-time range."""
    ok = [r for r in repeats if not r.error]
    if not ok:
        return repeats[0]
    steps = [r.step_s for r in ok]
    return dataclasses.replace(
        ok[0],
        step_s=statistics.median(steps),
        tps=statistics.median(r.tps for r in ok),
        peak_gib=max(r.peak_gib for r in ok),
        spread=(min(steps), max(steps)) if len(ok) > 1 else None,
    )


def step_times(records: list[dict], tokens_per_step: int, warmup: int) -> list[float]:
    """Seconds per step of each step after `warmup`, from metrics.jsonl records logged every step.

    Raises ValueError when a step is missing (tps would then average over several steps)."""
    by_step = {r["step"]: r for r in records}  # a resumed run may log a step twice: the last wins
    steps = sorted(by_step)
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(
            f"metrics.jsonl must log every step from 1 (metrics.log_freq 1); got {steps}"
        )
    return [tokens_per_step / by_step[s]["tps"] for s in steps[warmup:]]


def summarize(
    run: Run, times_s: list[float], tokens_per_step: int, peak_gib: float, threads: int
) -> Result:
    """A Result from per-step seconds: median step time and median per-rank tokens/s."""
    if not times_s:
        return Result(run, error="no steps after the warm-up")
    return Result(
        run,
        statistics.median(times_s),
        statistics.median(tokens_per_step / t for t in times_s),
        peak_gib,
        threads,
    )


def add_ratios(results: list[Result], per_thread: bool = True) -> None:
    """Set each row's `ratio`: its tps (per thread when `per_thread`, i.e. on CPU) ÷ that of the
    baseline of the same precision and compile setting (else the eager one of that precision),
    the plain loop as a user runs it (glibc's own malloc thresholds)."""
    base = {
        (r.run.precision, r.run.compile): r
        for r in results
        if r.run.ranks == 0 and not r.run.fixed_malloc and not r.error
    }
    for r in results:
        b = base.get((r.run.precision, r.run.compile)) or base.get((r.run.precision, False))
        if b is not None and not r.error:
            r.ratio = r.tps / b.tps * (b.threads / r.threads if per_thread else 1.0)


def render_table(results: list[Result], mfu: bool = False) -> str:
    """A Markdown table of `results`; failed rows show their error. `mfu` adds an MFU column."""
    head = [
        "run",
        "step time (ms, median)",
        "tps/rank (median)",
        "peak memory (GiB)",
        "vs baseline",
    ]
    lines = ["| " + " | ".join(head + ["MFU"] * mfu) + " |", "|---" * (len(head) + mfu) + "|"]
    for r in results:
        if r.error:
            cells = [r.run.name, f"failed: {r.error}", "", "", ""] + [""] * mfu
        else:
            spread = f" ({r.spread[0] * 1e3:.0f}–{r.spread[1] * 1e3:.0f})" if r.spread else ""
            cells = [
                r.run.name,
                f"{r.step_s * 1e3:.1f}{spread}",
                f"{r.tps:,.0f}",
                f"{r.peak_gib:.2f}",
                "" if r.ratio is None else f"{r.ratio:.2f}×",
            ]
            cells += [f"{100 * r.mfu:.1f}%" if r.mfu is not None else "n/a"] * mfu
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def replace_block(text: str, tag: str, body: str) -> str:
    """`text` with the block between the `tag` markers set to `body` (appended when absent)."""
    begin, end = f"<!-- benchmark:{tag}:begin -->", f"<!-- benchmark:{tag}:end -->"
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"
    return f"{text.rstrip()}\n\n{begin}\n{body}\n{end}\n"


def write_block(path: str, tag: str, body: str) -> None:
    """Replace (or add) the `tag` block of the Markdown file at `path`, creating the file."""
    text = HEADER
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(replace_block(text, tag, body))


def machine(info: dict, threads: int, command: str) -> str:
    """One paragraph: CPU, cores, RAM, GPU, torch version, threads, date and the command."""
    cpu, ram = cpu_model(), ram_gib()
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (
        f"Machine: {cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM{gpu}; Python "
        f"{platform.python_version()}, torch {info['torch']}; {threads} intra-op thread(s) for "
        f"1 rank and the baseline, 1 per rank for 2 ranks; {datetime.date.today()}.\n"
        f"Command: `{command}`"
    )


def child(spec: dict, threads: int) -> dict:
    """Run tools/benchmark.py as a child process with `spec` (a probe or a baseline loop); its JSON reply."""
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, BENCHMARK_SCRIPT, "--child", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {failure_line(proc.stderr)}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_trainer(
    run: Run,
    steps: int,
    warmup: int,
    threads: int,
    data_dir: str,
    model: str = DEFAULT_FAMILY,
    extra: tuple[str, ...] = (),
) -> Result:
    """Train `warmup + steps` steps of `model`'s debugmodel (plus `extra` options) under
    torchrun, with the plain cross-entropy (the plain loop's; `extra` may turn the fused loss
    on); summarize rank 0's metrics.jsonl."""
    local = GLOBAL_BS // run.ranks
    threads = threads if run.ranks == 1 else 1
    with tempfile.TemporaryDirectory(prefix="titanlab_bench_") as dump:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={run.ranks}",
            "-m",
            "titanlab.train",
            "--job.config_file",
            CONFIG,
            "--model.name",
            model,
            "--job.dump_folder",
            dump,
            "--data.dataset_path",
            data_dir,
            "--training.steps",
            str(warmup + steps),
            "--training.seq_len",
            str(SEQ),
            "--training.global_batch_size",
            str(GLOBAL_BS),
            "--training.local_batch_size",
            str(local),
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
            "--compile.enable",
            str(run.compile).lower(),
            "--activation_checkpoint.mode",
            run.ac,
            "--training.mixed_precision_param",
            "bfloat16" if run.precision == "bf16" else "float32",
            "--training.mixed_precision_on_cpu",
            str(run.precision == "bf16").lower(),
            "--loss.fused_linear_cross_entropy",  # the plain loop's loss: the same work
            "false",
            *extra,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        path = os.path.join(dump, "metrics.jsonl")
        if proc.returncode != 0 or not os.path.exists(path):
            return Result(
                run, error=f"exit {proc.returncode}: {failure_line(proc.stderr + proc.stdout)}"
            )
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    times = step_times(records, local * SEQ, warmup)
    return summarize(run, times, local * SEQ, max(r["memory_gib"] for r in records), threads)


def run_plain(run: Run, spec: dict, threads: int) -> Result:
    """The plain loop of `spec` in a child process, as a Result (tps per process)."""
    out = child(
        dict(
            spec,
            kind="loop",
            compile=run.compile,
            precision=run.precision,
            threads=threads,
            fixed_malloc=run.fixed_malloc,
        ),
        threads,
    )
    if "error" in out:
        return Result(run, error=out["error"])
    tokens = spec["batch"] * spec["seq"]
    res = summarize(run, out["times"], tokens, out["peak_gib"], threads)
    if out["peak_flops"]:
        res.mfu = res.tps * out["flops_per_token"] / out["peak_flops"]
    return res


def publish(path: str, tag: str, table: str) -> None:
    print(table, flush=True)
    write_block(path, tag, table)
    print(f"written to the {tag} block of {path}")


def median_step_seconds(model, tokens, repeats: int) -> float:
    """Median seconds of a forward + backward of the summed next-token loss of `model` on
    `tokens` (bs, seq + 1), over `repeats` steps after one warm-up step."""
    import statistics
    import time

    from titanlab.components.loss import cross_entropy_sum

    def step() -> None:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
