"""Checkpoint folders: step listing and telling complete DCP checkpoints from cut-off ones."""

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titanlab.checkpoint import store


def state_dict(step: int) -> dict:
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4) * step, "b": torch.ones(4)},
        "optimizer": {"step": torch.tensor(float(step))},
        "train_state": {"step": step},
    }


def save(root, step: int) -> str:
    """Write a small single-process DCP checkpoint at `<root>/step-<step>`."""
    path = store.step_dir(str(root), step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is ... uninitialized"
        dcp.save(state_dict(step), checkpoint_id=path, no_dist=True)
    return path


def data_files(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    assert files, f"no .distcp file in {path}"
    return [os.path.join(path, f) for f in files]


@pytest.fixture
def ckpt(tmp_path):
    save(tmp_path, 5)
    return save(tmp_path, 10)


def test_step_dir(tmp_path):
    assert store.step_dir(str(tmp_path), 42) == os.path.join(str(tmp_path), "step-42")


def test_complete_checkpoint_has_no_reason(tmp_path, ckpt):
    assert store.incomplete_reason(ckpt) is None
    assert store.incomplete_reason(str(tmp_path / "step-5")) is None


def test_missing_metadata(ckpt):
    os.remove(os.path.join(ckpt, ".metadata"))
    assert store.incomplete_reason(ckpt) == "no .metadata (the write did not finish)"


def test_missing_folder(tmp_path):
    assert store.incomplete_reason(str(tmp_path / "step-99")) == "it does not exist"


def test_a_folder_without_dcp_files_is_not_a_checkpoint(tmp_path, ckpt):
    """Never a checkpoint (no .metadata, no .distcp file) is not a write that did not finish;
    a run's folder names the checkpoints below it."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    assert store.incomplete_reason(str(tmp_path / "other")) == (
        "it is not a DCP checkpoint: it holds 1 file(s), none of them DCP's (a checkpoint "
        "folder has a .metadata and *.distcp data files, e.g. <dump_folder>/checkpoint/step-N)"
    )
    assert store.incomplete_reason(str(tmp_path)) == (
        "it is not a DCP checkpoint but holds some (step-5, step-10): give one of those folders"
    )


def test_unreadable_metadata(ckpt):
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    reason = store.incomplete_reason(ckpt)
    assert reason.startswith("unreadable .metadata (")


def test_truncated_data_file(ckpt):
    data = data_files(ckpt)[0]
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    name = os.path.basename(data)
    assert store.incomplete_reason(ckpt) == (
        f"data file {name} is truncated ({size - 1} of {size} bytes)"
    )


def test_empty_data_file(ckpt):
    data = data_files(ckpt)[0]
    size = os.path.getsize(data)
    open(data, "wb").close()
    assert store.incomplete_reason(ckpt) == (
        f"data file {os.path.basename(data)} is truncated (0 of {size} bytes)"
    )


def test_missing_data_file(ckpt):
    data = data_files(ckpt)[0]
    os.remove(data)
    assert store.incomplete_reason(ckpt) == f"data file {os.path.basename(data)} is missing"


def test_list_steps_ignores_other_names(tmp_path, ckpt):
    for name in ("step-7.tmp", "export-step-3", "step-", "step-x", "Step-4", "tb"):
        (tmp_path / name).mkdir()
    assert store.list_steps(str(tmp_path)) == [5, 10]


def test_list_steps_sorts_numerically(tmp_path):
    for step in (100, 9, 20):
        (tmp_path / f"step-{step}").mkdir()
    assert store.list_steps(str(tmp_path)) == [9, 20, 100]


def test_list_steps_missing_root(tmp_path):
    assert store.list_steps(str(tmp_path / "nothing")) == []


def test_saved_keys_are_flattened(ckpt):
    assert store.saved_keys(ckpt) == {"model.w", "model.b", "optimizer.step", "train_state.step"}


def test_saved_checkpoint_loads_back(ckpt):
    target = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=ckpt, no_dist=True)
    torch.testing.assert_close(target["model"]["w"], torch.arange(12.0).reshape(3, 4) * 10)


def test_remove(ckpt):
    store.remove(ckpt)
    assert not os.path.exists(ckpt)
    store.remove(ckpt)  # removing twice is fine
