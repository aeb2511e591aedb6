"""Per-step metrics: the log line on rank 0 and the records of `metrics.jsonl`, TensorBoard, W&B.

Throughput: `tps_total` = tokens of the global batch per optimizer step × steps ÷ their summed
step time; `tps` (per rank) = `tps_total` ÷ world size, whatever the layout, so that
MFU = tps × training FLOPs per token ÷ the device's peak dense FLOP/s (Chowdhery et al. 2022,
PaLM, Appendix B) holds under tensor, pipeline and context parallel too. Samples likewise.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import torch

from titanlab.metrics.format import (
    format_line,
    format_mixture,
    format_moe,
    format_qk_clip,
    format_rl,
)
from titanlab.metrics.system import CpuMeter, memory_fields, memory_kind, reset_peaks
from titanlab.metrics.window import StepRecord, StepWindow, spread

logger = logging.getLogger("titanlab")


class Sink(Protocol):
    def write(self, rec: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Times steps, keeps their device values until the host needs them, and logs the window.

    Per step the loop calls `begin_step`, `data_ready` (the batch is in hand), then `end_step`
    with the step's 0-d device tensors; `log` every `log_freq` steps writes one record of the
    window (rank 0 writes the line and the sinks).

    Args:
        tokens_per_step: tokens of the global batch per optimizer step (global batch × seq_len).
        samples_per_step: sequences of the global batch per optimizer step.
        world_size: ranks sharing the work (the per-rank figures divide by it).
        flops_per_token: training FLOPs per token of the whole model (forward + backward).
        peak_flops: peak dense FLOP/s of one device, None when unknown (MFU omitted).
        sinks: where rank 0 writes each record besides the log line.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        rank: int,
        log_freq: int,
        tokens_per_step: int,
        samples_per_step: int,
        world_size: int,
        flops_per_token: int,
        peak_flops: float | None,
        sinks: list[Sink] | None = None,
    ) -> None:
        self.device, self.rank, self.log_freq = device, rank, log_freq
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.world_size, self.flops_per_token = world_size, flops_per_token
        self.peak_flops = peak_flops
        self.sinks = list(sinks or [])
        self.window = StepWindow()
        self._cpu = CpuMeter()
        self._t0 = self._t_data = time.perf_counter()
        # Over the whole run, for the summary.
        self.run_steps, self.run_seconds, self.peak_memory_gib = 0, 0.0, 0.0
        self.run_peaks: dict[str, float] = {}  # each `*peak*` memory field's max over the run
        self.first: dict[str, Any] = {}  # the run's first logged record
        self.last: dict[str, Any] = {}
        self.last_val: tuple[int, float] | None = None
        self.last_eval: tuple[int, str, float] | None = None  # RL: the held-out figure

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == last_step

    def begin_step(self) -> None:
        self._t0 = self._t_data = time.perf_counter()

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()

    def end_step(
        self,
        step: int,
        *,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        extra: dict[str, torch.Tensor] | None = None,
        loss_scale: float | None = None,
        fetch: bool,
    ) -> StepRecord | None:
        """Record the step that just ran. With `fetch`, bring every pending value of the window
        to the host first (the step's time then includes waiting for the device) and return the
        earliest step whose loss is not finite, if any."""
        pending = {"loss": loss, "grad_norm": grad_norm, **(extra or {})}
        rec = StepRecord(step, 0.0, self._t_data - self._t0, lr, loss_scale, pending=pending)
        self.window.add(rec)
        if fetch:
            self.window.fetch()
        rec.step_s = time.perf_counter() - self._t0
        return self.window.first_non_finite() if fetch else None

    def log(
        self,
        step: int,
        val_loss: float | None = None,
        data_tokens: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Write the record of the window ending at `step` (already fetched by `end_step`) and
        start a new window. `data_tokens`: a mixture's tokens consumed per source by the end of
        `step` (over every rank), recorded as `data/tokens/<name>`. Returns the record (on
        every rank)."""
        recs = self.window.records
        assert recs and not recs[-1].pending, "log() needs end_step(fetch=True) first"
        last = recs[-1]
        n, seconds = len(recs), sum(r.step_s for r in recs)
        step_ms = spread([r.step_s for r in recs], 1000)
        data_ms = spread([r.data_s for r in recs], 1000)
        tps_total = self.tokens_per_step * n / max(seconds, 1e-9)
        tps = tps_total / self.world_size
        samples_total = self.samples_per_step * n / max(seconds, 1e-9)
        tflops = tps * self.flops_per_token / 1e12
        extras = {k: v for k, v in last.values.items() if k not in ("loss", "grad_norm")}
        rec: dict[str, Any] = {
            "step": step,
            "loss": last.values["loss"],
            "grad_norm": last.values["grad_norm"],
            "lr": last.lr,
            "steps_in_window": n,
            "step_time_ms": step_ms[0],
            "step_time_ms_min": step_ms[1],
            "step_time_ms_max": step_ms[2],
            "data_wait_ms": data_ms[0],
            "data_wait_ms_min": data_ms[1],
            "data_wait_ms_max": data_ms[2],
            "tokens_per_step": self.tokens_per_step,
            "tps": tps,
            "tps_total": tps_total,
            "samples_per_s": samples_total / self.world_size,
            "samples_per_s_total": samples_total,
            "tflops": tflops,
        }
        if self.peak_flops:
            rec["mfu_pct"] = 100 * tflops * 1e12 / self.peak_flops
        rec.update(memory_fields(self.device))
        rec["cpu_util_pct"] = self._cpu.percent()
        if last.loss_scale is not None:
            rec["loss_scale"] = last.loss_scale
        if val_loss is not None:
            rec["val_loss"] = val_loss
            rec["val_ppl"] = perplexity(val_loss)
            self.last_val = (step, val_loss)
        rec.update(extras)
        if data_tokens:
            rec.update({f"data/tokens/{k}": v for k, v in data_tokens.items()})
        self.run_steps += n
        self.run_seconds += seconds
        self.peak_memory_gib = max(self.peak_memory_gib, rec["memory_gib"])
        for k, v in rec.items():
            if "peak" in k and k.endswith("_gib"):
                self.run_peaks[k] = max(self.run_peaks.get(k, 0.0), v)
        self.last = rec
        self.first = self.first or rec
        for key, name in (("rl/eval_exact_match", "greedy exact match"),
                          ("rl/eval_reward_accuracy", "reward accuracy")):  # fmt: skip
            if key in rec:
                self.last_eval = (step, name, rec[key])
        if self.rank == 0:
            logger.info("%s", format_line(rec, memory_kind(self.device)))
            if val_loss is not None:
                logger.info("validation: step: %d  val_loss: %.6f", step, val_loss)
            if any(k.startswith("moe/") for k in extras):
                logger.info("step: %d  %s", step, format_moe(extras))
            if any(k.startswith("rl/") for k in extras):
                logger.info("step: %d  %s", step, format_rl(extras))
            if "qk_clip/max_logit" in extras:
                logger.info("step: %d  %s", step, format_qk_clip(extras))
            if data_tokens:
                logger.info("step: %d  %s", step, format_mixture(data_tokens))
            for sink in self.sinks:
                sink.write(rec)
        self.window.clear()
        reset_peaks(self.device)
        return rec

    def mean_tps(self) -> float:
        """Tokens/s per rank over every logged step of this run (step time only)."""
        if not self.run_seconds:
            return math.nan
        return self.tokens_per_step * self.run_steps / self.run_seconds / self.world_size

    def artifacts(self, summary: str, files: list[str]) -> None:
        """Hand the run summary and the end-of-run files (loss.png) to the sinks that keep
        artifacts (MLflow)."""
        for sink in self.sinks:
            if hasattr(sink, "artifacts"):
                sink.artifacts(summary, files)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def perplexity(loss: float) -> float:
    """exp(mean token cross-entropy), inf where exp would overflow."""
    return math.exp(loss) if loss < 700 else math.inf
