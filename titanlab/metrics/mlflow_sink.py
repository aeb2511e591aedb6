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
import urllib.parse
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


_VALID = (
    "use http(s)://host:port (an MLflow server), sqlite:///<writable folder>/mlflow.db, "
    "postgresql://, mysql:// or mssql:// (a database), databricks, or leave it empty for a "
    "SQLite store in the dump folder"
)
_DATABASES = ("postgresql", "mysql", "mssql")  # with sqlite: MLflow's SQLAlchemy stores
_FOLDER_STORES = ("", "file")  # MLflow's folder store: a plain path or file://


def check_mlflow(enabled: bool, tracking_uri: str) -> None:
    """Before launch: with `enabled`, the package must import and `tracking_uri` must name a
    store MLflow opens (empty: the SQLite store in the dump folder, which the pre-flight's dump
    folder check covers).

    Per scheme of MLflow's tracking-store registry (`mlflow.tracking._tracking_service.utils`):
    http(s): the server answers its `/health` within 5 s; sqlite:///PATH: the database file can
    be created or written (its nearest existing folder is a writable folder); postgresql / mysql
    / mssql: SQLAlchemy's driver for it imports; databricks: taken as given (its credentials are
    checked by MLflow). A plain path or file:// is MLflow's folder store, which MLflow 3 keeps in
    maintenance mode and refuses unless MLFLOW_ALLOW_FILE_STORE=true; with that set, its folder
    must be creatable. Any other scheme is refused.

    Raises:
        ConfigError: one line naming the package or the URI and what is valid.
    """
    if not enabled:
        return
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError(_MISSING) from None
    if not tracking_uri:
        _require_sqlalchemy()
        return
    scheme = urllib.parse.urlparse(tracking_uri).scheme.lower()
    if scheme in ("http", "https"):
        _check_server(tracking_uri)
    elif scheme == "sqlite":
        _require_sqlalchemy()
        _check_sqlite(tracking_uri)
    elif scheme.split("+")[0] in _DATABASES:
        _require_sqlalchemy()
        _check_driver(tracking_uri)
    elif scheme == "databricks" or tracking_uri == "databricks":
        return
    elif scheme in _FOLDER_STORES:
        _check_folder_store(tracking_uri, scheme)
    else:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r}: MLflow has no tracking store for "
            f"scheme {scheme!r}; {_VALID}"
        )


def _check_server(tracking_uri: str) -> None:
    """The server at `tracking_uri` answers `/health` with 200 within 5 s."""
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


def _require_sqlalchemy() -> None:
    """MLflow's database stores (SQLite included) need SQLAlchemy and Alembic, which
    mlflow-skinny leaves out (`titanlab[mlflow]` has them)."""
    try:
        import alembic  # noqa: F401
        import sqlalchemy  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"metrics.enable_mlflow=true with a database store needs {e.name}; pip install "
            "'titanlab[mlflow]'"
        ) from None


def _unwritable(path: str, folder: bool) -> str | None:
    """Why the file (or with `folder`, the folder) `path` cannot be created or written, else
    None: its nearest existing ancestor must be a writable folder."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if os.path.isdir(full) != folder:
            return f"{full} is a {'file' if folder else 'folder'}"
        return None if os.access(full, os.W_OK) else f"{full} is not writable"
    existing = os.path.dirname(full)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{full} cannot be created: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{full} cannot be created: {existing} is not writable"
    return None


def _check_sqlite(tracking_uri: str) -> None:
    """`sqlite:///PATH` (PATH relative to the working folder, or absolute as sqlite:////abs):
    the database file PATH can be created or written."""
    prefix = "sqlite:///"
    path = tracking_uri[len(prefix) :].split("?")[0] if tracking_uri.startswith(prefix) else ""
    if not path:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r} names no database file; {_VALID}"
        )
    why = _unwritable(path, folder=False)
    if why:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r}: the SQLite database {why}; {_VALID}"
        )


def _check_driver(tracking_uri: str) -> None:
    """SQLAlchemy parses the URI and its database driver imports (no connection is made)."""
    from sqlalchemy.engine import make_url

    try:
        make_url(tracking_uri).get_dialect().import_dbapi()
    except ImportError as e:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r} needs the database driver "
            f"{e.name!r}, which is not installed; pip install it or "
            f"{_VALID.removeprefix('use ')}"
        ) from None
    except Exception as e:  # sqlalchemy.exc.ArgumentError, NoSuchModuleError: a malformed URI
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r} is not a database URI SQLAlchemy "
            f"reads ({e}); {_VALID}"
        ) from None


def _check_folder_store(tracking_uri: str, scheme: str) -> None:
    """MLflow's folder store (a path or file://): refused as MLflow itself refuses it, unless
    MLFLOW_ALLOW_FILE_STORE=true; then its folder must be creatable."""
    from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE

    if not MLFLOW_ALLOW_FILE_STORE.get():
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r} is MLflow's folder store, which "
            "MLflow 3 keeps in maintenance mode and refuses unless MLFLOW_ALLOW_FILE_STORE=true; "
            "use sqlite:///<writable folder>/"
            "mlflow.db (`mlflow migrate-filestore` moves existing runs there) or an "
            "http(s)://host:port MLflow server"
        )
    path = urllib.request.url2pathname(urllib.parse.urlparse(tracking_uri).path)
    why = _unwritable(path if scheme == "file" else tracking_uri, folder=True)
    if why:
        raise ConfigError(
            f"metrics.mlflow_tracking_uri={tracking_uri!r}: the folder store {why}; {_VALID}"
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
