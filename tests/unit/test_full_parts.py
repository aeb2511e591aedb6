"""`tests/full_parts.py`: the parts of `make test-full-part` cover every test module once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.full_parts import parse, part_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> list[str]:
    found = []
    for folder in ("tests/unit", "tests/integration"):
        for path, _, files in os.walk(os.path.join(REPO, folder)):
            found += [os.path.relpath(os.path.join(path, f), REPO).replace(os.sep, "/")
                      for f in files if f.startswith("test_") and f.endswith(".py")]  # fmt: skip
    return found


def test_every_module_is_in_exactly_one_part_and_no_part_is_empty():
    for n in (2, 4, 6):
        parts = [[m for m in modules() if part_of(m, n) == k] for k in range(1, n + 1)]
        assert sum(len(p) for p in parts) == len(modules()) and all(parts)


def test_a_bad_part_is_one_line():
    assert parse("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "two", "1-4"):
        with pytest.raises(ValueError, match="TITANLAB_FULL_PART"):
            parse(bad)


def test_the_plugin_keeps_only_its_parts_modules():
    env = {**os.environ, "TITANLAB_FULL_PART": "1/4"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.full_parts", "--collect-only", "-q",
         "tests/unit/ledger"], cwd=REPO, env=env, capture_output=True, text=True,
    ).stdout  # fmt: skip
    kept = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert kept and all(part_of(path, 4) == 1 for path in kept), kept


def test_a_part_without_a_stages_tests_passes(tmp_path):
    """The serial stage of a part that holds no serial test: exit 0, not pytest's 5."""
    env = {**os.environ, "TITANLAB_FULL_PART": "1/4"}
    empty = next(m for m in modules() if part_of(m, 4) != 1 and m.startswith("tests/unit/"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.full_parts", "-q", empty],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "deselected" in done.stdout, done.stdout[-500:]
