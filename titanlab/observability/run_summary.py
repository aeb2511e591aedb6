"""The block rank 0 prints at the end of a run: what was done, how well, and what to do next."""

from __future__ import annotations

import datetime
import math
import os
import shlex

from typing import Any

import torch

from titanlab.config.job_config import JobConfig
from titanlab.metrics.logger import MetricsLogger, perplexity
from titanlab.metrics.system import memory_kind


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
    adapters_only: bool = False,
    attention_tiles: dict[str, float] | None = None,
) -> str:
    """The summary lines. `checkpoint`: the newest complete checkpoint folder (None: none;
    `adapters_only`: it holds LoRA adapters);
    `plot`: the PNG written, or the reason there is none; `traces`: the profiler's folder;
    `attention_tiles`: the share of (128 × 128) tiles FlexAttention computed, by layer kind
    (`flex_masks.TILES`; empty where no FlexAttention ran)."""
    rec = metrics.last
    loss = rec.get("loss", math.nan)
    lines = [
        "run summary:",
        f"  steps:       {first_step + 1} → {last_step} ({last_step - first_step} done) in "
        f"{datetime.timedelta(seconds=round(wall_s))} wall",
    ]
    rl_key = next((k for k in ("rl/reward_mean", "rl/dpo_reward_accuracy") if k in rec), None)
    if rl_key:  # an RL loss is a surrogate: the rewards say how it went
        what = "mean over the sampled completions" if rl_key == "rl/reward_mean" else "accuracy"
        lines.append(
            f"  reward:      {metrics.first.get(rl_key, math.nan):.4f} at step "
            f"{metrics.first.get('step', '-')} → {rec[rl_key]:.4f} at step {rec['step']} "
            f"({what})"
        )
        if metrics.last_eval is not None:
            step, name, value = metrics.last_eval
            lines.append(f"  held-out:    {name} {value:.4f} at step {step}")
    else:
        lines.append(
            f"  train loss:  {loss:.4f} (perplexity {perplexity(loss):.2f}) at step "
            f"{rec.get('step', '-')}"
        )
    if metrics.last_val is not None:
        step, val = metrics.last_val
        lines.append(f"  val loss:    {val:.4f} (perplexity {perplexity(val):.2f}) at step {step}")
    tps = metrics.mean_tps()
    mfu = "n/a"
    if metrics.peak_flops:
        mfu = f"{100 * tps * metrics.flops_per_token / metrics.peak_flops:.2f}%"
    lines += [
        f"  throughput:  {tps:,.0f} tokens/s per rank ({tps * metrics.world_size:,.0f} total), "
        f"MFU {mfu}",
        f"  peak memory: {metrics.peak_memory_gib:.2f} GiB ({memory_kind}, rank 0)",
    ]
    if attention_tiles:
        tiles = ", ".join(f"{kind} {100 * share:.1f}%" for kind, share in attention_tiles.items())
        lines.append(f"  attention:   FlexAttention computed {tiles} of its 128×128 tiles (rank 0)")
    if checkpoint:
        root = os.path.dirname(os.path.dirname(checkpoint.rstrip("/")))  # the dump folder
        out = os.path.join(root, "hf", os.path.basename(checkpoint.rstrip("/")))
        # The checkpoint's model_args.json names the family and flavor.
        cmd = shlex.join(["titanlab", "convert", "to-hf", checkpoint, out])
        lines.append(f"  checkpoint:  {checkpoint}")
        if adapters_only:  # the step folders hold LoRA adapters, not a whole model
            peft_out = os.path.join(root, "peft", os.path.basename(checkpoint.rstrip("/")))
            cmd = shlex.join(["titanlab", "convert", "to-peft", checkpoint, peft_out])
            lines.append(f"  to PEFT:     {cmd}")
        else:
            lines.append(f"  to HF:       {cmd}")
    else:
        lines.append("  checkpoint:  none (checkpoint.enable=false)")
    lines.append(f"  plot:        {plot}")
    if traces:
        lines.append(f"  traces:      {traces}")
    return "\n".join(lines)


def end_of_run(
    config: JobConfig,
    metrics: MetricsLogger,
    checkpointer: Any,
    device: torch.device,
    first_step: int,
    last_step: int,
    wall_s: float,
    attention_tiles: dict[str, float] | None = None,
) -> str:
    """Draw `<dump_folder>/loss.png` (when `metrics.save_plot`; a missing matplotlib is named in
    the summary instead) and return the summary of the run. `checkpointer`: the run's
    `Checkpointer` (its newest complete checkpoint is named); `attention_tiles`: FlexAttention's
    computed tiles by layer kind (`titanlab.models.common.flex_masks.TILES`)."""
    dump = config.job.dump_folder
    plot = "off (metrics.save_plot=false)"
    if config.metrics.save_plot:
        from titanlab.observability.plotting import plot_runs

        path = os.path.join(dump, "loss.png")
        try:
            plot_runs([dump], path)
            plot = path
        except ValueError as e:  # matplotlib missing
            plot = f"none ({e})"
    prof = config.profiling
    return format_summary(
        first_step=first_step,
        last_step=last_step,
        wall_s=wall_s,
        metrics=metrics,
        memory_kind=memory_kind(device),
        checkpoint=checkpointer.last_complete() if config.checkpoint.enable else None,
        adapters_only=config.peft.method == "lora",
        plot=plot,
        traces=os.path.join(dump, prof.save_traces_folder) if prof.enable_profiling else None,
        attention_tiles=attention_tiles,
    )
