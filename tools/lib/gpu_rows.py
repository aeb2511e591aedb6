"""What the GPU benchmark scripts share (`tools/gpu_check.py`, `tools/gpu_bench_row.py`,
`tools/benchmark_torchtitan.py`, `tools/torchtitan_row.py`): a one-process job's environment,
a row's JSON, and how many Llama 3 8B blocks fit one GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

from tools.lib.runs import REPO


def single_rank_env() -> None:
    """The variables torchrun would set for a one-process job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)


def write_row(path: str, measure) -> int:
    """Write `measure()`'s JSON to `path`, or {"error": ...} on a CUDA out-of-memory error;
    the exit code (0: measured)."""
    import torch

    try:
        result = measure()
    except torch.OutOfMemoryError as e:
        result = {"error": "CUDA out of memory: " + str(e).split("\n")[0][:300]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0 if "error" not in result else 1


def bench_row(
    trainer_argv: list[str],
    out_dir: str,
    warmup: int,
    bench_args: list[str] = (),
    timeout_s: int = 300,
) -> dict:
    """`tools/gpu_bench_row.py` on `trainer_argv` in a child process (its GPU memory freed
    after), profiling the step after `warmup`: its JSON, or {"error": ...} with the child's
    last lines; `wall_s` added. `bench_args`: more of gpu_bench_row's options (a trace)."""
    import subprocess
    import sys
    import time

    out = os.path.join(out_dir, "row.json")
    cmd = [sys.executable, os.path.join(REPO, "tools", "gpu_bench_row.py"), "--out", out,
           "--warmup", str(warmup), "--profile-step", str(warmup + 1), *bench_args, "--",
           *trainer_argv]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    result: dict = {}
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    if proc.returncode != 0 and "error" not in result:
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        result = {"error": f"exit {proc.returncode}: " + " | ".join(lines[-3:])[-400:]}
        print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", flush=True)
    result["wall_s"] = round(time.time() - start, 1)
    return result


def fit_layers(memory: int, fraction: float = 0.85) -> int:
    """Most blocks whose estimated peak (bf16, AC none, 1 GPU) is under `fraction` of `memory`."""
    import torch

    from titanlab.config.manager import build_config
    from titanlab.planning.memory import estimate_memory
    from titanlab.models.llama3 import llama3_flavors

    config = build_config(["--job.config_file", os.path.join(REPO, "train_configs/llama_8b.toml")])
    config.activation_checkpoint.mode = "none"

    def total(n: int) -> int:
        args = dataclasses.replace(
            llama3_flavors["8B"], n_layers=n, vocab_size=128256, max_seq_len=8192
        )
        return estimate_memory(args, config, 1, torch.bfloat16).total

    base, per_layer = total(1), total(2) - total(1)
    return max(1, min(32, 1 + int((fraction * memory - base) // per_layer)))
