"""Fixed glibc malloc thresholds for a CPU training process.

glibc adapts two thresholds as a process frees memory (mallopt(3), "M_MMAP_THRESHOLD"): a freed
mmap-ed block raises the size from which allocations get their own mapping, and the trim
threshold follows at twice that. How a training step then allocates depends on what the process
freed before it (a torch.compile warm-up, a checkpoint load), and a low trim threshold hands the
heap back to the kernel between steps, so the next step's tensors fault in fresh zeroed pages.
On the debug model (1 process, bf16, compiled) that cost the trainer 5-8% against a plain loop
whose history differed; with the thresholds fixed both run at the same speed (docs/performance.md,
the overhead table). Setting either threshold turns the adaptation off (glibc's mallopt(3)).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit Linux (DEFAULT_MMAP_THRESHOLD_MAX): blocks up to
this size are served from the heap and reused."""
TRIM_THRESHOLD_BYTES = 2**30
"""Free memory at the top of the heap kept before any is returned to the kernel."""


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring).

    Returns True when both were set; False on a C library other than glibc (macOS, musl) or
    when mallopt refuses a value, leaving the allocator as it was."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
