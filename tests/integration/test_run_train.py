"""The user's entry point, run_train.sh: pre-flight refusal and real runs."""

import os
import subprocess
import sys

import pytest

from conftest import REPO


def run_script(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_8b_on_cpu_fails_fast_with_one_line(tmp_path):
    dump = tmp_path / "out"
    proc = run_script(
        "train_configs/llama_8b.toml", "--training.steps", "1", "--job.dump_folder", str(dump)
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("titanlab: error: model.flavor=8B needs about")
    assert "GiB per rank" in lines[0] and "debugmodel" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not dump.exists()  # nothing written


@pytest.mark.cover("launch:run_train.sh")
def test_8b_config_runs_with_debugmodel(tmp_path, tiny_dataset):
    proc = run_script(
        "train_configs/llama_8b.toml",
        "--training.steps",
        "1",
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "1024",
        "--data.dataset_path",
        tiny_dataset,
        "--checkpoint.enable",
        "false",
        "--compile.enable",
        "false",  # the preset compiles; tested in test_compile
        "--job.dump_folder",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step: 1  loss:" in proc.stdout
    # The config's own settings were used: the compact config names them.
    assert 'activation_checkpoint: mode="selective"' in proc.stdout
    assert 'checkpoint: keep_latest_k=3, async_mode="async"' in proc.stdout


def test_bad_option_is_one_line_before_launch(tmp_path):
    proc = run_script("--training.stepz", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "titanlab: error: unknown config key training.stepz; did you mean 'training.steps'?"
    )


def test_help_lists_options():
    proc = subprocess.run(
        [sys.executable, "-m", "titanlab.train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "--training.local_batch_size (int, default: 8)" in proc.stdout
    assert "--lr_scheduler.decay_type (linear | cosine | sqrt, default: 'linear')" in proc.stdout


def test_seed_checkpoint_gives_every_layout_the_same_start(train, tmp_path):
    seed_dump = str(tmp_path / "seed")
    made = train(
        1, "--checkpoint.create_seed_checkpoint", "true", "--debug.seed", "7", dump=seed_dump
    ).check()
    assert "seed checkpoint written" in made.stdout and made.losses == {}
    seed = os.path.join(seed_dump, "checkpoint", "step-0")
    start = [
        "--training.steps",
        "2",
        "--checkpoint.initial_load_path",
        seed,
        "--checkpoint.export_at_end",
        "false",
    ]
    one = train(1, *start, "--training.local_batch_size", "4").check()
    two = train(2, *start, "--training.local_batch_size", "2").check()
    assert "model only" in one.stdout and "model only" in two.stdout
    assert all(abs(one.losses[s] - two.losses[s]) < 1e-5 for s in (1, 2))
    # The seed's weights (init seed 7) were used, not this run's own seed-0 init.
    fresh = train(1, "--training.steps", "2", "--training.local_batch_size", "4").check()
    assert abs(one.losses[1] - fresh.losses[1]) > 1e-3
