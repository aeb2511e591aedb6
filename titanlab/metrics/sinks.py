"""Where metric records go besides the log line: `metrics.jsonl` and TensorBoard.

Both continue the same curve across a resume: records of steps after the step the run resumed
from (written before a crash, and about to be written again) are dropped at start-up.
"""

from __future__ import annotations

import json
import os
from typing import Any


class JsonlSink:
    """Appends each record as one JSON line (floats round-trip exactly).

    At start-up the file keeps only the records of steps `<= start_step` (a partial last line
    from a killed run is dropped too); the rewrite is atomic (a temporary file, then rename)."""

    def __init__(self, path: str, start_step: int) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            kept = []
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(rec, dict) and rec.get("step", 0) <= start_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """Scalars under `tb_dir`, one tag per numeric key. The writer starts with a purge marker at
    `start_step + 1`, so TensorBoard hides events of later steps from earlier runs in the folder
    (`SummaryWriter(purge_step=...)`).

    Raises:
        ValueError: the tensorboard package is not installed (one line naming the extra).
    """

    def __init__(self, tb_dir: str, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(
                "metrics.enable_tensorboard=true needs the tensorboard package; "
                "pip install 'titanlab[tensorboard]'"
            ) from None
        self._w = SummaryWriter(tb_dir, purge_step=start_step + 1)

    def write(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()
