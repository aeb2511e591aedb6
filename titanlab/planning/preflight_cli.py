"""Check a config before launching: `python -m titanlab.preflight --nproc N [--nnodes M] [CONFIG | --job.config_file F] [--section.key V ...]`.

Exits 0 when the config is valid for a world of M·N ranks and should fit in memory with N
processes per node (M defaults to 1), else prints one line to stderr and exits 2. `run_train.sh`
and `multinode_trainer.slurm` run it before torchrun starts a rank, so a hopeless config fails in seconds with
one line instead of a launcher traceback, and writes nothing. The checks are
`titanlab.planning.preflight.check`, which the trainer runs again in every rank. A config that
passes prints the layout, the memory estimate and the layout planner's predicted step (with the
CUDA device's profile, or the one `$TITANLAB_CLUSTER_PROFILE` names). `run_train.sh` and
`titanlab train` run it in torchrun's agent process (`titanlab.launcher --preflight`:
`titanlab.planning.agent`), which is why it lives here, below the entry point.
"""

from __future__ import annotations

import sys

from titanlab.config.job_config import ConfigError
from titanlab.config.manager import build_config
from titanlab.config.shipped import resolve_config_option
from titanlab.observability import warning_filters
from titanlab.planning.preflight import check
from titanlab.planning.report import preflight_summary as summary

__all__ = ["main"]


def main(argv: list[str], prog: str = "python -m titanlab.preflight") -> int:
    """Check the config of `argv` (see the module); 0 when it passes, 2 with one line if not."""
    if "--help" in argv or "-h" in argv:
        print(f"usage: {prog} [--nproc N] [--nnodes M] [CONFIG | --job.config_file F] [--section.key V ...]"
              f"\n\n{__doc__.split(chr(10), 1)[1].strip()}\n\nThe options after --nproc and "
              "--nnodes are the trainer's (`titanlab train --help`).")  # fmt: skip
        return 0
    warning_filters.install()
    counts = {"--nproc": 1, "--nnodes": 1}
    try:
        while argv[:1] and argv[0] in counts:
            value = argv[1] if len(argv) > 1 else ""
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{argv[0]}={value!r} must be a whole number >= 1")
            counts[argv[0]], argv = int(value), argv[2:]
        nproc, nnodes = counts["--nproc"], counts["--nnodes"]
        if argv[:1] and not argv[0].startswith("-"):  # `titanlab preflight CONFIG ...`
            argv = ["--job.config_file", *argv]
        config = build_config(resolve_config_option(argv))  # a shipped config by its name too
        plan = check(config, nproc * nnodes, nproc)
        print(summary(config, plan, nproc * nnodes))
    except ConfigError as e:
        print(f"titanlab: error: {e}", file=sys.stderr)
        return 2
    return 0
