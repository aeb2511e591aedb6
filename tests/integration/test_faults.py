"""Faults during training: preemption, a killed rank, a hung rank. Nothing is lost.

Each test drives the user's entry point (run_train.sh, which runs torchrun) and injects the fault
from outside with real signals, as a scheduler or a dying node would.
"""

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import CONSTANT_LR, REPO, read_metrics, run_config, wait_for, worker_pid
from titanlab.checkpoint import store


def start_args(tiny_dataset, dump) -> list[str]:
    """The options every run of this module uses (after the config file): the 2-layer debug
    flavor (what a fault does to a run does not depend on its depth; the 6-layer model's
    checkpoints and steps only cost CI time)."""
    return [
        "--model.flavor",
        "debugmodel_tiny",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--validation.enable",
        "false",
        "--debug.deterministic",
        "true",
        "--checkpoint.enable",
        "true",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.export_at_end",
        "false",
        "--data.dataset_path",
        tiny_dataset,
        "--job.dump_folder",
        dump,
        *CONSTANT_LR,
    ]


def start(
    tiny_dataset, dump, *extra, env_extra=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE
):
    """`run_train.sh train_configs/debug_model.toml` on 2 ranks, as a user starts it."""
    env = dict(os.environ, NGPU="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = [
        os.path.join(REPO, "run_train.sh"),
        "train_configs/debug_model.toml",
        *start_args(tiny_dataset, dump),
        *extra,
    ]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)


@pytest.fixture(scope="module")
def straight(tiny_dataset, tmp_path_factory):
    """Exact losses of an uninterrupted 20-step run (the constant LR makes them independent of
    training.steps and of where checkpoints are taken), trained on warm ranks: the faults are
    injected into the runs the tests launch with run_train.sh."""
    dump = str(tmp_path_factory.mktemp("straight"))
    run_config("train_configs/debug_model.toml", *start_args(tiny_dataset, dump), "--training.steps",
               "20", "--checkpoint.interval", "10").check()  # fmt: skip
    return read_metrics(dump)


