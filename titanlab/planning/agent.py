"""torchrun's agent with the pre-flight check in front, in one process.

    python -m titanlab.planning.agent --preflight NPROC [torchrun options] -m titanlab.train [trainer options]

`titanlab.resilience.launcher --preflight` (what `run_train.sh` and `titanlab train` run)
starts this instead of `python -m torch.distributed.run`: the check
(`titanlab.preflight`'s `main("--nproc NPROC" + the trainer options)`) runs here first and, when it
refuses the config, this process exits with its code (2) and its one line, before torchrun
starts anything. When it passes, `launcher.PREFLIGHT_PASSED` is written to stderr (the launcher opens its log
only then, so that a refused config writes nothing) and this process becomes
`python -m torch.distributed.run` with the same options (`runpy`, as `-m` runs it).

One Python start and torch import less per launch than a separate pre-flight process (about
3 s of CPU on a 2-core VM). Multi-node jobs (`multinode_trainer.slurm`) check once before
`srun` and start the launcher without `--preflight`.
"""

from __future__ import annotations

import runpy
import sys

from titanlab.resilience.launcher import PREFLIGHT_PASSED


def main(argv: list[str]) -> int:
    """Check (see the module), then run torchrun with `argv` less `--preflight NPROC`; returns
    the check's exit code when it refuses, else torchrun's (by SystemExit, as `-m` exits)."""
    if argv[:1] != ["--preflight"] or len(argv) < 2 or "-m" not in argv:
        print(
            "titanlab: error: usage: python -m titanlab.planning.agent --preflight NPROC "
            "[torchrun options] -m titanlab.train [trainer options]",
            file=sys.stderr,
        )
        return 2
    nproc, torchrun = argv[1], argv[2:]
    from titanlab.planning import preflight_cli as preflight

    trainer_args = torchrun[torchrun.index("-m") + 2 :]
    code = preflight.main(["--nproc", nproc, *trainer_args])
    sys.stdout.flush()
    if code != 0:
        return code
    print(PREFLIGHT_PASSED, file=sys.stderr, flush=True)
    sys.argv = ["torch.distributed.run", *torchrun]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
