"""Tokenize text / JSONL / Parquet files into token shards for training.

Usage::

    titanlab prepare-data INPUTS... --output DIR [--tokenizer PATH] [--workers N]
        [--shard-size-mb M] [--text-key text] [--overwrite]
    titanlab prepare-data CHATS.jsonl... --format chat --output DIR [--train-on assistant|all]

INPUTS are files or directories (walked recursively). ``.jsonl``/``.jsonl.gz`` and ``.parquet``
read the ``--text-key`` field/column; every other file is one UTF-8 text document. Rerunning
resumes: finished shards are kept. Parquet needs ``pip install 'titanlab[tools]'``.
``--format chat`` reads JSONL conversations (``{"messages": [{"role", "content"}, ...]}``),
renders them with the Llama 3 chat template and writes a per-token loss mask (assistant tokens
by default; ``--train-on all`` for every token) for supervised fine-tuning
(``titanlab.data.prepare_chat``). In a checkout, ``python tools/prepare_data.py`` runs the same
command (prog ``prepare_data``, the default here; ``titanlab`` for ``titanlab prepare-data``).
"""

from __future__ import annotations

import sys
import time

from titanlab.config.cli_parser import OneLineParser
from titanlab.data.prepare import prepare_data
from titanlab.data.prepare_chat import TRAIN_ON, prepare_chat
from titanlab.data.tokenizer import default_tokenizer_path


PROG = "prepare_data"


def run(argv: list[str] | None = None, prog: str = PROG) -> None:
    """Parse `argv` and prepare the data; prints one summary line.

    Raises:
        ValueError, OSError, ImportError, UnicodeError: bad input (see `main`).
        SystemExit(2): after a one-line usage error.
    """
    parser = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="input files or directories")
    parser.add_argument(
        "--output", required=True, help="output directory for shards + metadata.json"
    )
    parser.add_argument(
        "--tokenizer",
        default=default_tokenizer_path(),
        help="Llama 3 format tokenizer.model, or a Hugging Face tokenizer.json or its folder "
        "(default: the bundled 4k stdlib BPE)",
    )
    parser.add_argument("--workers", type=int, default=1, help="parallel tokenizer processes")
    parser.add_argument("--shard-size-mb", type=float, default=64.0, help="input MB per shard")
    parser.add_argument(
        "--text-key", default="text", help="JSONL field / Parquet column with the text"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace data prepared with a different tokenizer"
    )
    parser.add_argument(
        "--format", choices=["text", "chat"], default="text",
        help="text: documents; chat: JSONL conversations for SFT, with a loss mask",
    )  # fmt: skip
    parser.add_argument(
        "--train-on", choices=list(TRAIN_ON), default="assistant",
        help="chat: which tokens are training targets (default: the assistant's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.format == "chat":
        start = time.perf_counter()
        meta = prepare_chat(args.inputs, args.output, args.tokenizer, train_on=args.train_on)
        print(
            f"{prog}: {meta['total_documents']:,} conversations, {meta['total_tokens']:,} tokens "
            f"({meta['total_targets']:,} targets) in {meta['num_shards']} shard(s) -> "
            f"{args.output} in {time.perf_counter() - start:.1f}s"
        )
        return

    start = time.perf_counter()
    meta = prepare_data(
        args.inputs,
        args.output,
        args.tokenizer,
        text_key=args.text_key,
        workers=args.workers,
        shard_size_mb=args.shard_size_mb,
        overwrite=args.overwrite,
    )
    print(
        f"{args.output}: {meta['total_tokens']:,} tokens, {meta['total_documents']:,} documents, "
        f"{meta['num_shards']} shards ({meta['dtype']}) in {time.perf_counter() - start:.1f}s"
    )


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the tool; a bad input prints one ``<prog>: error: ...`` line (``prepare_data``, or
    ``titanlab`` for ``titanlab prepare-data``), exit status 2."""
    try:
        run(argv, prog)
    except (ValueError, OSError, ImportError, UnicodeError) as e:
        print(f"{prog.split()[0]}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
