"""The training loop of `titanlab.trainer.Trainer`: each step (batch → `train_step` → log →
validate → checkpoint → maybe stop), how a run ends (done, diverged, preempted, out of memory)
and the seed checkpoint. `TrainLoop` is the half of the Trainer that runs; the Trainer builds
what it uses."""

from __future__ import annotations

import gc
import os
import logging
import time
from typing import Any

import torch

from titanlab.checkpoint import Checkpointer, store
from titanlab.config.job_config import ConfigError
from titanlab.distributed.comm_counter import count_step_comms
from titanlab.distributed.init import set_train_timeout
from titanlab.metrics import MetricsLogger
from titanlab.models.common.flex_masks import TILES
from titanlab.observability.profiling import StepProfiler
from titanlab.observability.run_summary import end_of_run
from titanlab.resilience.failures import OutOfMemory, TrainingDiverged, is_out_of_memory, oom_line
from titanlab.resilience.preemption import REQUEUE_EXIT_CODE, Preempted, PreemptionHandler
from titanlab.trainer import rl_steps
from titanlab.trainer.step import TrainStep

logger = logging.getLogger("titanlab")


class TrainLoop(TrainStep):
    """`train` and what one iteration of the loop does, over the attributes the Trainer sets
    (besides `TrainStep`'s: `loader`, `rl`, `metrics`, `checkpointer`, `batch`)."""

    loader: Any
    rl: Any
    metrics: MetricsLogger
    checkpointer: Checkpointer
    batch: Any
    _retry: Any = None  # the batches of a step to run again (fault tolerance)

    def train(self) -> None:
        cfg = self.config
        if cfg.checkpoint.create_seed_checkpoint:
            return self._write_seed_checkpoint()
        gc.disable()
        preemption = PreemptionHandler(self.device)
        data = iter(self.loader) if self.rl is None else None
        last = cfg.training.steps
        logger.info("training: steps %d → %d", self.step + 1, last)
        first, begin = self.step, time.perf_counter()
        with StepProfiler(cfg.profiling, cfg.job.dump_folder, self.rank, self.device) as prof:
            while self.step < last:
                try:
                    with prof.annotate(self.step + 1):
                        self._loop_step(data, last, preemption)
                except Exception as e:
                    if not is_out_of_memory(e):
                        raise
                    line = oom_line(self.rank, self.step, prof.oom_snapshot())
                    raise OutOfMemory(line) from e
                prof.step(self.step)
        if self.ft is not None:  # a group one step behind takes the last step from a peer
            self.ft.finish()
        preemption.restore()
        logger.info("training: done at step %d", self.step)
        if self.rank == 0:
            self._finish_run(first, time.perf_counter() - begin)

    def _loop_step(self, data, last: int, preemption: PreemptionHandler) -> None:
        """One iteration of the loop: train, log, validate, checkpoint, maybe stop."""
        cfg = self.config
        if self.ft is not None:
            self.ft.start_step()  # this step's quorum; behind the others, their state
            if self.step >= last:  # recovered a peer's state of the last step: save it
                self.checkpointer.maybe_save(self.step, last)
                return
        self.step += 1
        self.metrics.begin_step()
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step uses
        evaluate = False
        if self.rl is not None:
            self.metrics.data_ready()
            loss, grad_norm, extra, evaluate = rl_steps.step(self.rl, cfg, self.step, last)
        else:
            batches = self._retry or [next(data) for _ in range(self.batch.grad_accum_steps)]
            self._retry = None
            self.metrics.data_ready()
            self.batches.record(self.step, batches)
            try:
                with count_step_comms(self.step):  # only when TITANLAB_COMM_COUNT is set
                    loss, grad_norm = self.train_step(batches)
            except TrainingDiverged as e:  # training.skip_nonfinite_steps: too many in a row
                self._diverged(str(e))
            extra = self.moe_metrics
            if self.ft is not None:
                if not self.committed:  # a replica group failed during it: run it again
                    logger.warning(
                        "fault tolerance: step %d not committed (a replica group failed "
                        "during it); running it again",
                        self.step,
                    )
                    self._retry, self.step = batches, self.step - 1
                    return
                extra = {**extra, "ft/groups": torch.tensor(float(self.ft.groups()))}
        if self.step == 1:
            set_train_timeout(cfg.comm.train_timeout_seconds)
        validate = (
            cfg.validation.enable
            and self.val_set is not None
            and self.step % cfg.validation.freq == 0
        )
        log = validate or evaluate or self.metrics.should_log(self.step, last)
        stop = self.step < last and preemption.should_stop()
        # The host waits for the device only when it needs the values: to log, or before
        # anything that must not happen after a non-finite loss (a checkpoint, the end).
        fetch = log or stop or self.step == last or self.checkpointer.due(self.step, last)
        diverged = self.metrics.end_step(
            self.step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            extra=extra,
            loss_scale=self.scaler.get_scale() if self.scaler is not None and fetch else None,
            fetch=fetch,
        )
        # (a step `train_step` skipped for its non-finite loss was not applied: not divergence)
        if diverged is not None and diverged.step not in self.nonfinite.skipped:
            self._diverged(f"loss is {diverged.values['loss']} at step {diverged.step}")
        if log:
            self.metrics.log(
                self.step,
                val_loss=self.validate() if validate else None,
                data_tokens=self._mixture_tokens(),
            )
        self.checkpointer.maybe_save(self.step, last)
        if cfg.training.gc_freq and self.step % cfg.training.gc_freq == 0:
            gc.collect(1)
        if stop:
            self._stop_for_preemption(preemption)

    def _mixture_tokens(self) -> dict[str, int] | None:
        """Tokens each source of a mixture has supplied by the end of this step (None for
        one source)."""
        if self.data_schedule is None:
            return None
        samples = self.loader.sampler.consumed_after_step(self.step)
        if samples is None:
            return None
        return {name: n * self.config.training.seq_len for name, n in samples.items()}

    def _finish_run(self, first: int, wall_s: float) -> None:
        """Rank 0: draw the curves (metrics.save_plot), give the trackers the summary and the
        plot, and print the summary."""
        self.checkpointer.wait()
        summary = end_of_run(self.config, self.metrics, self.checkpointer, self.device, first,
                             self.step, wall_s, TILES.fractions())  # fmt: skip
        self.metrics.artifacts(summary, [os.path.join(self.config.job.dump_folder, "loss.png")])
        self.metrics.close()  # trackers flush and finish before the summary is printed
        logger.info("%s", summary)

    def _diverged(self, what: str) -> None:
        """Raise TrainingDiverged: `what` happened, and where the run can resume from."""
        last = self.checkpointer.last_complete()
        raise TrainingDiverged(
            f"{what}; last complete checkpoint: {last or 'none'} (lower optimizer.lr or check "
            "the data)"
        )

    def _stop_for_preemption(self, preemption: PreemptionHandler) -> None:
        """Save the state of the step just finished (unless already saved) and leave the loop."""
        saved = "checkpointing is disabled, nothing saved"
        if self.config.checkpoint.enable:
            path = store.step_dir(self.checkpointer.root, self.step)
            if store.incomplete_reason(path) is not None:
                self.checkpointer.save(self.step)
            self.checkpointer.wait()
            saved = f"checkpoint {path}"
        if self.rank == 0:
            preemption.mark_for_requeue(self.step)
        logger.warning(
            "preempted by %s after step %d: %s; exiting with %d to be requeued",
            preemption.signal_name(),
            self.step,
            saved,
            REQUEUE_EXIT_CODE,
        )
        raise Preempted()

    def _write_seed_checkpoint(self) -> None:
        if self.parallel_dims.world_size != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint needs 1 process, not "
                f"{self.parallel_dims.world_size} (run with NGPU=1)"
            )
        path = self.checkpointer.save_model_only(0)
        logger.info("seed checkpoint written to %s", path)
