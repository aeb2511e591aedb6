"""Speed and memory of the real trainer against a plain PyTorch loop of the same model and batch.

    python tools/benchmark.py [--matrix full|quick|overhead|zero|tp|muon|none] [--steps 20] [--warmup 5] [--decode]
                              [--repeats 1] [--threads 1] [--out docs/performance.md]
                              [--gpu-8b [--gpu-layers 4]]

Trainer rows: `torch.distributed.run -m titanlab.train`, debug model, seq 256, global batch 16
split over the ranks, no checkpoint or validation, log_freq 1; eager/compile × AC
none/selective/full × 1/2 ranks (FSDP) × fp32/bf16 (quick: eager, none, fp32; overhead: the
1-rank AC-none rows beside their baselines, fp32/bf16 × eager/compiled, each baseline also
with the trainer's fixed glibc malloc thresholds). Baseline rows: one process running
titanlab's `Transformer` in a plain loop (fused AdamW, `F.cross_entropy`, `clip_grad_norm_`,
batches by numpy memmap from the same shards) per precision and compile; "vs baseline" is
against the plain loop as a user runs it (glibc's own thresholds).

Columns: step time = median seconds per step after the warm-up; tps = median tokens/s of one
rank; memory = peak of the run (CUDA max reserved, else peak RSS of rank 0's process);
vs baseline = tps per intra-op thread ÷ the baseline's (on CUDA: tps ÷ tps). One rank and the
baseline use `--threads` threads, each of 2 ranks one. Step times are exact: with log_freq 1
the trainer's tps of step k is tokens_per_step ÷ (time from logging step k-1 to logging step
k), so step time = local batch × seq_len ÷ tps.

`--matrix zero`: the ZeRO stage table (tools/lib/zero_bench.py): stages 0-3 and ZeRO-Offload on
2 data-parallel ranks, each with the memory per rank the pre-flight estimate predicts and the
CPU memory timeline measures, the bytes each rank communicates per step (checked against the
closed forms), and the step time; `--repeats` runs per row (default here 5). Written to the
`cpu-zero` block of `--out`.

`--matrix tp`: the tensor-parallel mode table (tools/lib/tp_mode_bench.py): 1D, 2D, 2.5D and 3D
at degrees 4 and 8, one block's communication per collective kind measured on gloo ranks beside
each mode's closed form, and the loss and gradients against one process. Written to the
`cpu-tp-modes` block of `--out` (default here docs/parallelism.md).

`--matrix muon`: Muon against AdamW per layout (tools/lib/muon_bench.py): 1 rank, FSDP 2,
ZeRO-1 2, DDP 2 and TP 2, each optimizer's median step and optimizer time and the ranks'
Newton–Schulz balance (slowest ÷ mean). Written to the `cpu-muon` block of `--out`.

`--repeats N` runs the whole matrix N times, interleaved (A B A B ...), so slow drifts of a
shared machine hit every row alike; a row then reports the median over repeats and, in
brackets, the range of the per-repeat medians.

`--gpu-8b` (CUDA): the plain loop at the 8B flavor's dims with `--gpu-layers` blocks (vocab
128256, seq 8192, batch 1, random tokens) in bf16 (eager, compiled) and float8 (torchao
tensorwise, compiled), with MFU = tps × FLOPs/token (`get_nparams_and_flops`) ÷ the dense bf16
peak (`device_peak_flops`). Tables replace the `<!-- benchmark:TAG:begin/end -->` blocks of
`--out` (TAG cpu or cuda, with `-overhead` for that matrix, and cuda-8b), keeping the rest of
the file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from titanlab.models.registry import DEFAULT_FAMILY, FAMILIES
from tools.lib.bench import (  # noqa: F401 (the names tests and readers find here)
    CONFIG,
    GLOBAL_BS,
    HEADER,
    SEQ,
    Result,
    Run,
    add_ratios,
    child,
    combine,
    machine,
    publish,
    render_table,
    replace_block,
    run_plain,
    run_trainer,
    step_times,
    summarize,
    write_block,
)

# This process imports no torch: a child's peak RSS can include its parent's (fork + exec), so
# the probe and the baseline loop run in children (`--child`).


def matrix(kind: str) -> list[Run]:
    """The runs of `kind` (full, quick or none), trainer rows first; else a ValueError."""
    if kind == "overhead":  # each trainer row beside its baseline, so repeats interleave pairs
        return [
            run
            for p in ("fp32", "bf16")
            for c in (False, True)
            for run in (Run(c, "none", 1, p), Run(c, "none", 0, p), Run(c, "none", 0, p, True))
        ]
    if kind in ("quick", "none"):
        return {"quick": [Run(ranks=1), Run(ranks=2), Run(ranks=0)], "none": []}[kind]
    if kind != "full":
        raise ValueError(f"matrix={kind!r} is invalid; use 'full', 'quick', 'overhead' or 'none'")
    runs = [
        Run(c, ac, r, p)
        for p in ("fp32", "bf16")
        for c in (False, True)
        for ac in ("none", "selective", "full")
        for r in (1, 2)
    ]
    return runs + [Run(c, "none", 0, p) for p in ("fp32", "bf16") for c in (False, True)]


def zero_table(out: str, about: str, repeats: int) -> int:
    """Measure and publish the ZeRO stage table (`tools/lib/zero_bench.py`)."""
    import tempfile

    from tools.lib import comm_measure, zero_bench

    work = tempfile.mkdtemp(prefix="titanlab_zero_")
    dataset = comm_measure.make_dataset(os.path.join(work, "data"))
    rows = []
    for stage, offload in zero_bench.STAGES:
        print(f"running ZeRO-{stage}{' + offload' if offload else ''} ...", flush=True)
        rows.append(zero_bench.run_row(stage, offload, dataset, work, repeats))
    publish(out, "cpu-zero", f"{about}\n\n{zero_bench.DESCRIPTION}\n\n{zero_bench.render(rows)}")
    return 0 if all(r.comm_as_predicted for r in rows) else 1


def tp_table(out: str, about: str) -> int:
    """Measure and publish the tensor-parallel mode table (`tools/lib/tp_mode_bench.py`)."""
    from tools.lib import tp_mode_bench

    results = {}
    for mode in tp_mode_bench.MODES:
        print(f"running {mode.name} ...", flush=True)
        results[mode] = tp_mode_bench.measure(mode)
    text = tp_mode_bench.table(results)
    publish(out, "cpu-tp-modes", f"{about}\n\n{tp_mode_bench.DESCRIPTION}\n\n{text}")
    return 0 if tp_mode_bench.all_as_predicted(results) else 1


def muon_table(out: str, about: str, repeats: int, steps: int, warmup: int, data_dir: str) -> int:
    """Measure and publish Muon against AdamW per layout (`tools/lib/muon_bench.py`)."""
    from tools.lib import muon_bench

    runs: dict[tuple[str, str], list] = {}
    for k in range(repeats):
        for layout in muon_bench.LAYOUTS:
            for optimizer in muon_bench.OPTIMIZERS:
                print(f"running {layout} · {optimizer} ({k + 1}/{repeats}) ...", flush=True)
                got = muon_bench.run(layout, optimizer, steps, warmup, data_dir)
                runs.setdefault((layout, optimizer), []).append(got)
    results = {key: muon_bench.merge(rs) for key, rs in runs.items()}
    publish(out, "cpu-muon", f"{about}\n\n{muon_bench.__doc__.split(chr(10) * 2, 1)[1]}\n"
            f"{muon_bench.render(results)}")  # fmt: skip
    return 0 if not any(r.error for r in results.values()) else 1


def plain_loop(spec: dict) -> dict:
    """The baseline (child process): titanlab's `Transformer`, then plain PyTorch only.

    spec: model (family), flavor, layers (None: the flavor's), vocab, seq, batch, precision, compile, steps,
    warmup, threads, data_dir (None: random tokens), device. Returns per-step seconds, peak GiB
    (CUDA max reserved, else peak RSS), training FLOPs/token and the device's peak FLOP/s."""
    import numpy as np
    import torch

    from titanlab.metrics import device_peak_flops
    from tools.lib import plain_loop as plain

    torch.set_num_threads(spec["threads"])
    if spec.get("fixed_malloc"):
        from titanlab.trainer.host_allocator import fix_malloc_thresholds

        fix_malloc_thresholds()
    device = torch.device(spec["device"])
    loop = plain.build(spec, device)
    flops, vocab = loop.flops_per_token, spec["vocab"]
    bs, seq = spec["batch"], spec["seq"]
    if spec["data_dir"]:
        with open(os.path.join(spec["data_dir"], "metadata.json"), encoding="utf-8") as f:
            meta = json.load(f)
        shard = max(meta["shards"], key=lambda s: s["tokens"])["file"]
        tokens = np.memmap(os.path.join(spec["data_dir"], shard), dtype=meta["dtype"], mode="r")
        windows = (len(tokens) - 1) // seq

    def batch(k: int) -> torch.Tensor:  # (bs, seq + 1) int64
        if not spec["data_dir"]:
            return torch.randint(vocab, (bs, seq + 1), device=device)
        rows = [tokens[w * seq : w * seq + seq + 1] for w in (k * bs + np.arange(bs)) % windows]
        return torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)

    times = []
    for k in range(spec["warmup"] + spec["steps"]):
        begin = time.perf_counter()
        loop.step(batch(k)).item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    peak = (
        torch.cuda.max_memory_reserved()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) / 2**30
    return {
        "times": times[spec["warmup"] :],
        "peak_gib": peak,
        "flops_per_token": flops,
        "peak_flops": device_peak_flops(device),
    }


