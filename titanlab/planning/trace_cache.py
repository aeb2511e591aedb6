"""Activation traces kept on disk, shared by the processes of one machine.

The pre-flight runs in the launcher and again in every rank (`titanlab.planning.preflight`),
and each traces the same model on fake tensors (`activation_memory.trace_activation_bytes`: a
second or so per AC mode at the 8B shapes, several when the blocks are compiled). Kept here,
the ranks of a node read what the launcher's pre-flight traced, or what the first of them
traced: the others wait on a file lock meanwhile rather than repeat it. A later run of the same
shapes (a resume, another layout with the same local batch) reads it too.

An entry is named by its arguments, the torch version and a fingerprint of titanlab's own
source, so an edit to any module traces anew. Entries are JSON written atomically (a temporary
file renamed), and one that does not parse is traced again; a folder that cannot be written
leaves every trace to be computed, never a run to fail.

Where: `$TITANLAB_TRACE_CACHE`; "off" (or "0") turns it off. By default a folder of this
machine's temporary directory (`/tmp/titanlab-traces-<uid>`), not `~/.cache`, which clusters
often share over NFS, where file locks are not dependable (torch Inductor's cache defaults to
`/tmp/torchinductor_<user>` likewise).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from titanlab.data.prepare import write_json_atomic

ENV = "TITANLAB_TRACE_CACHE"
_OFF = ("off", "0")
_FINGERPRINT: str | None = None


def cache_dir() -> str | None:
    """The cache folder, or None when `$TITANLAB_TRACE_CACHE` turns it off."""
    where = os.environ.get(ENV, "")
    if where.lower() in _OFF:
        return None
    if where:
        return where
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"titanlab-traces-{uid}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def source_fingerprint() -> str:
    """SHA-256 of titanlab's Python sources (path and bytes of each) and the versions of torch
    and torchao (float8's emulated layers are traced): what a trace's result can depend on
    besides its arguments. Computed once per process (~2.5 MB read)."""
    global _FINGERPRINT
    if _FINGERPRINT is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        versions = f"torch {torch.__version__} torchao {_version('torchao')}"
        digest = hashlib.sha256(versions.encode())
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
        _FINGERPRINT = digest.hexdigest()
    return _FINGERPRINT


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remembered(key: str, compute: Callable[[], Any]) -> Any:
    """`compute()`'s JSON-serializable result for `key`, computed once per machine: read from
    the cache when there, else computed under the key's lock (a process that asks meanwhile
    waits, then reads it) and written. Without a usable cache folder, computed each time.

    Args:
        key: everything the result depends on besides titanlab's source and the torch and
            torchao versions (`source_fingerprint`, added), as a string.
        compute: returns a bool, a number, a string, or lists / dicts of them (not None).
    Returns:
        `compute()`'s value, or the cached copy of it (tuples come back as lists).
    """
    folder = cache_dir()
    if folder is None:
        return compute()
    name = hashlib.sha256(f"{source_fingerprint()}\n{key}".encode()).hexdigest()[:32]
    path = os.path.join(folder, name + ".json")
    cached = _read(path)
    if cached is not None:
        return cached
    try:
        os.makedirs(folder, exist_ok=True)
        lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a folder that cannot be written: no cache
        return compute()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when this process dies
        cached = _read(path)  # traced by the process that held the lock before
        if cached is not None:
            return cached
        value = compute()
        with contextlib.suppress(OSError):
            write_json_atomic(path, {"value": value})
        return value
    finally:
        os.close(lock)
