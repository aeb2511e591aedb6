"""Run torchrun so that a failing rank's one `titanlab: error:` line is the last thing shown.

    python -m titanlab.launcher [torchrun options] -m titanlab.train [trainer options]

`run_train.sh` and `multinode_trainer.slurm` start training through it; what it does with the
ranks' output, their error lines and signals is in `titanlab.resilience.launcher`.
"""

import sys

from titanlab.resilience.launcher import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
