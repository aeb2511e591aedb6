"""Time to quality: AdamW against Muon on `make train`'s job, each at its best learning rate.

    python tools/benchmark_quality.py [--lrs 2e-3 4e-3 8e-3] [--steps 150] [--out docs/performance.md]

Trains `make train`'s job (the debug model, `train_configs/debug_model.toml`, 2 CPU ranks, the
default corpus) with AdamW and with Muon (`optimizer.name = "Muon"`, bfloat16 Newton–Schulz as
torch and Moonlight run it) at each learning rate of `--lrs`, validating every `--val-freq`
steps. Each optimizer's best rate is the one with the lowest final validation loss; the
target is AdamW's best final validation loss. For both best runs the table gives the tokens and
the training seconds (the sum of the logged step times, validation excluded) to the first
validation at or below the target, their ratios (Muon ÷ AdamW) and the median step-time ratio;
every run of the sweep is listed. A quality claim is time and tokens to the same validation
loss, not the loss at a fixed step. Block `quality` of `--out`, the plot (validation loss against
tokens and against seconds) beside it as docs/quality.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.lib.bench import cpu_model, write_block
from tools.lib.quality_curves import Curve, read_curve, to_target
from tools.lib.runs import DEBUG_CONFIG, launch

OPTIMIZERS = ("AdamW", "Muon")


def best(curves: list[Curve], optimizer: str) -> Curve:
    """The run of `optimizer` with the lowest final validation loss."""
    return min((c for c in curves if c.optimizer == optimizer), key=lambda c: c.final)


def table(curves: list[Curve], command: str) -> str:
    adamw, muon = best(curves, "AdamW"), best(curves, "Muon")
    target = adamw.final
    reach = {c.optimizer: to_target(c, target) for c in (adamw, muon)}
    lines = [
        f"Machine: {cpu_model()}, {os.cpu_count()} cores. Command: `{command}`. Target: AdamW's "
        f"best final validation loss, {target:.4f}.",
        "",
        "| optimizer | best lr | final val loss | tokens to target | seconds to target "
        "| median step (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in (adamw, muon):
        r = reach[c.optimizer]
        tokens, secs = (f"{r[0]:,}", f"{r[1]:.0f}") if r else ("not reached", "not reached")
        lines.append(
            f"| {c.optimizer} | {c.lr:g} | {c.final:.4f} | {tokens} | {secs} "
            f"| {statistics.median(c.step_ms):.0f} |"
        )
    ra, rm = reach["AdamW"], reach["Muon"]
    step_ratio = statistics.median(muon.step_ms) / statistics.median(adamw.step_ms)
    if ra and rm:
        lines += ["", f"Muon ÷ AdamW: tokens {rm[0] / ra[0]:.2f}×, seconds {rm[1] / ra[1]:.2f}×, "
                  f"step time {step_ratio:.2f}×."]  # fmt: skip
    else:
        lines += ["", f"Muon did not reach the target; step time {step_ratio:.2f}×."]
    lines += ["", "The sweep (final validation loss):", "",
              "| optimizer | lr | final val loss |", "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {c.optimizer} | {c.lr:g} | {c.final:.4f} |" for c in curves]
    return "\n".join(lines)


def plot(curves: list[Curve], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_seconds) = plt.subplots(1, 2, figsize=(11, 4))
    for c in (best(curves, name) for name in OPTIMIZERS):
        steps = sorted(c.val)
        label = f"{c.optimizer} lr {c.lr:g}"
        by_tokens.plot([s * c.tokens_per_step for s in steps], [c.val[s] for s in steps],
                       marker="o", label=label)  # fmt: skip
        by_seconds.plot([c.seconds[s] for s in steps], [c.val[s] for s in steps], marker="o",
                        label=label)  # fmt: skip
    by_tokens.set_xlabel("tokens")
    by_seconds.set_xlabel("training seconds")
    for ax in (by_tokens, by_seconds):
        ax.set_ylabel("validation loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--val-freq", type=int, default=15)
    p.add_argument("--out", default=os.path.join(REPO, "docs", "performance.md"))
    a = p.parse_args(argv)
    command = " ".join(
        ["python tools/benchmark_quality.py", *(sys.argv[1:] if argv is None else argv)]
    )
    base = ["--job.config_file", DEBUG_CONFIG, "--training.steps", str(a.steps),
            "--checkpoint.enable", "false", "--validation.freq", str(a.val_freq),
            "--metrics.log_freq", str(a.val_freq), "--metrics.save_plot", "false"]  # fmt: skip
    curves = []
    with tempfile.TemporaryDirectory(prefix="titanlab_quality_") as work:
        for optimizer in OPTIMIZERS:
            for lr in a.lrs:
                dump = os.path.join(work, f"{optimizer}_{lr:g}")
                args = [*base, "--job.dump_folder", dump, "--optimizer.name", optimizer,
                        "--optimizer.lr", str(lr)]  # fmt: skip
                proc = launch(2, args, timeout=3600, torchrun=True)
                if proc.returncode:
                    print(f"{optimizer} lr {lr}: exit {proc.returncode}\n{proc.stderr[-2000:]}",
                          file=sys.stderr)  # fmt: skip
                    return 1
                curves.append(read_curve(dump, optimizer, lr))
                print(f"{optimizer} lr {lr:g}: final val loss {curves[-1].final:.4f}", flush=True)
    text = table(curves, command)
    print(text)
    write_block(a.out, "quality", text)
    plot(curves, os.path.join(os.path.dirname(a.out), "quality.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
