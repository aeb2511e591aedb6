"""Process-level measurements for the metrics line: memory and CPU utilization.

CUDA memory comes from the caching allocator's counters (`torch.cuda.memory_stats`); on CPU the
process's resident set size (RSS) is the measure. Peaks are per log window on CUDA (reset after
each log line) and over the process's life on CPU (the kernel keeps only that one).
"""

from __future__ import annotations

import os
import resource
import time

import torch

GIB = 2**30


def rss_bytes() -> int:
    """Current resident set size of this process in bytes (Linux /proc)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (`getrusage`; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_fields(device: torch.device) -> dict[str, float]:
    """The memory figures of one log record, in GiB (counts for the allocator's retries/OOMs).

    CUDA: `mem_allocated_gib` / `mem_reserved_gib` now, `mem_peak_allocated_gib` /
    `mem_peak_reserved_gib` since the last `reset_peaks`, `alloc_retries` (cudaMalloc retries
    after freeing the cache: a sign of fragmentation or memory pressure) and `ooms`.
    CPU: `rss_gib` now and `rss_peak_gib` over the process's life.
    `memory_gib` is the headline figure of the log line: peak reserved (CUDA) or peak RSS (CPU).
    """
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        out = {
            "mem_allocated_gib": s.get("allocated_bytes.all.current", 0) / GIB,
            "mem_reserved_gib": s.get("reserved_bytes.all.current", 0) / GIB,
            "mem_peak_allocated_gib": s.get("allocated_bytes.all.peak", 0) / GIB,
            "mem_peak_reserved_gib": s.get("reserved_bytes.all.peak", 0) / GIB,
            "alloc_retries": float(s.get("num_alloc_retries", 0)),
            "ooms": float(s.get("num_ooms", 0)),
        }
        out["memory_gib"] = out["mem_peak_reserved_gib"]
        return out
    rss = rss_bytes() / GIB
    peak = max(peak_rss_bytes() / GIB, rss)  # the kernel updates its high-water mark lazily
    return {"rss_gib": rss, "rss_peak_gib": peak, "memory_gib": peak}


def memory_kind(device: torch.device) -> str:
    """What `memory_gib` measures on `device`, for the log line."""
    return "peak_reserved" if device.type == "cuda" else "peak_rss"


def reset_peaks(device: torch.device) -> None:
    """Start a new peak window (CUDA; a no-op on CPU, whose peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class CpuMeter:
    """CPU utilization of this process (all its threads) between calls, in percent of one core:
    100 × (user + system CPU seconds) ÷ wall seconds, as `top` shows it. Data-loader worker
    processes are not included."""

    def __init__(self) -> None:
        self._cpu, self._wall = self._now()

    @staticmethod
    def _now() -> tuple[float, float]:
        t = os.times()
        return t.user + t.system, time.perf_counter()

    def percent(self) -> float:
        """Utilization since the previous call (or construction); restarts the interval."""
        cpu, wall = self._now()
        pct = 100.0 * (cpu - self._cpu) / max(wall - self._wall, 1e-9)
        self._cpu, self._wall = cpu, wall
        return pct
