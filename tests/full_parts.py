"""A pytest plugin (`-p tests.full_parts`) that keeps one part of the suite: with
`TITANLAB_FULL_PART=k/n` (1 ≤ k ≤ n), only the test modules whose path's CRC-32 is k − 1
modulo n are run, the others deselected; without it, everything. `make test-full-part
PART=k/n` runs `make test-full`'s pytest stages one part at a time, so that the whole (hours
on 2 cores) can be run across sessions of a few hours, each part green on its own: every test
module falls in exactly one part (`tests/unit/test_full_parts.py`).
"""

from __future__ import annotations

import os
import zlib

import pytest


def part_of(module_path: str, parts: int) -> int:
    """The part (1-based) of the test module at `module_path` (relative to the repository, with
    forward slashes) among `parts`."""
    return zlib.crc32(module_path.encode()) % parts + 1


def parse(value: str) -> tuple[int, int]:
    """ "k/n" → (k, n). Raises ValueError (one line) for anything else."""
    try:
        k, n = (int(v) for v in value.split("/"))
    except ValueError:
        raise ValueError(f"TITANLAB_FULL_PART={value!r}: give k/n, e.g. 1/4") from None
    if not 1 <= k <= n:
        raise ValueError(f"TITANLAB_FULL_PART={value!r}: k must be between 1 and n")
    return k, n


def pytest_collection_modifyitems(config, items) -> None:
    value = os.environ.get("TITANLAB_FULL_PART", "")
    if not value:
        return
    k, n = parse(value)
    root = str(config.rootpath)
    keep, drop = [], []
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        (keep if part_of(path, n) == k else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus) -> None:
    """A part can hold none of a stage's tests (the serial ones): no test collected (pytest's
    exit code 5) is a pass for a part, not a failure."""
    if os.environ.get("TITANLAB_FULL_PART") and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
