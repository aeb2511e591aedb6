"""Per-rank activation memory of context parallel on CPU against the estimator; into the docs.

    python tools/measure_cp_memory.py [--seq 8192] [--short-seq 256] [--cps 1,2,4]
        [--rotates allgather,alltoall] [--document-mask] [--ulysses] [--no-write]

`--document-mask` trains with data.document_mask and restarted positions (titanlab's CP
attention, the `work` balancer) and writes the `cp-memory-documents` block instead; `--ulysses`
adds a Ulysses row per cp.

For each CP degree (and each rotate method when cp > 1) the debug model trains 2 steps under torchrun (cp ranks, dp_shard 1, local
batch 1, fp32, no AC, no checkpoint) at `--seq` and at `--short-seq` tokens, with
`profiling.enable_memory_snapshot` on: step 2 runs under torch.profiler's memory profiler and
rank 0 writes the peak bytes of the tensors step 2 allocated (`memory_snapshot/rank0_step2_peak.json`). The activation
memory of the long sequence is the difference of the two peaks: parameters, gradients and
optimizer state are the same in both runs and cancel. (Peak RSS would add the allocator's
slack, which the estimator does not model.) The
estimate is the same difference of `estimate_memory(...).peak_tensors`. The table (with the
ratio to one process) replaces the `cp-memory` block of docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from titanlab.observability.hostinfo import cpu_model, ram_gib

DOC = os.path.join(REPO, "docs", "parallelism.md")
MIB = 2**20


EXTRA: list[str] = []  # options every run takes (--document-mask's)


def overrides(seq: int, cp: int, dump: str, rotate: str = "allgather") -> list[str]:
    mode = ["--parallelism.context_parallel_mode", "ulysses"] if rotate == "ulysses" else []
    rotate = "allgather" if rotate == "ulysses" else rotate
    return (
        EXTRA
        + mode
        + [
            "--job.config_file",
            os.path.join(REPO, "train_configs", "debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--training.seq_len",
            str(seq),
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "2",
            "--parallelism.context_parallel_degree",
            str(cp),
            "--parallelism.context_parallel_rotate_method",
            rotate,
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--checkpoint.enable",
            "false",
            "--validation.enable",
            "false",
            "--metrics.log_freq",
            "1",
            "--profiling.enable_memory_snapshot",
            "true",
            "--profiling.profile_freq",
            "2",
            "--profiling.profiler_warmup",
            "0",
            "--comm.init_timeout_seconds",
            "300",
            "--comm.train_timeout_seconds",
            "300",
        ]
    )


def peak_mib(seq: int, cp: int, rotate: str, tmp: str) -> float:
    """Rank 0's peak MiB of the tensors step 2 allocated, `cp` ranks at `seq` tokens."""
    dump = os.path.join(tmp, f"cp{cp}_{rotate}_seq{seq}")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cp}",
        "-m",
        "titanlab.train",
        *overrides(seq, cp, dump, rotate),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"cp {cp} seq {seq} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(
        os.path.join(dump, "memory_snapshot", "rank0_step2_peak.json"), encoding="utf-8"
    ) as f:
        return json.load(f)["window_peak_bytes"] / MIB


def estimated_mib(seq: int, cp: int) -> float:
    import torch

    from titanlab.components import builders as components
    from titanlab.config.manager import build_config
    from titanlab.planning.memory import estimate_memory

    config = build_config(overrides(seq, cp, "/tmp/unused"))
    tokenizer = components.build_tokenizer(config)
    args = components.build_model_args(config, tokenizer.vocab_size)
    return estimate_memory(args, config, cp, torch.float32).peak_tensors / MIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--short-seq", type=int, default=256)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--rotates", default="allgather,alltoall")
    p.add_argument("--document-mask", action="store_true")
    p.add_argument("--ulysses", action="store_true")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    if a.document_mask:
        EXTRA.extend(["--data.document_mask", "true", "--data.reset_positions", "true"])
    if a.ulysses:
        a.rotates += ",ulysses"
    runs = [
        (cp, rotate)
        for cp in (int(c) for c in a.cps.split(","))
        for rotate in (a.rotates.split(",") if cp > 1 else ["allgather"])
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp, rotate in runs:
            measured = peak_mib(a.seq, cp, rotate, tmp) - peak_mib(a.short_seq, cp, rotate, tmp)
            predicted = estimated_mib(a.seq, cp) - estimated_mib(a.short_seq, cp)
            rows.append((cp, rotate, measured, predicted))
            print(
                f"cp {cp} {rotate}: measured {measured:.0f} MiB, estimated {predicted:.0f} MiB",
                flush=True,
            )
    one = next((m for cp, _, m, _ in rows if cp == 1), None)
    lines = [
        f"Measured with `python tools/measure_cp_memory.py` on {cpu_model()}, {os.cpu_count()} "
        f"cores, {ram_gib():.0f} GiB RAM; Python {platform.python_version()}; "
        f"{datetime.date.today()}. Debug model, seq_len {a.seq}, local batch 1, fp32, AC none"
        f"{', document mask (restarted positions)' if a.document_mask else ''}; "
        f"activation memory = rank 0's peak bytes of the tensors allocated in step 2 "
        f"(torch.profiler's memory timeline) at seq_len {a.seq} minus at {a.short_seq}.",
        "",
        "| CP | rotate method | measured activation MiB per rank | vs 1 process | estimated MiB "
        "| estimate error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for cp, rotate, measured, predicted in rows:
        ratio = f"{measured / one:.2f}×" if one else "n/a"
        err = 100 * (predicted / measured - 1)
        method = rotate if cp > 1 else "—"
        lines.append(
            f"| {cp} | {method} | {measured:.0f} | {ratio} | {predicted:.0f} | {err:+.1f}% |"
        )
    table = "\n".join(lines)
    print(table)
    if not a.no_write:
        from tools.lib.bench import write_block

        write_block(DOC, "cp-memory-documents" if a.document_mask else "cp-memory", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
