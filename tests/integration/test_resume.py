"""Resume is exact, and a checkpoint cut off mid-write is never loaded."""

import os

import pytest

from conftest import CONSTANT_LR, checkpoint_every, read_metrics

CKPT = checkpoint_every(5, "--checkpoint.keep_latest_k", "0")


@pytest.fixture
def train(train):
    """conftest's `train` on the 2-layer debug flavor: what a resume restores does not depend on
    the depth, and the 6-layer model's checkpoints and steps only cost CI time."""

    def run(nproc: int, *overrides: str, dump: str | None = None):
        return train(nproc, "--model.flavor", "debugmodel_tiny", *overrides, dump=dump)

    return run


def test_resume_is_bitwise_exact(train, tmp_path):
    straight = str(tmp_path / "straight")
    train(2, "--training.steps", "20", *CONSTANT_LR, *CKPT, dump=straight).check()
    resumed = str(tmp_path / "resumed")
    first = train(2, "--training.steps", "10", *CONSTANT_LR, *CKPT, dump=resumed).check()
    second = train(2, "--training.steps", "20", *CONSTANT_LR, *CKPT, dump=resumed).check()
    assert "loaded" in second.stdout and "step-10" in second.stdout
    assert sorted(second.losses) == list(range(11, 21))  # it continued, not restarted
    want, got = read_metrics(straight), read_metrics(resumed)
    assert [got[s] for s in range(1, 21)] == [want[s] for s in range(1, 21)]  # bitwise
    assert first.returncode == 0


def _truncate_one_data_file(path: str) -> None:
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    victim = os.path.join(path, data[0])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)


def test_cut_off_checkpoint_is_skipped(train, tmp_path):
    dump = str(tmp_path / "run")
    full = train(2, "--training.steps", "10", *CONSTANT_LR, *CKPT, dump=dump).check()
    ckpt = os.path.join(dump, "checkpoint")
    _truncate_one_data_file(os.path.join(ckpt, "step-10"))  # a write that died half-way
    again = train(2, "--training.steps", "10", *CONSTANT_LR, *CKPT, dump=dump).check()
    assert "skipping incomplete" in again.stdout and "truncated" in again.stdout
    assert "step-5" in again.stdout
    # It went back to step 5 and retrained 6..10 to the same losses.
    assert sorted(again.losses) == list(range(6, 11))
    assert all(again.losses[s] == full.losses[s] for s in range(6, 11))


def test_checkpoint_without_metadata_is_skipped(train, tmp_path):
    dump = str(tmp_path / "run")
    train(2, "--training.steps", "10", *CONSTANT_LR, *CKPT, dump=dump).check()
    os.remove(os.path.join(dump, "checkpoint", "step-10", ".metadata"))
    again = train(2, "--training.steps", "10", *CONSTANT_LR, *CKPT, dump=dump).check()
    assert "skipping incomplete" in again.stdout and ".metadata" in again.stdout
    assert min(again.losses) == 6


def test_async_checkpoints_resume_exactly_and_keep_latest_k(train, tmp_path):
    ckpt = [
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.keep_latest_k",
        "2",
        "--checkpoint.export_dtype",
        "bfloat16",
    ]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(2, "--training.steps", "6", *CONSTANT_LR, *ckpt, dump=straight).check()
    train(2, "--training.steps", "4", *CONSTANT_LR, *ckpt, dump=resumed).check()
    again = train(2, "--training.steps", "6", *CONSTANT_LR, *ckpt, dump=resumed).check()
    assert "background write of step 6 finished" in again.stdout
    assert [read_metrics(resumed)[s] for s in (5, 6)] == [read_metrics(straight)[s] for s in (5, 6)]
    # keep_latest_k=2: only the two newest full checkpoints remain; exports are kept apart.
    folders = sorted(os.listdir(os.path.join(resumed, "checkpoint")))
    assert folders == ["export-step-4", "export-step-6", "step-4", "step-6"]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(resumed, "checkpoint", "export-step-6")).read_metadata()
    wq = meta.state_dict_metadata["model.layers.0.attention.wq.weight"]
    assert str(wq.properties.dtype) == "torch.bfloat16"
    assert not any(k.startswith("optimizer") for k in meta.state_dict_metadata)


def test_initial_weights_load_with_checkpointing_off(train, tmp_path):
    """`checkpoint.initial_load_path` is the run's starting point whether or not the run saves
    checkpoints (it was once silently ignored with `checkpoint.enable = false`)."""
    trained = str(tmp_path / "trained")
    train(1, "--training.steps", "6", *CKPT, dump=trained).check()
    start = os.path.join(trained, "checkpoint", "step-5")
    on = train(1, "--training.steps", "1", "--checkpoint.initial_load_path", start).check()
    off = train(1, "--training.steps", "1", "--checkpoint.initial_load_path", start,
                "--checkpoint.enable", "false").check()  # fmt: skip
    assert "loaded" in off.stdout and off.losses == on.losses
    fresh = train(1, "--training.steps", "1", "--checkpoint.enable", "false").check()
    assert fresh.losses[1] - on.losses[1] > 0.1  # the 5 trained steps show
