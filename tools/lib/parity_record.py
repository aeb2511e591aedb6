"""The parity matrix's record, kept in the repository (`docs/parity_matrix.jsonl`), so that the
matrix (about 2 hours on 2 cores) can be run over sessions and machines: each line is one
layout's `Outcome` with the commit it ran on. A line is reused only while the code that trains
is what it was on that commit (`TRAINING_CODE` unchanged between that commit and the working
tree, uncommitted edits included); otherwise the layout runs again.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess

from tools.lib.parity_runs import Outcome

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD = os.path.join(REPO, "docs", "parity_matrix.jsonl")
# What decides a layout's losses: the package and the tools that launch and compare the runs.
TRAINING_CODE = (
    "titanlab",
    "tools/lib/parity_runs.py",
    "tools/lib/runs.py",
    "tools/parity_matrix.py",
)


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


@functools.cache
def trains_as_on(commit: str | None, repo: str = REPO) -> bool:
    """Whether `TRAINING_CODE` in `repo`'s working tree equals its state at `commit` (False for
    an unknown commit or outside git)."""
    if not commit:
        return False
    return _git(repo, "diff", "--quiet", commit, "--", *TRAINING_CODE).returncode == 0


def run_commit(repo: str = REPO) -> str | None:
    """The commit a layout run now is recorded with: HEAD, or None (never reused) where the
    training code has uncommitted edits or there is no git checkout."""
    done = _git(repo, "rev-parse", "HEAD")
    head = done.stdout.strip() if done.returncode == 0 else None
    return head if trains_as_on(head, repo) else None


def load(path: str = RECORD) -> dict[str, Outcome]:
    """The record's passing or failing (not crashed) outcomes still valid for this tree, by
    layout name; the newest line of a layout wins."""
    if not os.path.exists(path):
        return {}
    valid: dict[str, Outcome] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            outcome = Outcome(**json.loads(line))
            if outcome.error is None and trains_as_on(outcome.commit):
                valid[outcome.layout] = outcome
    return valid


def append(outcome: Outcome, path: str = RECORD) -> None:
    """Add `outcome` to the record (its `log` left out: a path on the machine that ran it)."""
    row = {**outcome.__dict__, "log": None}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