def logged_steps(dump):
    path = os.path.join(dump, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_sigterm_saves_current_step_exits_75_and_resumes_exactly(tiny_dataset, straight, tmp_path):
    preempted = str(tmp_path / "preempted")
    run = start(tiny_dataset, preempted, "--training.steps", "16", "--checkpoint.interval", "100")
    wait_for(lambda: len(logged_steps(preempted)) >= 4)
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == 75
    stopped = max(logged_steps(preempted))
    assert 4 <= stopped < 16
    assert store.incomplete_reason(os.path.join(preempted, "checkpoint", f"step-{stopped}")) is None
    again = start(tiny_dataset, preempted, "--training.steps", "16", "--checkpoint.interval", "100")
    assert again.wait(timeout=600) == 0
    got = read_metrics(preempted)
    assert [got[s] for s in range(1, 17)] == [straight[s] for s in range(1, 17)]  # bitwise


@pytest.mark.cover("resume-kill9:disabled", "launch:run_train.sh", "launch:torchrun")
def test_killed_rank_restarts_group_and_finishes_with_same_losses(tiny_dataset, straight, tmp_path):
    killed = str(tmp_path / "killed")
    ckpt = ["--training.steps", "20", "--checkpoint.interval", "10"]
    run = start(tiny_dataset, killed, *ckpt, env_extra={"MAX_RESTARTS": "1", "LOG_RANK": "0,1"})
    step10 = os.path.join(killed, "checkpoint", "step-10")
    wait_for(lambda: os.path.isdir(step10) and store.incomplete_reason(step10) is None)
    os.kill(worker_pid(1, killed), signal.SIGKILL)
    out, err = run.communicate(timeout=600)
    with open(os.path.join(killed, "run_train.log"), "w") as f:  # kept for diagnosis
        f.write(out + "\n---- stderr ----\n" + err)
    assert run.returncode == 0, err[-6000:]
    got = read_metrics(killed)
    assert max(logged_steps(killed)) == 20
    assert [got[s] for s in range(11, 21)] == [straight[s] for s in range(11, 21)]


@pytest.mark.serial  # holds a wall-clock bound: the report within the timeout plus a margin
def test_hung_rank_fails_within_timeout_naming_rank_and_step(tiny_dataset, tmp_path):
    dump = str(tmp_path / "hung")
    timeout_s = 10
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        run = start(
            tiny_dataset,
            dump,
            "--training.steps",
            "400",
            "--checkpoint.interval",
            "5",
            "--comm.train_timeout_seconds",
            str(timeout_s),
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    step5 = os.path.join(dump, "checkpoint", "step-5")
    wait_for(lambda: os.path.isdir(step5) and store.incomplete_reason(step5) is None)
    hung = worker_pid(1, dump)
    os.kill(hung, signal.SIGSTOP)  # rank 1 stops taking part, as if stuck inside a step
    stopped_at = time.time()

    def rank_error_lines():
        # titanlab.resilience.launcher logs every stderr line as it comes (the terminal gets the error
        # line last, once torchrun has stopped the other ranks).
        logs = os.path.join(dump, "logs")
        texts = (
            [open(os.path.join(logs, f)).read() for f in sorted(os.listdir(logs))]
            if os.path.isdir(logs)
            else []
        )
        return [ln for t in texts for ln in t.splitlines() if "a collective timed out" in ln]

    try:
        wait_for(rank_error_lines, timeout=timeout_s + 60)
        reported_after = time.time() - stopped_at
    finally:
        try:
            os.kill(hung, signal.SIGKILL)  # torchrun would wait 30 s for the stopped rank to exit
        except ProcessLookupError:
            pass
    run.wait(timeout=120)
    assert run.returncode == 4, err_path.read_text()[-2000:]
    last = err_path.read_text().strip().splitlines()[-1]
    assert last.startswith("titanlab: error: rank 0: a collective timed out"), last
    line = rank_error_lines()[0]
    assert "titanlab: error: rank 0: a collective timed out at step " in line  # run_train.sh tees
    assert f"comm.train_timeout_seconds={timeout_s}" in line
    # The error came within the timeout plus a margin (the step in flight, and the logging) ...
    assert reported_after < timeout_s + 30, reported_after
    # ... and the last complete checkpoint is intact.
    steps = [
        s
        for s in store.list_steps(os.path.join(dump, "checkpoint"))
        if store.incomplete_reason(os.path.join(dump, "checkpoint", f"step-{s}")) is None
    ]
    assert steps and f"step-{steps[-1]}" in line
    assert os.path.exists(os.path.join(dump, "metrics.jsonl"))


# Imported by every Python process of the run through PYTHONPATH: when the checkpoint of the step
# named by $STALL_CHECKPOINT has all its data files written, the coordinator announces it and
# stalls before writing .metadata, so the test can kill the run mid-write deterministically.
STALL = textwrap.dedent("""
    import os
    if os.environ.get("STALL_CHECKPOINT"):
        import time
        from torch.distributed.checkpoint import filesystem
        finish = filesystem._FileSystemWriter.finish

        def stalled_finish(self, metadata, results):
            path = str(self.path)
            if os.path.basename(path) == os.environ["STALL_CHECKPOINT"]:
                open(path + ".stalled", "w").close()
                time.sleep(600)
            return finish(self, metadata, results)

        filesystem._FileSystemWriter.finish = stalled_finish
""")


def run_pids(dump: str) -> list[int]:
    """Every process of the run (run_train.sh, torchrun, the ranks): their command lines name `dump`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if dump.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.cover("resume-kill9:disabled")
def test_sigkill_while_checkpoint_is_written_resumes_from_previous_complete(
    tiny_dataset, straight, tmp_path
):
    dump, hook = str(tmp_path / "torn"), tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL)
    ckpt = ["--training.steps", "20", "--checkpoint.interval", "5"]
    run = start(
        tiny_dataset,
        dump,
        *ckpt,
        env_extra={"STALL_CHECKPOINT": "step-10", "PYTHONPATH": str(hook)},
    )
    step10 = os.path.join(dump, "checkpoint", "step-10")
    wait_for(lambda: os.path.exists(step10 + ".stalled"))
    for pid in run_pids(dump):  # the whole job dies at once, as when its node loses power
        os.kill(pid, signal.SIGKILL)
    run.wait(timeout=60)
    assert any(f.endswith(".distcp") for f in os.listdir(step10))  # data written, .metadata not
    assert store.incomplete_reason(step10) == "no .metadata (the write did not finish)"

    # the next run (on warm ranks: what it loads does not depend on its launch) skips the torn one
    again = run_config("train_configs/debug_model.toml", *start_args(tiny_dataset, dump), *ckpt)
    assert again.returncode == 0, again.stderr[-4000:]
    log = again.stdout + again.stderr
    assert f"skipping incomplete {step10}: no .metadata" in log, log[-4000:]
    assert f"checkpoint: loaded {os.path.join(dump, 'checkpoint', 'step-5')} (step 5)" in log
    assert store.incomplete_reason(step10) is None  # written again, completely
    got = read_metrics(dump)
    assert [got[s] for s in range(6, 21)] == [straight[s] for s in range(6, 21)]  # bitwise
