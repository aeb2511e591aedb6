"""DiLoCo against plain HSDP on `make train`'s job: validation loss, and tokens and seconds to the
same validation loss.

    python tools/benchmark_diloco.py [--diloco H:OUTER_LR:OUTER_MOMENTUM ...] [--steps 150]
        [--diloco-steps 300] [--out docs/performance.md]

Trains `make train`'s job (the debug model, `train_configs/debug_model.toml`, the default corpus)
on 2 CPU ranks as plain HSDP (dp_replicate 2, one rank each: the gradients all-reduced every
step), then as 2 replica groups of 1 rank on torchft (`titanlab train` with the lighthouse)
training with DiLoCo, once per `--diloco` setting: syncing every H steps, the outer Nesterov
SGD at that learning rate and momentum (AdamW inside each group). Fault-tolerant HSDP itself trains exactly like
HSDP (tests/integration/test_fault_tolerance.py). The validation loss of the groups is the
job's: every group's share of the held-out split, summed over the groups (between two syncs,
each group on its own weights), so `--val-freq` should be a multiple of each H. The target is HSDP's final validation loss; the table gives each run's
final validation loss, the tokens and training seconds (the logged step times, validation
excluded) to its first validation at or below the target, and how often the groups exchange
weights or gradients. The DiLoCo runs train `--diloco-steps` steps (their learning-rate schedule
stretched over them), so that a run slower per token than HSDP can still reach HSDP's target and
the table gives how many more tokens it takes. Block `diloco` of `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import cpu_model, write_block
from tools.lib.quality_curves import Curve, read_curve, to_target
from tools.lib.runs import DEBUG_CONFIG, launch

GROUPS = 2


def replica_groups(args: list[str], dump: str, extra: list[str]) -> Curve | str:
    """`titanlab train` with GROUPS replica groups of 1 rank; group 0's curve, or the error."""
    env = dict(os.environ, NGPU="1", OMP_NUM_THREADS="1")
    env.pop("TORCHFT_LIGHTHOUSE", None)
    cmd = [sys.executable, "-m", "titanlab.cli", "train", *args, "--job.dump_folder", dump,
           "--fault_tolerance.enable", "true", "--fault_tolerance.replica_count", str(GROUPS),
           "--fault_tolerance.min_replicas", str(GROUPS), *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode:
        return f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return read_curve(os.path.join(dump, "replica_0"), "", 0.0, groups=GROUPS)


def table(runs: list[tuple[str, str, Curve]], command: str, steps: tuple[int, int]) -> str:
    target = runs[0][2].final
    lines = [
        f"Machine: {cpu_model()}, {os.cpu_count()} cores. Command: `{command}`. Target: plain "
        f"HSDP's final validation loss, {target:.4f}. {GROUPS} data-parallel ranks in every run; "
        f"plain HSDP trains {steps[0]} steps, each DiLoCo run {steps[1]} (its schedule over them).",
        "",
        "| run | exchanges between replicas | final val loss | tokens to target "
        "| seconds to target | median step (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, exchanges, c in runs:
        r = to_target(c, target)
        tokens, secs = (f"{r[0]:,}", f"{r[1]:.0f}") if r else ("not reached", "not reached")
        lines.append(f"| {name} | {exchanges} | {c.final:.4f} | {tokens} | {secs} "
                     f"| {statistics.median(c.step_ms):.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--diloco", nargs="+",
                   default=["5:1.0:0.0", "30:1.0:0.0", "5:0.7:0.5"],
                   help="H:OUTER_LR:OUTER_MOMENTUM of each DiLoCo run")  # fmt: skip
    p.add_argument("--steps", type=int, default=150, help="plain HSDP's steps")
    p.add_argument("--diloco-steps", type=int, default=300, help="each DiLoCo run's steps")
    p.add_argument("--val-freq", type=int, default=30)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    a = p.parse_args(argv)
    command = " ".join(
        ["python tools/benchmark_diloco.py", *(sys.argv[1:] if argv is None else argv)]
    )
    base = ["--job.config_file", DEBUG_CONFIG, "--checkpoint.enable", "false",
            "--validation.freq", str(a.val_freq),
            "--metrics.log_freq", str(a.val_freq), "--metrics.save_plot", "false",
            "--parallelism.data_parallel_shard_degree", "1"]  # fmt: skip
    runs: list[tuple[str, str, Curve]] = []
    with tempfile.TemporaryDirectory(prefix="titanlab_diloco_") as work:
        dump = os.path.join(work, "hsdp")
        hsdp = [*base, "--training.steps", str(a.steps), "--job.dump_folder", dump,
                "--parallelism.data_parallel_replicate_degree", str(GROUPS)]  # fmt: skip
        proc = launch(GROUPS, hsdp, timeout=7200, torchrun=True)
        if proc.returncode:
            print(f"HSDP: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        runs.append(("plain HSDP", "gradients, every step", read_curve(dump, "", 0.0)))
        variants = []
        for setting in a.diloco:
            h, lr, momentum = setting.split(":")
            variants.append((f"DiLoCo H = {h}, outer lr {lr}, momentum {momentum}",
                             f"pseudo-gradients, every {h} steps",
                             ["--fault_tolerance.semi_sync_method", "diloco",
                              "--fault_tolerance.sync_steps", h, "--fault_tolerance.outer_lr", lr,
                              "--fault_tolerance.outer_momentum", momentum]))  # fmt: skip
        longer = [*base, "--training.steps", str(a.diloco_steps)]
        for i, (name, exchanges, extra) in enumerate(variants):
            got = replica_groups(longer, os.path.join(work, f"groups_{i}"), extra)
            if isinstance(got, str):
                print(f"{name}: {got}", file=sys.stderr)
                return 1
            runs.append((name, exchanges, got))
            print(f"{name}: final val loss {got.final:.4f}", flush=True)
    text = table(runs, command, (a.steps, a.diloco_steps))
    print(text)
    write_block(a.out, "diloco", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
