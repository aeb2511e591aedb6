"""Profiler traces and memory snapshots of a training run (the `[profiling]` section).

`StepProfiler` wraps the training loop; the loop calls `step(n)` after each training step.
Every `profile_freq` steps it closes a window of `profiler_active` recorded steps (after
`profiler_warmup` unrecorded ones, torch.profiler.schedule) and writes, per rank:
- with `enable_profiling`, the Chrome/Perfetto trace `<traces>/step-N/rank{R}_trace.json`;
- with `enable_memory_snapshot` on CUDA, `torch.cuda.memory._dump_snapshot`'s pickle of the
  allocator history, `<snapshots>/rank{R}_step{N}.pickle` (also on an out-of-memory error:
  `rank{R}_oom_step{N}.pickle`);
- with `enable_memory_snapshot` on CPU, where no allocator history exists, the profiler's memory
  timeline of the window (`torch.profiler`'s memory profiler: every tensor's lifetime,
  categorized as parameter, gradient, optimizer state, activation, temporary, ...):
  `rank{R}_step{N}.html` (a plot; needs matplotlib) or `rank{R}_step{N}.json.gz`, and
  `rank{R}_step{N}_peak.json`: `window_peak_bytes`, the most bytes of tensors allocated during
  the window alive at once (the step's activations and temporaries); `peak_live_bytes`, the
  most bytes of every tensor alive at once (the tensors alive when the window began,
  `live_at_window_start_bytes`, counted by `live_tensor_bytes`, plus the window's running sum
  of allocations and frees, less the frees of older tensors the profiler cannot see); and, where torch's categorization succeeds,
  `peak_bytes` (the same peak by torch's own accounting) with `by_category`, each category's
  bytes at that peak.

N is the training step that ends the window. Sources: the PyTorch docs of `torch.profiler`
(schedule, `export_chrome_trace`, `export_memory_timeline`) and "Understanding CUDA Memory
Usage" (`torch.cuda.memory._record_memory_history`).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import logging
import os
import warnings
from typing import Any

import torch

from titanlab.config.profiling import Profiling

logger = logging.getLogger("titanlab")

# Entries of allocator history kept on CUDA (each alloc/free is one; about 100 bytes each).
CUDA_HISTORY_ENTRIES = 100_000


def _folder(dump_folder: str, folder: str) -> str:
    return folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)


def _category_names() -> list[str]:
    """Names of the columns of `MemoryProfileTimeline._coalesce_timeline`'s rows: column
    i + 1 holds category i of `_CATEGORY_TO_INDEX` (None: not categorized)."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    names = ["other"] * (len(_CATEGORY_TO_INDEX) + 1)
    for category, i in _CATEGORY_TO_INDEX.items():
        names[i + 1] = category.name.lower() if category is not None else "unknown"
    return names


