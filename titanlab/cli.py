"""The `titanlab` command (docs/cli.md): `titanlab COMMAND [ARGS ...]`, `titanlab COMMAND --help`,
`titanlab --version`. Each command is the `main(argv, prog)` of the module COMMANDS names, the
same code as its `python -m` entry point. An unknown command is one line naming the closest one.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

# name: ("module:function" taking (argv, prog), default function main; what it does)
COMMANDS = {
    "train": ("titanlab.resilience.run_train", "pre-flight, then train on NGPU processes (./run_train.sh)"),
    "preflight": ("titanlab.preflight", "check a config's layout and memory in seconds, before launching"),
    "plan": ("titanlab.plan", "rank the parallel layouts of a job on a cluster profile"),
    "ledger": ("titanlab.ledger.cli", "one training step op by op, priced for a GPU, on this CPU"),
    "generate": ("titanlab.generation.cli", "sample from a DCP or Hugging Face checkpoint"),
    "convert": ("titanlab.checkpoint.convert_cli", "convert checkpoints: from-hf, to-hf, to-peft, to-gguf"),
    "prepare-data": ("titanlab.data.prepare_cli", "tokenize text, JSONL, Parquet or chats into shards"),
    "bench": ("titanlab.cli:bench", "trainer vs a plain PyTorch loop: speed, memory (a source checkout)"),
}  # fmt: skip


def usage() -> str:
    """The command list that `titanlab` and `titanlab --help` print."""
    rows = "".join(f"\n  {name:<13} {about}" for name, (_, about) in COMMANDS.items())
    return f"usage: titanlab COMMAND [ARGS ...]\n\ncommands:{rows}\n\n`titanlab COMMAND --help`: its options"


def version() -> str:
    """The installed distribution's version ("unknown" when titanlab runs uninstalled)."""
    from importlib import metadata

    try:
        return metadata.version("titanlab")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def bench(argv: list[str], prog: str = "titanlab bench") -> int:
    """`titanlab bench`: tools/benchmark.py of the source checkout this package runs from. It
    compares the trainer with a plain loop and rewrites tables of the checkout's docs/, and it
    shares tools/lib with the other benchmarks, so it stays there: an installed wheel gets one
    line saying so (exit 2; exit 0 for --help)."""
    from titanlab.config.shipped import checkout_root, run_checkout_script

    root = checkout_root()
    script = os.path.join(root, "tools", "benchmark.py") if root else ""
    if os.path.isfile(script):
        return run_checkout_script(script, prog, argv)
    line = f"titanlab bench needs a source checkout (tools/benchmark.py); this titanlab is installed in {os.path.dirname(__file__)}: clone the repository, `pip install -e .` in it and run `{prog}` there"  # fmt: skip
    asked = "--help" in argv or "-h" in argv  # then the same line as the answer, exit 0
    print(line if asked else f"titanlab: error: {line}", file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


def main(argv: list[str] | None = None) -> int:
    """Run `titanlab ARGV` (the program's arguments) and return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"titanlab {version()}")
        return 0
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], [*COMMANDS, "--version", "--help"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"titanlab: error: unknown command {argv[0]!r}{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)  # fmt: skip
        return 2
    module, _, function = COMMANDS[argv[0]][0].partition(":")
    run = getattr(importlib.import_module(module), function or "main")
    return run(argv[1:], prog=f"titanlab {argv[0]}")


if __name__ == "__main__":
    sys.exit(main())
