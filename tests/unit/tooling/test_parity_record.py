"""`tools/parity_matrix.py --part k/n` with its record (`tools/lib/parity_record.py`): the parts
split the layouts, each run layout is recorded with its commit and reused on a rerun while the
training code is unchanged, and the table is written once every part has run."""

from __future__ import annotations

import json
import os
import subprocess

from tools import parity_matrix
from tools.lib import parity_record
from tools.lib.parity_runs import Outcome

COMMIT = "a" * 40


def _fake_runs(monkeypatch, ran: list[str]) -> None:
    def run_layout(lay, *_args, **_kwargs):
        ran.append(lay.name)
        return Outcome(lay.name, lay.world_size, 0.0, seconds=1.0)

    monkeypatch.setattr(parity_matrix, "prepare_reference", lambda work_dir: (None, None, None))
    monkeypatch.setattr(parity_matrix, "run_layout", run_layout)
    monkeypatch.setattr(parity_record, "run_commit", lambda: COMMIT)
    monkeypatch.setattr(parity_record, "trains_as_on", lambda commit: commit == COMMIT)


def test_the_parts_split_the_layouts_and_the_record_carries_them_over(tmp_path, monkeypatch):
    record, doc = str(tmp_path / "record.jsonl"), str(tmp_path / "doc.md")
    ran: list[str] = []
    _fake_runs(monkeypatch, ran)
    argv = ["--world-sizes", "2", "--work-dir", str(tmp_path), "--record", record, "--output", doc]
    valid = [lay.name for lay, why in parity_matrix.matrix((2,)) if why is None]

    assert parity_matrix.main([*argv, "--part", "1/2"]) == 0
    assert ran and len(ran) < len(valid) and not os.path.exists(doc)  # the table waits
    rows = [json.loads(line) for line in open(record, encoding="utf-8")]
    assert {r["commit"] for r in rows} == {COMMIT}

    assert parity_matrix.main([*argv, "--part", "2/2"]) == 0
    assert sorted(ran) == sorted(valid) and os.path.exists(doc)  # every layout once, then the table
    assert f"{len(valid)} valid, {len(valid)} within" in open(doc, encoding="utf-8").read()

    ran.clear()
    assert parity_matrix.main([*argv, "--part", "1/2"]) == 0
    assert ran == []  # recorded with training code as it is: reused, on any machine


def _git(repo, *args):
    subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True)


def test_a_row_is_reused_only_while_the_training_code_is_as_on_its_commit(tmp_path):
    repo = str(tmp_path / "repo")
    os.makedirs(os.path.join(repo, "titanlab"))
    with open(os.path.join(repo, "titanlab", "step.py"), "w") as f:
        f.write("LR = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "step")
    head = parity_record.run_commit(repo)
    assert head and parity_record.trains_as_on(head, repo)
    with open(os.path.join(repo, "README"), "w") as f:  # outside the training code: still reused
        f.write("docs\n")
    parity_record.trains_as_on.cache_clear()
    assert parity_record.trains_as_on(head, repo)
    with open(os.path.join(repo, "titanlab", "step.py"), "w") as f:
        f.write("LR = 2\n")
    parity_record.trains_as_on.cache_clear()
    assert not parity_record.trains_as_on(head, repo)
    assert parity_record.run_commit(repo) is None  # an uncommitted step: recorded as never reused


def test_a_crashed_row_or_one_of_other_training_code_runs_again(tmp_path, monkeypatch):
    monkeypatch.setattr(parity_record, "trains_as_on", lambda commit: commit == COMMIT)
    record = str(tmp_path / "record.jsonl")
    parity_record.append(Outcome("kept", 2, 0.0, commit=COMMIT), record)
    parity_record.append(
        Outcome("crashed", 2, None, error="rank 1 exited 1", commit=COMMIT), record
    )
    parity_record.append(Outcome("elsewhere", 2, 0.0, commit="0" * 40), record)
    parity_record.append(Outcome("uncommitted", 2, 0.0), record)
    assert set(parity_record.load(record)) == {"kept"}
