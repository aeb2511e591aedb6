"""Sample from a checkpoint: `python -m titanlab.generate CHECKPOINT --prompt TEXT [...]`.

Under torchrun (`torchrun --nproc_per_node N -m titanlab.generate ...`) the model runs tensor
parallel over the N ranks. The options, and what a checkpoint may be, are in
`titanlab.generation.cli` (`python -m titanlab.generate --help`).
"""

from titanlab.distributed.init import exit_process
from titanlab.generation.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    exit_process(main())
