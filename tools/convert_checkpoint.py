"""Convert checkpoints between titanlab DCP and Hugging Face (safetensors), streamed.

    python -m tools.convert_checkpoint {to-hf,from-hf,to-peft,to-gguf} ... [--help]

The same command as `titanlab convert`, run from a checkout: the options, the formats and the
one-line errors (`convert_checkpoint: error: ...`, exit status 2) are in
`titanlab.checkpoint.convert_cli`. Also runnable as `python tools/convert_checkpoint.py`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlab.checkpoint.convert_cli import PROG, build_parser, main, run

__all__ = ["PROG", "build_parser", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
