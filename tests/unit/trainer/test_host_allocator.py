"""Fixed malloc thresholds keep a step's freed heap memory for the next step (no page faults).

glibc's own thresholds move with the process's history (which blocks it freed, what sits at the
top of the heap), so the comparison pins them at glibc's starting values (128 KiB) rather than
leaving them to chance: there a step's 3 MiB tensors are mapped and faulted in afresh."""

import platform
import subprocess
import sys

import pytest

STEPS = """
import ctypes, resource, sys, torch
from titanlab.trainer import host_allocator as h
if sys.argv[1] == "fixed":
    assert h.fix_malloc_thresholds()
else:  # glibc's starting values, held there
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(h.M_MMAP_THRESHOLD, 128 << 10) == libc.mallopt(h.M_TRIM_THRESHOLD, 128 << 10) == 1
def step():  # thirty 3 MiB activations (90 MiB, above any adaptive trim threshold), then freed
    xs = [torch.ones(3 << 18) for _ in range(30)]
    del xs
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_fixed_thresholds_reuse_the_heap_between_steps():
    fixed, default = _faults("fixed"), _faults("default")
    print(f"minor page faults over 20 steps: {default} at glibc's starting thresholds, "
          f"{fixed} with titanlab's")  # fmt: skip
    assert fixed == 0 and default >= 20 * 30 * (3 << 20) // 4096
