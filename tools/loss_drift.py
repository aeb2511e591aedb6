"""How far `make train`'s losses move when only the order of fp32 sums changes.

    python tools/loss_drift.py [--steps 150] [--out docs/performance.md]

Trains `make train`'s job (the debug model, `train_configs/debug_model.toml`, 2 CPU ranks) three
ways, logging the loss every step (no checkpoint, no validation): with the fused loss (the
default), with the plain loss (`--loss.fused_linear_cross_entropy false`), and with the plain
loss on 1 process with the 2 ranks' samples in one local batch (the same global batch: a layout
change, which reorders every gradient's sum). For each against the plain 2-rank run it prints
the largest |Δloss| up to step 20, the first step above 1e-5, the largest over the run and the
difference at the last step, and writes the table to block `loss-drift` of `--out`.

fp32 training amplifies a difference in the last bit of a gradient step by step (AdamW divides
each gradient by its own running magnitude, so a rounding difference in a near-zero gradient
moves its weight by up to the learning rate), so the same model trained with sums taken in
another order leaves the first runs' losses after a few dozen steps, whatever the reordering.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import cpu_model, write_block
from tools.lib.runs import DEBUG_CONFIG, launch, read_losses

VARIANTS = {
    "fused loss, 2 ranks (the default)": (2, []),
    "plain loss, 2 ranks": (2, ["--loss.fused_linear_cross_entropy", "false"]),
    "plain loss, 1 process, local batch 32": (
        1,
        ["--loss.fused_linear_cross_entropy", "false", "--training.local_batch_size", "32"],
    ),
}
REFERENCE = "plain loss, 2 ranks"


def drift(run: dict[int, float], ref: dict[int, float]) -> dict[str, object]:
    """Largest |Δ| through step 20, first step above 1e-5, largest (and its step), last."""
    steps = sorted(set(run) & set(ref))
    diffs = {s: abs(run[s] - ref[s]) for s in steps}
    worst = max(steps, key=diffs.__getitem__)
    return {
        "early": max(diffs[s] for s in steps if s <= 20),
        "first": next((s for s in steps if diffs[s] > 1e-5), None),
        "max": diffs[worst],
        "max_step": worst,
        "last": diffs[steps[-1]],
        "last_loss": run[steps[-1]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    a = p.parse_args(argv)
    base = ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(a.steps),
            "--checkpoint.enable", "false", "--validation.enable", "false",
            "--metrics.log_freq", "1", "--metrics.save_plot", "false"]  # fmt: skip
    losses = {}
    with tempfile.TemporaryDirectory(prefix="titanlab_loss_drift_") as work:
        for i, (name, (nproc, extra)) in enumerate(VARIANTS.items()):
            dump = os.path.join(work, str(i))
            proc = launch(nproc, [*base, "--job.dump_folder", dump, *extra], timeout=3600,
                          torchrun=True)  # fmt: skip
            if proc.returncode:
                print(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            losses[name] = read_losses(dump)
            print(f"{name}: done", flush=True)
    ref = losses[REFERENCE]
    lines = [
        f"Machine: {cpu_model()}, {os.cpu_count()} cores; `make train`'s job, {a.steps} steps, "
        "the loss logged every step.",
        "Command: `python tools/loss_drift.py`",
        "",
        f"| run, against the {REFERENCE} | max abs(Δloss), steps 1-20 | first step above 1e-5 "
        f"| max abs(Δloss) (step) | abs(Δloss) at step {a.steps} | loss at step {a.steps} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, run in losses.items():
        if name == REFERENCE:
            lines.append(f"| {name} (reference) | | | | | {run[max(run)]:.6f} |")
            continue
        d = drift(run, ref)
        lines.append(f"| {name} | {d['early']:.1e} | {d['first']} | {d['max']:.1e} "
                     f"({d['max_step']}) | {d['last']:.1e} | {d['last_loss']:.6f} |")  # fmt: skip
    body = "\n".join(lines)
    print(body)
    write_block(a.out, "loss-drift", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
