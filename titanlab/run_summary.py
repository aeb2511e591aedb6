"""The block rank 0 prints at the end of a run: what was done, how well, and what to do next."""

from __future__ import annotations

import datetime
import math
import os
import shlex

from titanlab.metrics.logger import MetricsLogger


def format_summary(
    *,
    first_step: int,
    last_step: int,
    wall_s: float,
    metrics: MetricsLogger,
    memory_kind: str,
    checkpoint: str | None,
    plot: str,
    traces: str | None,
) -> str:
    """The summary lines. `checkpoint`: the newest complete checkpoint folder (None: none);
    `plot`: the PNG written, or the reason there is none; `traces`: the profiler's folder."""
    rec = metrics.last
    loss = rec.get("loss", math.nan)
    lines = [
        "run summary:",
        f"  steps:       {first_step + 1} → {last_step} ({last_step - first_step} done) in "
        f"{datetime.timedelta(seconds=round(wall_s))} wall",
        f"  train loss:  {loss:.4f} (perplexity {_ppl(loss):.2f}) at step {rec.get('step', '-')}",
    ]
    if metrics.last_val is not None:
        step, val = metrics.last_val
        lines.append(f"  val loss:    {val:.4f} (perplexity {_ppl(val):.2f}) at step {step}")
    tps = metrics.mean_tps()
    mfu = "n/a"
    if metrics.peak_flops:
        mfu = f"{100 * tps * metrics.flops_per_token / metrics.peak_flops:.2f}%"
    lines += [
        f"  throughput:  {tps:,.0f} tokens/s per rank ({tps * metrics.world_size:,.0f} total), "
        f"MFU {mfu}",
        f"  peak memory: {metrics.peak_memory_gib:.2f} GiB ({memory_kind}, rank 0)",
    ]
    if checkpoint:
        root = os.path.dirname(os.path.dirname(checkpoint.rstrip("/")))  # the dump folder
        out = os.path.join(root, "hf", os.path.basename(checkpoint.rstrip("/")))
        # The checkpoint's model_args.json names the family and flavor.
        cmd = shlex.join(["python", "-m", "tools.convert_checkpoint", "to-hf", checkpoint, out])
        lines += [f"  checkpoint:  {checkpoint}", f"  to HF:       {cmd}"]
    else:
        lines.append("  checkpoint:  none (checkpoint.enable=false)")
    lines.append(f"  plot:        {plot}")
    if traces:
        lines.append(f"  traces:      {traces}")
    return "\n".join(lines)


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
