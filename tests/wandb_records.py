"""Read an offline W&B run file (`offline-run-*/run-<id>.wandb`) back, for tests.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version), then
LevelDB-log-format records in 32 KiB blocks (4-byte CRC, 2-byte length, 1-byte type: full,
first, middle, last), each payload one `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from typing import Any

_BLOCK, _HEADER = 32768, 7


def _payloads(path: str):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, buf = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        buf += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # full or last fragment
            yield buf
            buf = b""


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str) -> dict[str, Any]:
    """{"id", "name", "project", "tags", "config" ({key: value}), "history" ([{key: value}]),
    "exited" (the run's exit record is written)}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"config": {}, "history": [], "exited": False}
    for payload in _payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.update(id=r.run_id, name=r.display_name, project=r.project, tags=list(r.tags))
            out["config"].update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "config":
            out["config"].update({_key(i): json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "exit":
            out["exited"] = True
    return out


def offline_runs(wandb_dir: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Every offline run under `wandb_dir`, oldest first (by when its file was last written:
    runs started in the same second share a folder-name prefix)."""
    files = sorted(
        glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb")), key=os.path.getmtime
    )
    # W&B's service process may still be writing a finished run's file: wait for its exit record.
    end = time.time() + timeout
    while True:
        try:
            runs = [read_run(f) for f in files]
        except Exception:  # a record cut mid-write
            if time.time() > end:
                raise
            runs = []
        if (runs and all(r["exited"] for r in runs)) or time.time() > end:
            return runs
        time.sleep(0.2)
