"""`Checkpointer._after_complete`: once a step's checkpoint is complete, the folders of earlier
steps whose write never finished are removed (a group that recovered a later step from a live
peer, or a run resumed past them, would leave them on disk for ever: `keep_latest_k` counts
complete checkpoints only); later ones, and complete ones that `keep_latest_k` keeps, stay."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp

from titanlab.checkpoint import Checkpointer, store


def _complete(root: str, step: int) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=store.step_dir(root, step))


def _half_written(root: str, step: int) -> None:
    path = store.step_dir(root, step)
    os.makedirs(path)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"cut off")  # data, but no .metadata: the write did not finish


def _after_complete(root: str, step: int, keep_latest_k: int) -> list[int]:
    fake = SimpleNamespace(rank=0, root=root, cfg=SimpleNamespace(keep_latest_k=keep_latest_k))
    Checkpointer._after_complete(fake, step)  # type: ignore[arg-type]
    return store.list_steps(root)


def test_an_earlier_half_written_step_is_removed_once_a_later_one_completes(tmp_path):
    root = str(tmp_path)
    _complete(root, 2)
    _half_written(root, 3)  # killed while writing step 3, then recovered step 4 from a peer
    _complete(root, 5)
    _half_written(root, 7)  # later than the step just completed: not this one's to judge
    assert _after_complete(root, 5, keep_latest_k=0) == [2, 5, 7]


def test_keep_latest_k_still_counts_only_complete_checkpoints(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 4):
        _complete(root, step)
    _half_written(root, 3)
    assert _after_complete(root, 4, keep_latest_k=2) == [2, 4]
