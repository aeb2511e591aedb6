"""A user error costs one line, the last one on stderr, through the user's entry point.

Each case runs `run_train.sh`: errors the pre-flight check finds before launch (bad data, a
missing checkpoint step) and errors raised inside a rank under torchrun (a diverged loss, a
checkpoint whose loader state is a pickle), which `titanlab.resilience.launcher` reports last, with
torchrun's traceback kept in `<dump_folder>/logs/launcher-*.log` and the rank's exit code.
"""

import json
import os
import pickle
import shutil
import subprocess

import pytest

from conftest import CONSTANT_LR, REPO, TINY, checkpoint_every, read_metrics

CKPT = checkpoint_every(1)


def run_script(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NGPU=str(nproc), OMP_NUM_THREADS="1")
    return subprocess.run(
        [os.path.join(REPO, "run_train.sh"), *TINY, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_last_line(proc: subprocess.CompletedProcess, code: int, text: str) -> list[str]:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert lines and lines[-1].startswith("titanlab: error:") and text in lines[-1], lines[-5:]
    assert sum(line.startswith("titanlab: error:") for line in lines) == 1, lines
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    return lines


@pytest.fixture
def broken_data(tiny_dataset, tmp_path):
    """make(kind) → a copy of the tiny dataset with a truncated shard or a corrupt metadata.json."""

    def make(kind: str) -> str:
        out = str(tmp_path / kind)
        shutil.copytree(tiny_dataset, out)
        if kind == "truncated":
            shard = sorted(f for f in os.listdir(out) if f.endswith(".bin"))[0]
            with open(os.path.join(out, shard), "r+b") as f:
                f.truncate(1001)
        else:
            with open(os.path.join(out, "metadata.json"), "w") as f:
                f.write('{"dtype": "uint16", "shards": [')
        return out

    return make


@pytest.mark.parametrize("case", ["missing_dataset", "truncated", "corrupt_metadata", "load_step"])
def test_preflight_errors_are_one_line(case, broken_data, tmp_path):
    dump = tmp_path / "out"
    args = {
        "missing_dataset": ["--data.dataset_path", str(tmp_path / "nowhere")],
        "truncated": ["--data.dataset_path", broken_data("truncated")],
        "corrupt_metadata": ["--data.dataset_path", broken_data("corrupt")],
        "load_step": ["--checkpoint.enable", "true", "--checkpoint.load_step", "7"],
    }[case]
    proc = run_script(2, *args, "--job.dump_folder", str(dump))
    text = {
        "missing_dataset": "is not a directory",
        "truncated": "has 1001 bytes",
        "corrupt_metadata": "is not valid JSON",
        "load_step": "checkpoint.load_step=7",
    }[case]
    lines = assert_last_line(proc, 2, text)
    assert len(lines) == 1 and not dump.exists()  # refused before launch, nothing written


def test_diverged_loss_in_a_rank_is_the_last_line_with_exit_3(tiny_dataset, tmp_path):
    dump = tmp_path / "run"
    proc = run_script(
        2,
        "--data.dataset_path",
        tiny_dataset,
        "--training.steps",
        "8",
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        *CKPT,
        "--job.dump_folder",
        str(dump),
    )
    lines = assert_last_line(proc, 3, "loss is")
    # The line names the step that diverged and the newest checkpoint, one step before it.
    bad_step = max(read_metrics(str(dump))) + 1
    assert f"at step {bad_step};" in lines[-1]
    assert f"last complete checkpoint: {dump / 'checkpoint' / f'step-{bad_step - 1}'}" in lines[-1]
    assert lines[-2].startswith("titanlab: launcher report (torchrun's traceback): ")
    log = lines[-2].split(": ", 2)[-1]
    assert log.startswith(str(dump / "logs")) and "ChildFailedError" in open(log).read()


class _Payload:
    """Unpickling this runs `open(marker, "w")`: what a malicious checkpoint would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_loader_state_is_refused_in_the_rank_without_running_it(tiny_dataset, tmp_path):
    """A checkpoint whose loader state is a pickle (old format, or a malicious one) is refused
    with one line and exit 2, and the pickle is never loaded."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    data = ["--data.dataset_path", tiny_dataset, *CONSTANT_LR, *CKPT]
    dump = tmp_path / "run"
    assert (
        run_script(1, *data, "--training.steps", "2", "--job.dump_folder", str(dump)).returncode
        == 0
    )
    flat = str(tmp_path / "flat.pt")
    dcp_to_torch_save(str(dump / "checkpoint" / "step-2"), flat)
    state = torch.load(flat, weights_only=False)
    marker = str(tmp_path / "code-ran")
    state["dataloader"]["dp_rank_0"] = pickle.dumps(_Payload(marker))
    torch.save(state, flat)
    forged = tmp_path / "forged"
    torch_save_to_dcp(flat, str(forged / "checkpoint" / "step-2"))
    proc = run_script(1, *data, "--training.steps", "4", "--job.dump_folder", str(forged))
    assert_last_line(proc, 2, "is not plain data")
    assert not os.path.exists(marker)  # the pickle never ran


def test_document_mask_on_data_without_eos_is_one_line(tiny_dataset, tmp_path):
    """A dataset whose EOS id never occurs (the tiny dataset's shards under a metadata.json
    naming an id the text never contains) cannot be document-masked."""
    with open(os.path.join(tiny_dataset, "metadata.json")) as f:
        meta = json.load(f)
    fake = tmp_path / "no_eos"
    fake.mkdir()
    for shard in meta["shards"]:
        os.symlink(os.path.join(tiny_dataset, shard["file"]), fake / shard["file"])
    meta["eos_id"] = 4351  # the last reserved special token: never in prepared text
    (fake / "metadata.json").write_text(json.dumps(meta))
    proc = run_script(1, "--data.dataset_path", str(fake), "--data.document_mask", "true",
                      "--job.dump_folder", str(tmp_path / "run"))  # fmt: skip
    assert_last_line(proc, 2, "data.document_mask=true but data.dataset_path=")
    assert "has no EOS token (id 4351)" in proc.stderr.strip().splitlines()[-1]


def test_an_unsorted_mixture_schedule_is_one_line(tiny_dataset, tmp_path):
    sources = f'[{{path = "{tiny_dataset}", name = "a"}}, {{path = "{tiny_dataset}", name = "b"}}]'
    schedule = "[{step = 50, weights = [1, 1]}, {step = 10, weights = [1, 0]}]"
    proc = run_script(1, "--data.sources", sources, "--data.schedule", schedule,
                      "--job.dump_folder", str(tmp_path / "run"))  # fmt: skip
    assert_last_line(
        proc, 2, "data.schedule is not sorted by step: step 10 (point 1) after step 50"
    )
