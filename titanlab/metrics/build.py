"""The metric sinks a job's `[metrics]` section asks for."""

from __future__ import annotations

import os

from titanlab.config.job_config import JobConfig
from titanlab.config.manager import to_dict
from titanlab.metrics.logger import Sink
from titanlab.metrics.sinks import JsonlSink, TensorBoardSink


def build_sinks(config: JobConfig, start_step: int) -> list[Sink]:
    """`<dump_folder>/metrics.jsonl` always; TensorBoard, W&B and MLflow when enabled. `start_step` is
    the step the run resumed from (0 for a new run): each sink continues its curve from there.

    Raises:
        ValueError: an enabled tracker's package is not installed.
    """
    m, dump = config.metrics, config.job.dump_folder
    sinks: list[Sink] = [JsonlSink(os.path.join(dump, "metrics.jsonl"), start_step)]
    if m.enable_tensorboard:
        sinks.append(TensorBoardSink(os.path.join(dump, m.save_tb_folder), start_step))
    if m.enable_wandb:
        from titanlab.metrics.wandb_sink import WandbSink

        sinks.append(
            WandbSink(
                dump_folder=dump,
                project=m.wandb_project,
                run_name=m.wandb_run_name,
                tags=list(m.wandb_tags),
                mode=m.wandb_mode,
                config=to_dict(config),
                start_step=start_step,
            )
        )
    if m.enable_mlflow:
        from titanlab.metrics.mlflow_sink import MlflowSink

        sinks.append(
            MlflowSink(
                dump_folder=dump,
                tracking_uri=m.mlflow_tracking_uri,
                experiment=m.mlflow_experiment,
                run_name=m.mlflow_run_name,
                config=to_dict(config),
                start_step=start_step,
            )
        )
    return sinks
