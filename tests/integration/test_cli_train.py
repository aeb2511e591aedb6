"""`titanlab train` launches what run_train.sh launches: torchrun after the pre-flight check,
from the user's folder, a shipped config named from anywhere, and exit code 75 after SIGTERM
(the step finished, a checkpoint saved). The steps are in titanlab/resilience/run_train.py;
test_faults.py drives the same preemption through run_train.sh.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import CONSTANT_LR, REPO, wait_for
from titanlab.checkpoint import store


def logged_steps(dump: str) -> list[int]:
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


@pytest.mark.cover("launch:titanlab-train", "launch:torchrun")
def test_sigterm_to_titanlab_train_saves_the_step_and_exits_75(tiny_dataset, tmp_path):
    dump = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "titanlab.cli", "train", "train_configs/debug_model.toml",
           "--training.steps", "40", "--training.seq_len", "64",
           "--training.local_batch_size", "2", "--metrics.log_freq", "1",
           "--validation.enable", "false", "--checkpoint.interval", "100",
           "--checkpoint.keep_latest_k", "0", "--checkpoint.export_at_end", "false",
           "--data.dataset_path", tiny_dataset, "--job.dump_folder", dump, *CONSTANT_LR]  # fmt: skip
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for(lambda: len(logged_steps(dump)) >= 3 or run.poll() is not None)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 75, out[-2000:] + err[-2000:]
    stopped = max(logged_steps(dump))
    assert 3 <= stopped < 40
    assert err.strip().splitlines()[-1] == (
        f"titanlab train: preempted after step {stopped}; exit 75 to requeue"
    )
    assert store.incomplete_reason(os.path.join(dump, "checkpoint", f"step-{stopped}")) is None
    assert "pre-flight: ws2-fsdp2 passes" in out  # the check ran before torchrun, with NGPU ranks
    assert os.path.join(REPO, "train_configs", "debug_model.toml") in out  # found from tmp_path
