"""Check a config before launching: `python -m titanlab.preflight --nproc N [--nnodes M] [--job.config_file F] [--section.key V ...]`.

What it checks, prints and returns: `titanlab.planning.preflight_cli` (`--help`).
"""

from __future__ import annotations

import sys

from titanlab.planning.preflight import Plan, check
from titanlab.planning.preflight_cli import main

__all__ = ["Plan", "check", "main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
