"""Weights & Biases tracking (`metrics.enable_wandb`), written by rank 0 only.

The run id lives in `<dump_folder>/wandb/titanlab_run.json` with the last step sent, so a
resumed run continues the same W&B run (`wandb.init(id=..., resume="allow")`) and never sends a
step twice: steps at or before the last one sent are skipped (W&B keeps a run's steps strictly
increasing and would drop them anyway; a deterministic resumed run recomputes the same values).
Offline runs are written under `<dump_folder>/wandb/offline-run-*`; `wandb sync` uploads them.
Docs: https://docs.wandb.ai/ref/python/init and https://docs.wandb.ai/guides/runs/resuming
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
import socket
from typing import Any, Literal

from titanlab.data.prepare import write_json_atomic

logger = logging.getLogger(__name__)

_HOST = "api.wandb.ai"


def resolve_mode(mode: str) -> Literal["online", "offline"]:
    """`online` or `offline` for `metrics.wandb_mode`. `auto`: $WANDB_MODE when set, else online
    when an API key is configured ($WANDB_API_KEY or ~/.netrc) and api.wandb.ai answers on port
    443 within 2 s, else offline."""
    env = os.environ.get("WANDB_MODE", "")
    for chosen in (mode, env if mode == "auto" else ""):
        if chosen == "online":
            return "online"
        if chosen == "offline":
            return "offline"
    if not (os.environ.get("WANDB_API_KEY") or _netrc_has_key()):
        return "offline"
    try:
        socket.create_connection((_HOST, 443), timeout=2).close()
    except OSError:
        return "offline"
    return "online"


def _netrc_has_key() -> bool:
    try:
        return netrc.netrc().authenticators(_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbSink:
    """Sends each metrics record to one W&B run.

    Args:
        dump_folder: the job's dump folder (W&B's files and the run-id file go under `wandb/`).
        project, run_name, tags, mode: from `[metrics]` (`mode` as in `resolve_mode`).
        config: the resolved job config as {section: {key: value}}, uploaded as the run's config.
        start_step: the step the run resumed from; 0 starts a new W&B run.

    Raises:
        ValueError: the wandb package is not installed (one line naming the extra).
    """

    def __init__(
        self,
        *,
        dump_folder: str,
        project: str,
        run_name: str,
        tags: list[str],
        mode: str,
        config: dict[str, Any],
        start_step: int,
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError(
                "metrics.enable_wandb=true needs the wandb package; pip install 'titanlab[wandb]'"
            ) from None
        folder = os.path.join(dump_folder, "wandb")
        os.makedirs(folder, exist_ok=True)
        self._state_path = os.path.join(folder, "titanlab_run.json")
        self._state = self._read_state() if start_step > 0 else self._new_state()
        resolved = resolve_mode(mode)
        self._run = wandb.init(
            project=project,
            name=run_name or os.path.basename(os.path.abspath(dump_folder)),
            id=self._state["id"],
            resume="allow",
            dir=dump_folder,
            tags=tags,
            config=config,
            mode=resolved,
            # No console capture (the terminal's last line stays titanlab's), no exit banner.
            settings=wandb.Settings(console="off", quiet=True, silent=True),
        )
        self._write_state()
        logger.info("wandb: run %s (%s) in %s", self._state["id"], resolved, folder)

    def _read_state(self) -> dict[str, Any]:
        try:
            with open(self._state_path, encoding="utf-8") as f:
                state = json.load(f)
            if isinstance(state.get("id"), str) and isinstance(state.get("last_step"), int):
                return state
        except (OSError, json.JSONDecodeError):
            pass
        return self._new_state()

    @staticmethod
    def _new_state() -> dict[str, Any]:
        return {"id": secrets.token_hex(4), "last_step": 0}

    def _write_state(self) -> None:
        write_json_atomic(self._state_path, self._state)

    def write(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        if step <= self._state["last_step"]:
            return
        self._run.log({k: v for k, v in rec.items() if k != "step"}, step=step)
        self._state["last_step"] = step
        self._write_state()

    def close(self) -> None:
        self._run.finish()
