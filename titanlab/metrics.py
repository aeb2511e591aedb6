"""Per-step metrics: throughput (tps), TFLOP/s, MFU, memory; logged on rank 0.

Rank 0 also appends each logged step, with exact floats, to `<dump_folder>/metrics.jsonl`.
The log line reads `step: N  loss: X  grad_norm: G  lr: L  tps: T  tflops: F  mfu: M%  memory: ...`
so tools can parse it (`parse_log_line`).

MFU = achieved model FLOP/s ÷ peak dense FLOP/s of the device (Chowdhery et al. 2022, PaLM,
Appendix B); model FLOPs per token come from `get_nparams_and_flops` (6N + attention term).
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import time

import torch

logger = logging.getLogger(__name__)

# Peak dense bf16 tensor-core FLOP/s (no sparsity), from the vendors' data sheets.
_PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def device_peak_flops(device: torch.device, configured: float = 0.0) -> float | None:
    """Peak dense FLOP/s of one device: `configured` when > 0, else the table entry for the
    CUDA device's name; None when unknown (e.g. CPU), in which case MFU is reported as n/a."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16_FLOPS:
        if key in name:
            return flops
    logger.warning("metrics: peak FLOP/s of %r unknown; set metrics.peak_flops for MFU", name)
    return None


def memory_gib(device: torch.device) -> tuple[float, str]:
    """(GiB, what it measures): CUDA max reserved on GPU, else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30, "max_reserved"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "peak_rss"


class MetricsLogger:
    """Times steps and logs the metrics line every `log_freq` steps on rank 0.

    Args:
        flops_per_token: training FLOPs per token of the model (forward + backward).
        tokens_per_step: tokens this rank processes per optimizer step (local batch × seq × accumulation).
    """

    def __init__(
        self,
        *,
        device: torch.device,
        rank: int,
        log_freq: int,
        flops_per_token: int,
        tokens_per_step: int,
        peak_flops: float | None,
        tb_dir: str | None = None,
        jsonl_path: str | None = None,
    ) -> None:
        self.device, self.rank, self.log_freq = device, rank, log_freq
        self.flops_per_token, self.tokens_per_step, self.peak_flops = (
            flops_per_token,
            tokens_per_step,
            peak_flops,
        )
        self._last_time = time.perf_counter()
        self._steps_since = 0
        self._tb = None
        self._jsonl = None
        if jsonl_path and rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._jsonl = open(jsonl_path, "a", encoding="utf-8")
        if tb_dir and rank == 0:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "metrics.enable_tensorboard=true needs the tensorboard package; "
                    "pip install 'titanlab[tensorboard]'"
                ) from None
            self._tb = SummaryWriter(tb_dir)

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == last_step

    def log(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        """Log the line for `step`. Throughput is averaged since the previous logged step.
        `extra` (e.g. the MoE layers' `moe/<layer>/max_load`, `moe/aux_loss`) goes to
        metrics.jsonl and TensorBoard whole, and its MoE summary into the log line."""
        extra = extra or {}
        now = time.perf_counter()
        steps = max(step - self._steps_since, 1)
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time, self._steps_since = now, step
        tps = self.tokens_per_step * steps / elapsed
        tflops = tps * self.flops_per_token / 1e12
        mfu = f"{100 * tflops * 1e12 / self.peak_flops:.2f}%" if self.peak_flops else "n/a"
        mem, kind = memory_gib(self.device)
        if self.rank == 0:
            logger.info(
                "step: %d  loss: %.6f  grad_norm: %.4f  lr: %.3e  tps: %.0f  tflops: %.3f  "
                "mfu: %s  memory: %.2fGiB(%s)",
                step,
                loss,
                grad_norm,
                lr,
                tps,
                tflops,
                mfu,
                mem,
                kind,
            )
            if extra:
                logger.info("step: %d  %s", step, format_moe(extra))
            if self._jsonl is not None:  # exact values (repr round-trips), for tools and tests
                self._jsonl.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss": loss,
                            "grad_norm": grad_norm,
                            "lr": lr,
                            "tps": tps,
                            "memory_gib": mem,
                            **extra,
                        }
                    )
                    + "\n"
                )
                self._jsonl.flush()
            if self._tb is not None:
                for k, v in (
                    ("loss", loss),
                    ("grad_norm", grad_norm),
                    ("lr", lr),
                    ("tps", tps),
                    ("tflops", tflops),
                    ("memory_gib", mem),
                    *extra.items(),
                ):
                    self._tb.add_scalar(k, v, step)

    def reset_timer(self, step: int) -> None:
        """Restart the throughput window (after checkpointing or validation)."""
        self._last_time, self._steps_since = time.perf_counter(), step

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def parse_log_line(line: str) -> tuple[int, float] | None:
    """(step, loss) from a metrics line, or None when the line is not one."""
    m = _LINE.search(line)
    return (int(m.group(1)), float(m.group(2))) if m else None


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux /proc)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def format_moe(extra: dict[str, float]) -> str:
    """The expert-load line: the mean aux loss, then per MoE layer max/mean token slots per
    expert (1.00 is perfect balance) and the bias norm where auxiliary-loss-free balancing is on."""
    parts = []
    if "moe/aux_loss" in extra:
        parts.append(f"moe_aux_loss: {extra['moe/aux_loss']:.5f}")
    layers = sorted({k.split("/")[1] for k in extra if k.count("/") == 2}, key=_layer_key)
    loads = []
    for layer in layers:
        mean = extra.get(f"moe/{layer}/mean_load", 0.0)
        ratio = extra.get(f"moe/{layer}/max_load", 0.0) / mean if mean else 0.0
        bias = extra.get(f"moe/{layer}/bias_norm")
        loads.append(f"{layer}:{ratio:.2f}" + (f"(bias {bias:.3f})" if bias is not None else ""))
    if loads:
        parts.append("expert max/mean load: " + " ".join(loads))
    return "  ".join(parts)


def _layer_key(layer: str) -> tuple[int, str]:
    return (int(layer), "") if layer.isdigit() else (1 << 30, layer)
