"""Checkpoint folders on disk: naming, finding them, and telling complete from cut-off ones.

A checkpoint of step N is the DCP folder `<root>/step-N`. It is complete when DCP's `.metadata`
file exists (the coordinator writes it, atomically, only after every rank finished writing its
data) and every data file that the metadata points into exists and is long enough. Anything else
— a run killed mid-write, a truncated or missing shard — is incomplete and is never loaded.
"""

from __future__ import annotations

import os
import re
import shutil

from torch.distributed.checkpoint import FileSystemReader

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(folder: str, dump_folder: str) -> str:
    """Where checkpoints live: `checkpoint.folder`, inside `job.dump_folder` when relative."""
    return folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)


def complete_steps(root: str) -> list[int]:
    """Steps under `root` whose checkpoint is complete, ascending."""
    return [s for s in list_steps(root) if incomplete_reason(step_dir(root, s)) is None]


def load_step_path(root: str, step: int) -> str:
    """Folder of the complete checkpoint of `step` (`checkpoint.load_step`) under `root`.
    Raises ConfigError (one line, listing the complete steps) when it is missing or incomplete."""
    from titanlab.config.errors import ConfigError

    path = step_dir(root, step)
    reason = incomplete_reason(path) if os.path.isdir(path) else "it does not exist"
    if reason:
        raise ConfigError(
            f"checkpoint.load_step={step}: {path} cannot be loaded: {reason}; "
            f"complete steps: {complete_steps(root)}"
        )
    return path


def step_dir(root: str, step: int) -> str:
    """Folder of the checkpoint of `step` under `root`."""
    return os.path.join(root, f"step-{step}")


def list_steps(root: str) -> list[int]:
    """Steps that have a checkpoint folder under `root` (complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    steps = [
        int(m.group(1))
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    ]
    return sorted(steps)


def incomplete_reason(path: str) -> str | None:
    """Why the DCP checkpoint at `path` cannot be loaded, or None when it is complete: a
    folder that does not exist, one that never held a checkpoint (no DCP file at all: see
    `not_a_checkpoint`), one whose write did not finish (data files but no `.metadata`), or a
    torn, missing or truncated file."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        if not os.path.isdir(path):
            return "it does not exist"
        names = os.listdir(path)
        if not any(n.endswith(".distcp") or n.startswith((".metadata", "__")) for n in names):
            return not_a_checkpoint(path, names)
        return "no .metadata (the write did not finish)"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # a torn or foreign .metadata file
        return f"unreadable .metadata ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for rel, end in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return f"data file {rel} is missing"
        size = os.path.getsize(file)
        if size < end:
            return f"data file {rel} is truncated ({size} of {end} bytes)"
    return None


def not_a_checkpoint(path: str, names: list[str]) -> str:
    """The reason for a folder holding no DCP file (`names` its entries): empty (a write that
    never started, or a new folder), or another kind of folder; when it holds checkpoints
    below it (a run's folder, its checkpoint/ folder), which ones to give instead."""
    below = [
        f"{prefix}step-{s}"
        for prefix, root in (("", path), ("checkpoint/", os.path.join(path, "checkpoint")))
        for s in list_steps(root)
    ]
    if below:
        listed = ", ".join(below[:3]) + (", ..." if len(below) > 3 else "")
        return f"it is not a DCP checkpoint but holds some ({listed}): give one of those folders"
    what = "it is empty" if not names else f"it holds {len(names)} file(s), none of them DCP's"
    return (
        f"it is not a DCP checkpoint: {what} (a checkpoint folder has a .metadata and "
        "*.distcp data files, e.g. <dump_folder>/checkpoint/step-N)"
    )


def saved_keys(path: str) -> set[str]:
    """Flattened state-dict keys stored in the complete checkpoint at `path`."""
    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
