"""MLflow tracking (`metrics.enable_mlflow`), written by rank 0 only.

One MLflow run per job: the resolved config as the run's params (`section.key`), every logged
record's numbers as metrics at their step, and at the end the run summary
(`run_summary.txt`) and `loss.png` as artifacts. By default the tracking store is a SQLite
file in the dump folder (`<dump_folder>/mlflow/mlflow.db`, artifacts beside it), which needs no
server; `metrics.mlflow_tracking_uri` names any other store or an `mlflow server`. MLflow 3
keeps its plain-folder store (`./mlruns`) in maintenance mode and refuses it unless
MLFLOW_ALLOW_FILE_STORE=true, so the default is SQLite, MLflow's own recommendation.

The run id lives in `<dump_folder>/mlflow/titanlab_run.json` with the last step sent, so a
resumed job continues the same MLflow run and never sends a step twice.
Docs: https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from typing import Any

from titanlab.config.errors import ConfigError
from titanlab.data.prepare import write_json_atomic

logger = logging.getLogger(__name__)

_MISSING = (
    "metrics.enable_mlflow=true needs the mlflow-skinny package; pip install 'titanlab[mlflow]'"
)
_BATCH = 100  # MLflow's limit of params per log_batch call


def default_uri(dump_folder: str) -> str:
    """`sqlite:///<dump_folder>/mlflow/mlflow.db` (absolute path)."""
    return "sqlite:///" + os.path.join(os.path.abspath(dump_folder), "mlflow", "mlflow.db")


def check_mlflow(enabled: bool, tracking_uri: str) -> None:
    """Before launch: with `enabled`, the package must import and an http(s) tracking URI must
    answer (its `/health` within 5 s).

    Raises:
        ConfigError: one line naming the package or the URI.
    """
    if not enabled:
        return
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError(_MISSING) from None
    if tracking_uri.startswith(("http://", "https://")):
        url = tracking_uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                ok = r.status == 200
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(
                f"metrics.mlflow_tracking_uri={tracking_uri!r} does not answer ({reason}); start "
                "the server, fix the URI, or leave it empty for a store in the dump folder"
            ) from None
        if not ok:
            raise ConfigError(
                f"metrics.mlflow_tracking_uri={tracking_uri!r}: {url} did not answer 200; is it "
                "an MLflow tracking server?"
            )


def flatten(config: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{section: {key: value}} as {"section.key": str(value)} (MLflow params are strings)."""
    return {f"{sec}.{key}": str(v) for sec, keys in config.items() for key, v in keys.items()}


class MlflowSink:
    """Sends each metrics record to one MLflow run.

    Args:
        dump_folder: the job's dump folder (the default store and the run-id file go under
            `mlflow/`).
        tracking_uri: from `metrics.mlflow_tracking_uri`; empty: `default_uri(dump_folder)`.
        experiment, run_name: from `[metrics]` (an empty run name: the dump folder's name).
        config: the resolved job config as {section: {key: value}}, logged as params.
        start_step: the step the run resumed from; 0 starts a new MLflow run.

    Raises:
        ValueError: the package is not installed (one line naming the extra).
    """

    def __init__(
        self,
        *,
        dump_folder: str,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        config: dict[str, Any],
        start_step: int,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ValueError(_MISSING) from None
        for name in ("mlflow", "alembic", "alembic.runtime.migration"):  # its start-up lines
            logging.getLogger(name).setLevel(logging.WARNING)
        folder = os.path.join(dump_folder, "mlflow")
        os.makedirs(folder, exist_ok=True)
        self.uri = tracking_uri or default_uri(dump_folder)
        self._client = MlflowClient(tracking_uri=self.uri)
        self._state_path = os.path.join(folder, "titanlab_run.json")
        state = self._read_state() if start_step > 0 else None
        if state is not None:
            self.run_id, self._last_step = state["id"], state["last_step"]
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id, self._last_step = self._new_run(experiment, run_name, dump_folder, config)
        self._write_state()
        logger.info("mlflow: run %s in %s", self.run_id, self.uri)

    def _new_run(
        self, experiment: str, run_name: str, dump_folder: str, config: dict[str, Any]
    ) -> tuple[str, int]:
        from mlflow.entities import Param

        exp = self._client.get_experiment_by_name(experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            local = self.uri.startswith("sqlite:///")  # artifacts beside the default store
            where = os.path.join(os.path.dirname(self.uri[len("sqlite:///") :]), "artifacts")
            exp_id = self._client.create_experiment(
                experiment, artifact_location=where if local else None
            )
        name = run_name or os.path.basename(os.path.abspath(dump_folder))
        run_id = self._client.create_run(exp_id, run_name=name).info.run_id
        params = [Param(k, v) for k, v in flatten(config).items()]
        for i in range(0, len(params), _BATCH):
            self._client.log_batch(run_id, params=params[i : i + _BATCH])
        return run_id, 0

    def _read_state(self) -> dict[str, Any] | None:
        try:
            with open(self._state_path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        if not (isinstance(state.get("id"), str) and isinstance(state.get("last_step"), int)):
            return None
        try:
            self._client.get_run(state["id"])
        except Exception:  # the store was moved or wiped: a new run
            return None
        return state

    def _write_state(self) -> None:
        write_json_atomic(self._state_path, {"id": self.run_id, "last_step": self._last_step})

    def write(self, rec: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = rec["step"]
        if step <= self._last_step:
            return
        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(v), now, step)
            for key, v in rec.items()
            if key != "step"
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
        ]
        self._client.log_batch(self.run_id, metrics=metrics)
        self._last_step = step
        self._write_state()

    def artifacts(self, summary: str, files: list[str]) -> None:
        """The run summary (as `run_summary.txt`) and `files` (those that exist) as artifacts."""
        self._client.log_text(self.run_id, summary + "\n", "run_summary.txt")
        for path in files:
            if os.path.isfile(path):
                self._client.log_artifact(self.run_id, path)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
