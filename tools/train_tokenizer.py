"""Train a byte-level BPE tokenizer and write it in the Llama 3 ``tokenizer.model`` format.

Usage::

    python tools/train_tokenizer.py [FILES_OR_DIRS ...] --output PATH [--vocab-size 4096]

Without inputs it trains on the default corpus (every ``.py`` file of the running Python's
standard library), with Hugging Face ``tokenizers`` (a dependency of titanlab).

The bundled ``titanlab/data/assets/stdlib_bpe_4k.model`` was made with::

    python tools/train_tokenizer.py --output titanlab/data/assets/stdlib_bpe_4k.model

on CPython 3.11.7's standard library (1790 files, 31.5 MB, no subsampling; about 6 s on 2 cores),
with the defaults ``--vocab-size 4096 --min-frequency 2``. Output is deterministic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlab.data.bpe_training import train_bpe
from titanlab.data.default_corpus import default_corpus_files
from titanlab.data.prepare_inputs import list_input_files
from titanlab.data.tokenizer import Tokenizer


def run(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "inputs", nargs="*", help="text files or directories (default: the stdlib .py files)"
    )
    parser.add_argument("--output", required=True, help="where to write the tokenizer.model file")
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="base tokens: 256 bytes + merges"
    )
    parser.add_argument("--min-frequency", type=int, default=2, help="never merge rarer pairs")
    args = parser.parse_args(argv)

    files = list_input_files(args.inputs) if args.inputs else default_corpus_files()
    start = time.perf_counter()
    n = train_bpe(
        files,
        args.output,
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        show_progress=True,
    )
    tok = Tokenizer(args.output)
    print(
        f"wrote {args.output}: {n} base tokens + 256 specials = {tok.vocab_size}, "
        f"fingerprint {tok.fingerprint}, from {len(files)} files in {time.perf_counter() - start:.1f}s"
    )


def main(argv: list[str] | None = None) -> None:
    """Run the tool; user errors end the process with one ``error: ...`` line (exit status 1)."""
    try:
        run(argv)
    except (ValueError, OSError, ImportError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
