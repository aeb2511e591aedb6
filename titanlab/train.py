"""Train a model of the registry: `python -m titanlab.train --job.config_file F.toml [--section.key V ...]`.

Launch several processes with torchrun (see run_train.sh). The recipe is
`titanlab.trainer.Trainer`; this entry point maps how a run ends to its exit code (0 done, 2 bad
config, 3 diverged, 4 hang, 5 out of memory, 75 preempted: requeue) and one last line.
"""

from __future__ import annotations

import logging
import sys

from titanlab.config.docs import format_help
from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.distributed.init import destroy_distributed, exit_process
from titanlab.models.registry import format_families
from titanlab.resilience import failures as f
from titanlab.resilience.preemption import REQUEUE_EXIT_CODE, Preempted
from titanlab.trainer import Trainer, dry_run

__all__ = ["Trainer", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(format_help() + "\n\n" + format_families())
        return 0
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="[titanlab] %(asctime)s %(levelname)s %(message)s")  # fmt: skip
    trainer, clean = None, False
    try:
        config = build_config(argv)
        if config.comm.ledger:  # the step priced op by op for comm.dry_run_device
            from titanlab.ledger.report import render
            from titanlab.ledger.run import build_ledger

            print(render(build_ledger(argv)), flush=True)
            clean = True
            return 0
        if config.comm.mode == "local_tensor":  # every rank simulated in this process
            from titanlab.trainer import local_tensor

            return local_tensor.run(config)
        trainer = Trainer(config)
        if trainer.dry_run is not None:  # comm.mode fake_backend: built, planned, not trained
            print(dry_run.report(trainer), flush=True)
            clean = True
            return 0
        trainer.train()
        trainer.close()
        clean = True
        return 0
    except Preempted:  # every rank stops after the same step
        assert trainer is not None  # only Trainer.train raises Preempted
        trainer.close()
        clean = True
        return REQUEUE_EXIT_CODE
    except ConfigError as e:
        return f.fail(f"titanlab: error: {e}", f.CONFIG_ERROR_EXIT_CODE)
    except f.TrainingDiverged as e:
        return f.fail(f"titanlab: error: {e}", f.DIVERGED_EXIT_CODE)
    except f.OutOfMemory as e:
        return f.fail(str(e), f.OOM_EXIT_CODE)
    except f.QuorumTimeout as e:
        return f.fail(f"titanlab: error: {e}", f.HANG_EXIT_CODE)
    except Exception as e:
        if trainer is None or not f.is_collective_timeout(e):
            raise
        last = trainer.checkpointer.last_complete()
        timeout_s = trainer.config.comm.train_timeout_seconds
        line = f.timeout_line(e, trainer.rank, trainer.step, timeout_s, last)
        return f.fail(line, f.HANG_EXIT_CODE)
    finally:
        destroy_distributed(barrier=clean)


if __name__ == "__main__":
    exit_process(main())
