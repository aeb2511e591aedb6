"""What a person watching a run sees, through ./run_train.sh on 2 ranks: the compact config at the
start, the run summary and loss.png at the end, no unactionable warnings; metrics.jsonl with the
step metrics, consistent; TensorBoard and W&B (offline) with the same series; and after a crash
and resume, every curve continues with no step twice."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, checkpoint_every

sys.path.insert(0, REPO)
from tests.wandb_records import offline_runs
from titanlab.observability.plotting import HEIGHT_PX, WIDTH_PX
from titanlab.observability.warning_filters import MESSAGES

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")
pytest.importorskip("mlflow")

TRACKING = [
    "--metrics.log_freq", "2",
    "--metrics.enable_tensorboard", "true",
    "--metrics.enable_wandb", "true",
    "--metrics.wandb_mode", "offline",
    "--metrics.wandb_tags", "ci,cpu",
    "--metrics.enable_mlflow", "true",
    "--metrics.save_plot", "true",
    "--validation.enable", "true",
    "--validation.freq", "3",
    "--validation.steps", "2",
    "--data.val_fraction", "0.05",
]  # fmt: skip
FIELDS = {
    "step", "loss", "grad_norm", "lr", "steps_in_window", "step_time_ms", "step_time_ms_min",
    "step_time_ms_max", "data_wait_ms", "data_wait_ms_min", "data_wait_ms_max",
    "tokens_per_step", "tps", "tps_total", "samples_per_s", "samples_per_s_total", "tflops",
    "rss_gib", "rss_peak_gib", "memory_gib", "cpu_util_pct",
}  # fmt: skip


def run_script(steps: int, dump, dataset: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1")
    args = [*TINY, *TRACKING, *checkpoint_every(3), "--training.steps", str(steps)]
    args += ["--data.dataset_path", dataset, "--job.dump_folder", str(dump)]
    proc = subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def read_jsonl(dump) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tb_series(dump, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(dump, "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_run_report_metrics_and_trackers_continue_across_a_resume(tiny_dataset, tmp_path):
    dump = tmp_path / "obs"
    proc = run_script(7, dump, tiny_dataset)
    out = proc.stdout + proc.stderr
    # The compact config: the changed keys by section, the full config in the dump folder.
    assert f"changed from the defaults (full config: {dump / 'config.toml'}):" in out
    assert "  training: steps=7, seq_len=64, local_batch_size=2" in out
    assert (
        os.path.isfile(dump / "config.toml") and "[metrics]" in (dump / "config.toml").read_text()
    )
    assert "INFO   metrics.log_freq" not in out and "[optimizer]\n" not in out
    # The summary block, the plot, and none of the filtered warnings.
    summary = out[out.index("run summary:") :]
    assert "  steps:       1 → 7 (7 done)" in summary
    assert "  val loss:" in summary and "perplexity" in summary
    ckpt = dump / "checkpoint" / "step-7"
    assert f"  checkpoint:  {ckpt}" in summary
    assert f"titanlab convert to-hf {ckpt} {dump / 'hf' / 'step-7'}" in summary
    assert f"  plot:        {dump / 'loss.png'}" in summary
    with open(dump / "loss.png", "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(head[16:20]) == WIDTH_PX
    assert int.from_bytes(head[20:24]) == HEIGHT_PX
    for message in MESSAGES:
        assert message not in out

    recs = read_jsonl(dump)
    # Logged: steps 1, 2, 4, 6 (log_freq 2), 3 and 6 (validation), 7 (the last).
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 6, 7]
    tokens = 2 * 2 * 64  # local batch 2 × 2 ranks × seq 64
    for r in recs:
        assert set(r) >= FIELDS, FIELDS - set(r)
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["tokens_per_step"] == tokens
        assert r["tps_total"] * r["step_time_ms"] / 1000 == pytest.approx(tokens, rel=0.02)
        assert r["tps"] == pytest.approx(r["tps_total"] / 2)
        assert r["samples_per_s_total"] * r["step_time_ms"] / 1000 == pytest.approx(4, rel=0.02)
        assert r["step_time_ms_min"] <= r["step_time_ms"] <= r["step_time_ms_max"]
        assert 0 <= r["data_wait_ms"] <= r["step_time_ms"]
        assert r["rss_peak_gib"] >= r["rss_gib"] > 0 and r["cpu_util_pct"] > 0
    assert [r["steps_in_window"] for r in recs] == [1, 1, 1, 1, 2, 1]
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    assert all(
        r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in recs if "val_loss" in r
    )

    # A crash after step 7 that lost the step-7 checkpoint: the resumed run starts after step 6.
    shutil.rmtree(dump / "checkpoint" / "step-7")
    run_script(9, dump, tiny_dataset)
    recs = read_jsonl(dump)
    steps = [r["step"] for r in recs]
    # Step 7 (after the step-6 checkpoint) was dropped at the resume and is not a logging step
    # of the resumed run; 8 (log_freq) and 9 (the last) are new.
    assert steps == [1, 2, 3, 4, 6, 8, 9], steps
    assert len(set(steps)) == len(steps)
    assert tb_series(dump, "loss") == [(r["step"], pytest.approx(r["loss"])) for r in recs]
    runs = offline_runs(str(dump / "wandb"))
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    for run in runs:
        assert run["name"] == "obs" and run["tags"] == ["ci", "cpu"]
        assert run["config"]["training"]["steps"] in (7, 9)
        assert run["config"]["metrics"]["enable_wandb"] is True
    history = [h for run in runs for h in run["history"]]
    # W&B cannot take a step back: 7, sent before the crash, stays; the resumed run sends 8, 9.
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 6, 7, 8, 9]
    by_step = {r["step"]: r for r in recs}
    for h in history:
        if h["_step"] in by_step:
            assert h["loss"] == pytest.approx(by_step[h["_step"]]["loss"])
    assert history[-1]["tps_total"] == pytest.approx(by_step[9]["tps_total"])
    # MLflow, read back through its client from the store in the dump folder: one run across
    # the resume, the config as params, every logged step once, the summary and the plot.
    from mlflow.tracking import MlflowClient

    from titanlab.metrics.mlflow_sink import default_uri

    client = MlflowClient(tracking_uri=default_uri(str(dump)))
    (run,) = client.search_runs([client.get_experiment_by_name("titanlab").experiment_id])
    assert run.info.run_name == "obs" and run.info.status == "FINISHED"
    assert run.data.params["training.steps"] == "7" and run.data.params["model.name"] == "llama3"
    mlflow_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert sorted(mlflow_loss) == [1, 2, 3, 4, 6, 7, 8, 9]  # as W&B: 7 was sent before the crash
    assert mlflow_loss[9] == pytest.approx(by_step[9]["loss"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"loss.png",
                                                                       "run_summary.txt"}  # fmt: skip
    text = client.download_artifacts(run.info.run_id, "run_summary.txt", str(tmp_path))
    with open(text, encoding="utf-8") as f:
        assert "→ 9" in f.read()