class StepProfiler(contextlib.AbstractContextManager):
    """The profiler and memory snapshots of one rank; a no-op when both are off."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.traces = _folder(dump_folder, cfg.save_traces_folder)
        self.snapshots = _folder(dump_folder, cfg.save_memory_snapshot_folder)
        self.cuda_history = cfg.enable_memory_snapshot and device.type == "cuda"
        # On CPU the memory timeline comes from the profiler, so it runs for snapshots too.
        self.cpu_timeline = cfg.enable_memory_snapshot and device.type != "cuda"
        self.prof: torch.profiler.profile | None = None
        self.steps_done = 0
        self.last_step = 0
        self.window_base: int | None = None  # live tensor bytes when the window began

    # --- context manager -----------------------------------------------------------------
    def __enter__(self) -> StepProfiler:
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(max_entries=CUDA_HISTORY_ENTRIES)
        if self.cfg.enable_profiling or self.cpu_timeline:
            c = self.cfg
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(
                    wait=c.profile_freq - c.profiler_warmup - c.profiler_active,
                    warmup=c.profiler_warmup,
                    active=c.profiler_active,
                ),
                on_trace_ready=self._window_done,
                record_shapes=c.record_shapes or self.cpu_timeline,
                with_stack=c.with_stack or self.cpu_timeline,
                profile_memory=self.cpu_timeline,
            )
            # Each window is written on its own, so torch's note that a cycle drops the events
            # of the one before it says nothing to act on.
            warnings.filterwarnings(
                "ignore", message="Warning: Profiler clears events at the end of each cycle"
            )
            self.prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            # Leaving mid-window would flush a partial window: drop it instead.
            self.prof.on_trace_ready = None
            self.prof.__exit__(None, None, None)
            self.prof = None
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)

    # --- per step ----------------------------------------------------------------------------
    def annotate(self, train_step: int) -> contextlib.AbstractContextManager:
        """Wrap training step `train_step` so the trace names it (`train_step#N`, the global
        step; torch's own `ProfilerStep#k` counts the profiler's steps since this run began)."""
        if self.prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"train_step#{train_step}")

    def step(self, train_step: int) -> None:
        """Call after training step `train_step` finished."""
        self.last_step = train_step
        self.steps_done += 1
        if self.prof is not None:
            if self.cpu_timeline and self.window_base is None and _records_next(self.prof):
                # Counted before the window starts, so the profiler does not trace the count.
                self.window_base = live_tensor_bytes(self.device.type)
            self.prof.step()
        if self.cuda_history and self.steps_done % self.cfg.profile_freq == 0:
            self._dump_cuda(f"rank{self.rank}_step{train_step}.pickle")

    def oom_snapshot(self) -> str | None:
        """After an out-of-memory error in step `last_step + 1`: write the memory history and
        return its path. CUDA: the allocator history since the start. CPU: the memory timeline
        of the window being recorded, up to the failure; None when the failure fell outside a
        recorded window (or snapshots are off)."""
        step = self.last_step + 1
        if self.cuda_history:
            return self._dump_cuda(f"rank{self.rank}_oom_step{step}.pickle")
        prof = self.prof
        if not self.cpu_timeline or prof is None or not _recording(prof):
            return None
        prof.on_trace_ready = None
        prof.stop()
        self.prof = None
        return self._write_cpu_timeline(prof, step, f"rank{self.rank}_oom_step{step}")

    # --- writers -------------------------------------------------------------------------------
    def _dump_cuda(self, name: str) -> str:
        os.makedirs(self.snapshots, exist_ok=True)
        path = os.path.join(self.snapshots, name)
        torch.cuda.memory._dump_snapshot(path)
        logger.info("memory snapshot: %s", path)
        return path

    def _window_done(self, prof: torch.profiler.profile) -> None:
        step = self.last_step
        if self.cfg.enable_profiling:
            folder = os.path.join(self.traces, f"step-{step}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank{self.rank}_trace.json")
            prof.export_chrome_trace(path)
            logger.info("profiler trace: %s", path)
        if self.cpu_timeline:
            end = live_tensor_bytes(self.device.type)  # between steps: every tensor is seen
            self._write_cpu_timeline(prof, step, live_at_end=end)

    def _write_cpu_timeline(
        self,
        prof: torch.profiler.profile,
        step: int,
        name: str | None = None,
        live_at_end: int | None = None,
    ) -> str:
        """Write the window's timeline and `<name>_peak.json`; return the timeline's path.
        With `live_at_end` (the window ended between steps) also the peak of every live tensor:
        the profiler records no free of a tensor allocated before the window, so the bytes the
        window's running sum misses at its end (start + sum - end) were freed unseen; they are
        taken as freed before the peak, as the previous step's gradients are (zero_grad at the
        start of a step)."""
        os.makedirs(self.snapshots, exist_ok=True)
        base = os.path.join(self.snapshots, name or f"rank{self.rank}_step{step}")
        times, window = allocation_timeline(prof)
        peak: dict[str, Any] = {"window_peak_bytes": max(window, default=0)}
        if self.window_base is not None and live_at_end is not None and window:
            unseen_frees = max(0, self.window_base + window[-1] - live_at_end)
            peak["live_at_window_start_bytes"] = self.window_base
            peak["peak_live_bytes"] = self.window_base - unseen_frees + max(0, *window)
        self.window_base = None
        try:
            from torch.profiler._memory_profiler import MemoryProfileTimeline

            timeline = MemoryProfileTimeline(prof._memory_profile())
        except AssertionError:
            # torch's categorization asserts on some in-place patterns (context parallel's ring
            # attention, torch 2.13); the uncategorized timeline below still holds.
            logger.info("memory timeline: torch could not categorize step %d's tensors", step)
            timeline = None
        if timeline is not None:
            peak.update(_peak(timeline))
        path = base + ".json.gz"
        try:
            if timeline is None:
                raise ImportError
            import matplotlib  # noqa: F401

            path = base + ".html"
            timeline.export_memory_timeline_html(path, "cpu")
        except ImportError:
            series = timeline._coalesce_timeline("cpu") if timeline is not None else (times, window)
            with gzip.open(path, "wt") as f:
                json.dump(series, f)
        with open(base + "_peak.json", "w", encoding="utf-8") as f:
            json.dump({"step": step, "rank": self.rank, **peak}, f)
        logger.info(
            "memory timeline: %s (%.1f MiB of tensors allocated in the window at its peak)",
            path,
            peak["window_peak_bytes"] / 2**20,
        )
        return path


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of the distinct storages of every tensor on `device_type` that Python objects hold
    now (found through the garbage collector's list of tracked objects): parameters, their
    gradients, optimizer state, FSDP's buffers. A tensor subclass that wraps others (DTensor,
    float8, NF4) counts through its inner tensors; tensors held only by C++ (autograd's saved
    tensors mid-step) are not seen, so call it between steps."""
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != device_type:
            continue
        try:
            storage = obj.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # a wrapper subclass without storage of its own: its parts are counted
        if ptr:
            storages[ptr] = max(storages.get(ptr, 0), nbytes)
    return sum(storages.values())


def _records_next(prof: torch.profiler.profile) -> bool:
    """Whether the next step of `prof` (after this `step()` call) starts a recorded window."""
    from torch.profiler import ProfilerAction

    recording = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
    return prof.current_action not in recording and prof.schedule(prof.step_num + 1) in recording


def _recording(prof: torch.profiler.profile) -> bool:
    """Whether `prof` is inside the recorded steps of its schedule."""
    from torch.profiler import ProfilerAction

    return prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


def allocation_timeline(prof: torch.profiler.profile, device: str = "cpu") -> tuple[list, list]:
    """(times in ns, bytes) of the tensors allocated on `device` during the recorded window
    and alive at each allocation or free: the running sum of the profiler's allocation events.
    Tensors that existed before the window (parameters, optimizer state) are not in it."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        return [], []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and str(node.typed[1].device) == device:
            events.append((node.start_time_ns, node.typed[1].alloc_size))
        stack.extend(node.children)
    events.sort()
    times, alive, total = [], [], 0
    for t, nbytes in events:
        total += nbytes
        times.append(t)
        alive.append(total)
    return times, alive


def _peak(timeline) -> dict[str, Any]:
    """Peak tensor bytes of a CPU memory timeline (every tensor, also those that existed
    before the window) and each category's share at that moment."""
    _, sizes = timeline._coalesce_timeline("cpu")
    if not sizes:
        return {"peak_bytes": 0, "by_category": {}}
    totals = [sum(row) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    names = _category_names()
    return {
        "peak_bytes": int(totals[at]),
        "by_category": {n: int(b) for n, b in zip(names, sizes[at]) if b},
    }
