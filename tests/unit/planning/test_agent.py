"""The pre-flight check inside torchrun's agent (`titanlab.planning.agent`, started by
`titanlab.launcher --preflight`, as run_train.sh and `titanlab train` do): a refused config is
one line and its exit code, with nothing written and no rank started."""

import os
import subprocess
import sys

from titanlab.resilience.launcher import _nproc_per_node

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def launch(tmp_path, nproc: str, *trainer_args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlab.launcher", "--preflight", f"--nproc_per_node={nproc}",
           "-m", "titanlab.train", "--job.config_file", "train_configs/debug_model.toml",
           "--job.dump_folder", str(tmp_path / "out"), *trainer_args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_refused_config_is_one_line_and_writes_nothing(tmp_path):
    proc = launch(tmp_path, "2", "--training.steps", "0")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["titanlab: error: training.steps=0 must be >= 1"]
    assert not (tmp_path / "out").exists()  # no launcher log: the check ran before torchrun
    assert "[rank" not in proc.stdout + proc.stderr


def test_a_bad_process_count_is_the_checks_line(tmp_path):
    """NGPU=two reaches the check as given, which names it (torchrun never parses it)."""
    proc = launch(tmp_path, "two")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.splitlines() == [
        "titanlab: error: --nproc='two' must be a whole number >= 1"
    ]


def test_the_process_count_is_read_as_torchrun_spells_it():
    assert _nproc_per_node(["--nproc_per_node=4", "-m", "x"]) == "4"
    assert _nproc_per_node(["--nproc-per-node", "3", "-m", "x"]) == "3"
    assert _nproc_per_node(["--standalone", "-m", "x"]) == "1"
