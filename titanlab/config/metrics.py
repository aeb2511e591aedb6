"""The `[metrics]` section: the log line's frequency and the trackers (TensorBoard, Weights &
Biases, MLflow) and the end-of-run plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from titanlab.config.errors import _require


@dataclass
class Metrics:
    log_freq: int = 10
    """Log a `step: N  loss: X ...` line on rank 0 every this many steps (and at the first and last)."""

    enable_tensorboard: bool = False
    """Also write the metrics to TensorBoard under `<dump_folder>/<save_tb_folder>`."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    peak_flops: float = 0.0
    """Peak dense FLOP/s of one device for MFU. 0: look the accelerator up in the built-in table
    (CPU: MFU printed as n/a)."""

    enable_wandb: bool = False
    """Also send the metrics to Weights & Biases (rank 0; needs `pip install 'titanlab[wandb]'`).
    A resumed run continues the same W&B run; its files go under `<dump_folder>/wandb`."""

    wandb_project: str = "titanlab"
    """W&B project."""

    wandb_run_name: str = ""
    """W&B run name. Empty: the dump folder's name."""

    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags (on the command line: comma-separated)."""

    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """auto: $WANDB_MODE when set, else online when an API key is configured and api.wandb.ai
    answers, else offline (upload later with `wandb sync <dump_folder>/wandb/offline-run-*`)."""

    enable_mlflow: bool = False
    """Also send the metrics to MLflow (rank 0; needs `pip install 'titanlab[mlflow]'`): the
    config as params, every logged number as a metric at its step, the run summary and
    loss.png as artifacts at the end. A resumed run continues the same MLflow run."""

    mlflow_tracking_uri: str = ""
    """MLflow tracking store or server (e.g. `http://host:5000`, `sqlite:///path/mlflow.db`).
    Empty: a SQLite store in `<dump_folder>/mlflow/` (`mlflow ui --backend-store-uri
    sqlite:///<dump_folder>/mlflow/mlflow.db` shows it). Checked before launch: an http(s)
    server must answer, a `sqlite:///` file must be creatable, a postgresql / mysql / mssql
    driver must import; MLflow's folder store (a path, `file://`) is refused, as MLflow 3 refuses
    it, unless MLFLOW_ALLOW_FILE_STORE=true."""

    mlflow_experiment: str = "titanlab"
    """MLflow experiment name (created when missing)."""

    mlflow_run_name: str = ""
    """MLflow run name. Empty: the dump folder's name."""

    save_plot: bool = True
    """At the end of the run, rank 0 draws loss, validation loss, tokens/s, memory and grad norm
    against step to `<dump_folder>/loss.png` (needs matplotlib: `pip install 'titanlab[plot]'`;
    without it the run summary says so)."""

    def validate(self) -> None:
        _require(self.log_freq >= 1, f"metrics.log_freq={self.log_freq} must be >= 1")
        _require(self.peak_flops >= 0, f"metrics.peak_flops={self.peak_flops} must be >= 0")