def probe() -> dict:
    """(child) torch version, GPU count and name, the prepared default corpus and its vocab."""
    import torch

    from titanlab.data.default_corpus import default_cache_dir, ensure_default_corpus
    from titanlab.data.tokenizer import Tokenizer, default_tokenizer_path

    n = torch.cuda.device_count()
    path = default_tokenizer_path()
    return {
        "torch": torch.__version__,
        "gpus": n,
        "gpu": torch.cuda.get_device_name() if n else "",
        "data_dir": ensure_default_corpus(default_cache_dir(), path),
        "vocab": Tokenizer(path).vocab_size,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="steps run first and not measured")
    p.add_argument(
        "--matrix",
        default="full",
        choices=["full", "quick", "overhead", "zero", "tp", "muon", "none"],
        help="quick: eager, AC none, fp32, 1 and 2 ranks; overhead: 1 rank vs the "
        "baseline in fp32/bf16, eager/compiled; zero: the ZeRO stage table; tp: the tensor "
        "parallel mode table; muon: Muon against AdamW per layout; none: only --gpu-8b",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="run the matrix this many times, interleaved (default 1; 3 for --matrix zero)",
    )
    p.add_argument("--threads", type=int, default=1, help="intra-op threads: 1 rank and baseline")
    p.add_argument(
        "--out",
        default=None,
        help="Markdown file whose benchmark block(s) are replaced (default docs/performance.md; "
        "docs/parallelism.md for --matrix tp)",
    )
    p.add_argument("--gpu-8b", action="store_true", help="CUDA: 8B-dims rows with MFU")
    p.add_argument("--gpu-layers", type=int, default=4, help="blocks of the 8B-shaped model")
    p.add_argument(
        "--model",
        default=DEFAULT_FAMILY,
        choices=list(FAMILIES),
        help=f"model family of the debugmodel runs (default: {DEFAULT_FAMILY})",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help="also the decode rows (generation tokens/s, batch 1 and 8, eager and compiled; "
        "tools/benchmark_decode.py) into the decode block of --out",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.repeats is None:
        a.repeats = 5 if a.matrix == "zero" else 1
    if a.out is None:
        doc = "parallelism.md" if a.matrix == "tp" else "performance.md"
        a.out = os.path.join(REPO, "docs", doc)
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(probe() if spec["kind"] == "probe" else plain_loop(spec)))
        return 0
    if a.steps < 1 or a.warmup < 0 or a.threads < 1 or a.repeats < 1:
        raise SystemExit(
            f"error: --steps {a.steps} / --warmup {a.warmup} / --threads {a.threads} "
            f"/ --repeats {a.repeats} need steps >= 1, warmup >= 0, threads >= 1, "
            "repeats >= 1"
        )
    info = child({"kind": "probe"}, 1)
    if "error" in info:
        raise SystemExit(f"error: probe failed: {info['error']}")
    command = shlex.join(
        ["python", "tools/benchmark.py", *(sys.argv[1:] if argv is None else argv)]
    )
    about = machine(info, a.threads, command)
    if a.matrix == "zero":
        return zero_table(a.out, about, a.repeats)
    if a.matrix == "tp":
        return tp_table(a.out, about)
    if a.matrix == "muon":
        return muon_table(a.out, about, a.repeats, a.steps, a.warmup, info["data_dir"])
    loop = {
        "model": a.model,
        "flavor": "debugmodel",
        "layers": None,
        "vocab": info["vocab"],
        "seq": SEQ,
        "batch": GLOBAL_BS,
        "steps": a.steps,
        "warmup": a.warmup,
        "data_dir": info["data_dir"],
        "device": "cuda" if info["gpus"] else "cpu",
    }
    runs = [r for r in matrix(a.matrix) if not (info["gpus"] and r.ranks > info["gpus"])]
    repeated: dict[Run, list[Result]] = {run: [] for run in runs}
    for k in range(a.repeats):
        for run in runs:
            print(f"running {run.name} ({k + 1}/{a.repeats}) ...", flush=True)
            repeated[run].append(
                run_plain(run, loop, a.threads)
                if run.ranks == 0
                else run_trainer(run, a.steps, a.warmup, a.threads, info["data_dir"], a.model)
            )
    results = [combine(rs) for rs in repeated.values()]
    if results:
        add_ratios(results, per_thread=not info["gpus"])
        tag = ("cuda" if info["gpus"] else "cpu") + ("-overhead" if a.matrix == "overhead" else "")
        publish(a.out, tag, f"{about}\n\n{render_table(results)}")
    if a.gpu_8b and not info["gpus"]:
        print("--gpu-8b: skipped, no CUDA device")
    elif a.gpu_8b:
        spec = dict(
            loop, flavor="8B", layers=a.gpu_layers, vocab=128256, seq=8192, batch=1, data_dir=None
        )
        rows = [
            run_plain(r, spec, 1)
            for r in (
                Run(False, ranks=0, precision="bf16"),
                Run(True, ranks=0, precision="bf16"),
                Run(True, ranks=0, precision="float8"),
            )
        ]
        publish(
            a.out,
            "cuda-8b",
            f"{about}\n\nThe plain loop with titanlab's model at 8B dims "
            f"but {a.gpu_layers} layers (vocab 128256, seq 8192, batch 1, random tokens); MFU "
            f"against the device's dense bf16 peak.\n\n{render_table(rows, mfu=True)}",
        )
    if a.decode:
        print("running the decode rows ...", flush=True)
        decode = [
            sys.executable,
            os.path.join(REPO, "tools", "benchmark_decode.py"),
            "--out",
            a.out,
        ]
        if subprocess.run(decode, cwd=REPO).returncode != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
