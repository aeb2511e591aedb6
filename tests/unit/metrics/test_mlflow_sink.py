"""MLflow on a real SQLite store in the dump folder, read back through MLflow's client: params,
metrics at their steps, artifacts; a resumed run continues the same MLflow run without sending
a step twice; bad input is one line before anything is written."""

from __future__ import annotations

import os

import pytest

from titanlab.config.job_config import ConfigError
from titanlab.metrics.mlflow_sink import check_mlflow, default_uri, flatten

pytest.importorskip("mlflow")


def sink(dump: str, start_step: int):
    from titanlab.metrics.mlflow_sink import MlflowSink

    return MlflowSink(
        dump_folder=dump, tracking_uri="", experiment="exp", run_name="",
        config={"training": {"steps": 8, "seq_len": 64}, "model": {"name": "llama3"}},
        start_step=start_step,
    )  # fmt: skip


def client(dump: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=default_uri(dump))


def test_params_metrics_and_artifacts_read_back_and_a_resume_continues_the_run(tmp_path):
    dump = str(tmp_path / "myrun")
    first = sink(dump, 0)
    for s in range(1, 7):  # the crash comes after step 6; the newest checkpoint is step 4
        first.write({"step": s, "loss": 10.0 - s, "lr": 1e-3, "note": "x", "val_loss": None})
    first.close()
    again = sink(dump, 4)
    assert again.run_id == first.run_id
    for s in range(5, 9):
        again.write({"step": s, "loss": 100.0 + s, "lr": 1e-3})  # 5, 6 were sent already
    (tmp_path / "loss.png").write_bytes(b"\x89PNG")
    again.artifacts("steps: 1 -> 8", [str(tmp_path / "loss.png"), str(tmp_path / "missing")])
    again.close()

    c = client(dump)
    run = c.get_run(first.run_id)
    assert run.info.run_name == "myrun" and run.info.status == "FINISHED"
    assert run.data.params == {"training.steps": "8", "training.seq_len": "64",
                               "model.name": "llama3"}  # fmt: skip
    history = {m.step: m.value for m in c.get_metric_history(first.run_id, "loss")}
    assert history == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0, 5: 5.0, 6: 4.0, 7: 107.0, 8: 108.0}
    assert set(run.data.metrics) == {"loss", "lr"}  # strings and None are not metrics
    assert sorted(a.path for a in c.list_artifacts(first.run_id)) == ["loss.png",
                                                                      "run_summary.txt"]  # fmt: skip
    exp = c.get_experiment(run.info.experiment_id)
    assert exp.name == "exp" and exp.artifact_location.startswith(os.path.join(dump, "mlflow"))


def test_a_new_run_in_the_same_folder_is_a_new_mlflow_run(tmp_path):
    dump = str(tmp_path / "run")
    a = sink(dump, 0)
    a.close()
    b = sink(dump, 0)
    b.close()
    assert a.run_id != b.run_id


def test_flatten_names_params_by_section_and_key():
    assert flatten({"a": {"x": 1, "y": [1, 2]}, "b": {}}) == {"a.x": "1", "a.y": "[1, 2]"}


def test_an_unreachable_server_is_one_line_before_launch():
    with pytest.raises(ConfigError) as e:
        check_mlflow(True, "http://127.0.0.1:9/")  # the discard port: nothing answers
    line = str(e.value)
    assert line.startswith("metrics.mlflow_tracking_uri='http://127.0.0.1:9/' does not answer")
    assert "\n" not in line
    check_mlflow(False, "http://127.0.0.1:9/")  # off: not checked


def test_without_the_package_it_is_one_line(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mlflow(name, *args, **kwargs):
        if name == "mlflow" or name.startswith("mlflow."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ConfigError) as e:
        check_mlflow(True, "")
    assert str(e.value) == (
        "metrics.enable_mlflow=true needs the mlflow-skinny package; pip install 'titanlab[mlflow]'"
    )


def refusal(uri: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_mlflow(True, uri)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"metrics.mlflow_tracking_uri={uri!r}"), line
    return line


def test_a_store_mlflow_cannot_open_is_one_line_naming_the_uri_and_what_is_valid(
    tmp_path, monkeypatch
):
    """Each of these crashed rank 0 in `MlflowClient(uri)` after launch (MLflow 3.17)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    line = refusal("nosuchscheme://x/y")
    assert "no tracking store for scheme 'nosuchscheme'" in line
    assert "http(s)://host:port" in line and "sqlite:///" in line
    for folder_store in (f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns"), "mlruns"):
        line = refusal(folder_store)
        assert "folder store" in line and "MLFLOW_ALLOW_FILE_STORE=true" in line
        assert "use sqlite:///<writable folder>/mlflow.db" in line
    (tmp_path / "regular").write_text("not a folder")
    uri = f"sqlite:///{tmp_path}/regular/m.db"
    line = refusal(uri)
    assert f"{tmp_path / 'regular'} is a file, not a folder" in line
    (tmp_path / "adir.db").mkdir()
    assert f"{tmp_path / 'adir.db'} is a folder" in refusal(f"sqlite:///{tmp_path}/adir.db")
    assert "names no database file" in refusal("sqlite://")


def test_a_database_without_its_driver_is_one_line():
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here")
    line = refusal("postgresql://user@localhost/mlflow")
    assert "needs the database driver 'psycopg'" in line


def test_the_stores_mlflow_opens_pass_and_a_checked_sqlite_path_opens(tmp_path, monkeypatch):
    from titanlab.metrics.mlflow_sink import MlflowSink

    check_mlflow(True, "")
    check_mlflow(True, "databricks")
    uri = f"sqlite:///{tmp_path}/new/folders/m.db"  # created by MLflow
    check_mlflow(True, uri)
    s = MlflowSink(dump_folder=str(tmp_path / "dump"), tracking_uri=uri, experiment="e",
                   run_name="r", config={}, start_step=0)  # fmt: skip
    s.close()
    assert (tmp_path / "new" / "folders" / "m.db").is_file()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-out
    check_mlflow(True, f"file://{tmp_path}/mlruns")
    (tmp_path / "f").write_text("x")
    assert "is a file, not a folder" in refusal(f"file://{tmp_path}/f/mlruns")
