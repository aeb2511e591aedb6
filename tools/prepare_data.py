"""Tokenize text / JSONL / Parquet files into token shards for training.

    python tools/prepare_data.py INPUTS... --output DIR [...] [--help]

The same command as `titanlab prepare-data`, run from a checkout: the options, the formats and
the one-line errors (`prepare_data: error: ...`, exit status 2) are in
`titanlab.data.prepare_cli`.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlab.data.prepare_cli import PROG, main, run

__all__ = ["PROG", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
