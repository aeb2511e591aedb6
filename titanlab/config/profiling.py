"""The `[profiling]` section: torch.profiler traces and memory snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from titanlab.config.errors import ConfigError, _require  # noqa: F401


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record a torch.profiler trace (CPU and CUDA activities) of `profiler_active` steps every
    `profile_freq` steps: one Chrome/Perfetto JSON per rank per window,
    `<dump_folder>/<save_traces_folder>/step-N/rank{R}_trace.json`, N the window's last step."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder (or absolute)."""

    profile_freq: int = 10
    """A profiling window ends every this many steps (steps profile_freq, 2·profile_freq, ...,
    counted from the first step of this run, resumed or not)."""

    profiler_warmup: int = 3
    """Steps the profiler runs unrecorded before each window (torch.profiler.schedule's warmup)."""

    profiler_active: int = 1
    """Steps recorded in each window."""

    record_shapes: bool = True
    """Record the input shapes of each op in the trace."""

    with_stack: bool = False
    """Record the Python stack of each op (larger traces, slower)."""

    enable_memory_snapshot: bool = False
    """Per rank, at the end of each window and on an out-of-memory error, write the memory
    history to `<dump_folder>/<save_memory_snapshot_folder>/`: on CUDA a
    `torch.cuda.memory._dump_snapshot` pickle (open it in https://pytorch.org/memory_viz); on CPU
    the profiler's memory timeline (an HTML plot when matplotlib is installed, else JSON) and
    `rank{R}_step{N}_peak.json`, the peak tensor bytes of the window by category."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder (or absolute)."""

    def validate(self) -> None:
        _require(
            self.profiler_active >= 1,
            f"profiling.profiler_active={self.profiler_active} must be >= 1",
        )
        _require(
            self.profiler_warmup >= 0,
            f"profiling.profiler_warmup={self.profiler_warmup} must be >= 0",
        )
        _require(
            self.profile_freq >= self.profiler_warmup + self.profiler_active,
            f"profiling.profile_freq={self.profile_freq} must be >= profiler_warmup + "
            f"profiler_active = {self.profiler_warmup + self.profiler_active}",
        )
