"""A pytest plugin (`-p tests.full_parts`) that keeps one part of the suite: with
`TITANLAB_FULL_PART=k/n` (1 ≤ k ≤ n), only the test modules whose path's CRC-32 is k − 1
modulo n are run, the others deselected; without it, everything. `make test-full-part
PART=k/n` runs `make test-full`'s pytest stages one part at a time, so that the whole (hours
on 2 cores) can be run across sessions of a few hours, each part green on its own: every test
module falls in exactly one part (`tests/unit/test_full_parts.py`).
"""

from __future__ import annotations

import os

import pytest

from tools.lib.parts import parse as parse
from tools.lib.parts import part_of as part_of


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
