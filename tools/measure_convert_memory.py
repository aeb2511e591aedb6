"""Measure the converter's peak RSS on a checkpoint of Llama 3.2 1B dims; record it in the docs.

    python tools/measure_convert_memory.py [--flavor 1B] [--workdir /tmp] [--no-write]

Writes a random fp32 DCP checkpoint of the flavor's shape from one process (every tensor one
whole chunk: the worst case for the reader), then runs `python -m tools.convert_checkpoint`
to-hf (bf16 and fp32) and from-hf (as stored, and fp32) as child processes and reads each one's
peak resident set size from `os.wait4`. The table and a description of the machine replace the
block between the markers in docs/checkpoint_conversion.md (unless --no-write). Not a test: it
needs about 25 GB of disk and a few minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from titanlab.observability.hostinfo import cpu_model, ram_gib

# This process only launches and measures: it imports no torch, so that its own memory (which a
# forked child's peak RSS includes until exec) stays small. The checkpoint is made in a child.
FLAVORS = ["debugmodel", "1B", "3B", "8B", "70B", "405B"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "checkpoint_conversion.md")
BEGIN, END = "<!-- measured:begin (tools/measure_convert_memory.py) -->", "<!-- measured:end -->"
VOCAB = 128256


def write_random_dcp(path: str, flavor: str) -> tuple[int, int]:
    """A random fp32 model-only DCP checkpoint of `flavor`, written tensor by tensor (run in a
    child process: `--make-dcp PATH`). Returns (total bytes, largest tensor bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from titanlab.checkpoint.convert import LazyModelPlanner, expected_shapes
    from titanlab.models.llama3 import llama3_flavors

    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=VOCAB)
    shapes = expected_shapes(args)

    def make(name: str) -> torch.Tensor:
        if args.tie_word_embeddings and name == "output.weight":
            name = "tok_embeddings.weight"
        g = torch.Generator().manual_seed(sorted(shapes).index(name))
        return torch.randn(shapes[name], generator=g) * 0.02

    placeholders = {k: torch.zeros(()).expand(s) for k, s in shapes.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": placeholders, "train_state": {"step": 0}},
            storage_writer=FileSystemWriter(path, single_file_per_rank=False),
            planner=LazyModelPlanner(make),
            no_dist=True,
        )
    sizes = [p.numel() * 4 for p in placeholders.values()]
    return sum(sizes), max(sizes)


def peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in GB, wall seconds) of a child process; fails if it fails."""
    begin = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited with {proc.returncode}")
    return usage.ru_maxrss * 1024 / 1e9, time.perf_counter() - begin  # ru_maxrss is in KiB


def versions() -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import platform, torch, safetensors; print("
            "f'Python {platform.python_version()}, torch {torch.__version__}, '"
            "f'safetensors {safetensors.__version__}')",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def machine() -> str:
    cpu, mem = cpu_model(), ram_gib()
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} "
        f"{platform.release()}; {versions()}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="1B", choices=FLAVORS)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: temp)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the doc alone")
    parser.add_argument("--make-dcp", default=None, help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.make_dcp:
        print(*write_random_dcp(args.make_dcp, args.flavor))
        return 0
    work = tempfile.mkdtemp(prefix="convert_mem_", dir=args.workdir)
    tool = [sys.executable, "-m", "tools.convert_checkpoint"]
    try:
        src = os.path.join(work, "dcp")
        made = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--flavor", args.flavor, "--make-dcp", src],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        total, largest = map(int, made.stdout.split())
        base, _ = peak_rss(
            [
                sys.executable,
                "-c",
                "import torch, safetensors, tqdm, "
                "torch.distributed.checkpoint, titanlab.checkpoint.convert",
            ]
        )
        rows = [("python + torch imported (baseline)", base, 0.0)]
        runs = [
            ("to-hf, fp32 DCP -> bf16", ["to-hf", src, "hf_bf16", "--flavor", args.flavor]),
            (
                "to-hf, fp32 DCP -> fp32",
                ["to-hf", src, "hf_fp32", "--flavor", args.flavor, "--dtype", "fp32"],
            ),
            ("from-hf, bf16 HF -> DCP (as stored)", ["from-hf", "hf_bf16", "dcp_bf16"]),
            ("from-hf, bf16 HF -> fp32 DCP", ["from-hf", "hf_bf16", "dcp_fp32", "--dtype", "fp32"]),
        ]
        for label, cli in runs:
            cli = [os.path.join(work, a) if a.startswith(("hf_", "dcp_")) else a for a in cli]
            rss, secs = peak_rss(tool + cli + ["--quiet"])
            rows.append((label, rss, secs))
            print(f"{label}: peak RSS {rss:.2f} GB in {secs:.0f}s", flush=True)
            if label.startswith("to-hf, fp32 DCP -> fp32"):
                shutil.rmtree(cli[2], ignore_errors=True)  # keep the disk use down
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = "\n".join(
        [
            f"Flavor `{args.flavor}` (vocab {VOCAB}), random weights: {total / 1e9:.2f} GB of fp32 "
            f"tensors in the DCP checkpoint, the largest (the embedding) {largest / 1e9:.2f} GB.",
            f"Machine: {machine()}. The measuring process itself peaked at "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB (a forked child's "
            "figure can include it).",
            "",
            "| run | peak RSS | wall time |",
            "|---|---|---|",
        ]
        + [
            f"| {label} | {rss:.2f} GB | {secs:.0f} s |"
            if secs
            else f"| {label} | {rss:.2f} GB | |"
            for label, rss, secs in rows
        ]
    )
    print(table)
    if not args.no_write:
        with open(DOC, encoding="utf-8") as f:
            text = f.read()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"error: {DOC} lacks the markers {BEGIN!r} ... {END!r}")
        head, rest = text.split(BEGIN, 1)
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
