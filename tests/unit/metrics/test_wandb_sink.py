"""W&B in offline mode: the run holds the config and the series; a resumed run continues the same
run id and never sends a step twice; a new run starts a new id."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.wandb_records import offline_runs
from titanlab.metrics.wandb_sink import resolve_mode

pytest.importorskip("wandb")


def sink(dump: str, start_step: int):
    from titanlab.metrics.wandb_sink import WandbSink

    return WandbSink(
        dump_folder=dump, project="proj", run_name="", tags=["cpu", "test"], mode="offline",
        config={"training": {"steps": 8}}, start_step=start_step,
    )  # fmt: skip


def test_offline_run_resumes_without_duplicate_steps(tmp_path):
    dump = str(tmp_path / "myrun")
    first = sink(dump, 0)
    for s in range(1, 7):  # the crash comes after step 6; the newest checkpoint is step 4
        first.write({"step": s, "loss": 10.0 - s})
    first.close()
    again = sink(dump, 4)
    for s in range(5, 9):
        again.write({"step": s, "loss": 10.0 - s})
    again.close()
    runs = offline_runs(os.path.join(dump, "wandb"))
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    for run in runs:
        assert run["name"] == "myrun" and run["project"] == "proj"
        assert run["tags"] == ["cpu", "test"] and run["config"]["training"] == {"steps": 8}
    steps = [h["_step"] for run in runs for h in run["history"]]
    assert steps == list(range(1, 9))
    assert [h["loss"] for run in runs for h in run["history"]] == [10.0 - s for s in steps]
    with open(os.path.join(dump, "wandb", "titanlab_run.json")) as f:
        assert json.load(f) == {"id": runs[0]["id"], "last_step": 8}
    fresh = sink(dump, 0)  # a run from step 0 is a new W&B run
    fresh.close()
    with open(os.path.join(dump, "wandb", "titanlab_run.json")) as f:
        assert json.load(f)["id"] != runs[0]["id"]


def test_auto_mode_is_offline_without_an_api_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert resolve_mode("auto") == "online"
    assert resolve_mode("offline") == "offline"
