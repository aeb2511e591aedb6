"""`titanlab ledger CONFIG [--device h100] [--top 20] [--json FILE] [--section.key value ...]`.

Prints one training step of CONFIG at its real shape and world size, op by op, priced for
`--device` (a built-in profile, h100 | h200 | a100 | b200, or a profile file; default the
config's `comm.dry_run_device`, h100 unless the config sets another), on this machine's CPU
with fake tensors (docs/ledger.md). Every other option is the trainer's, so the ledger is of
exactly the run `run_train.sh` would start. Bad input is one line, exit 2, before the step is
built.
"""

from __future__ import annotations

import logging
import os
import sys

from titanlab.config.cli_parser import OneLineParser, positive_int, unknown_own_option
from titanlab.config.job_config import ConfigError


def _parser(prog: str) -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[1])
    p.add_argument("config", help="a config file, or a shipped config by its name")
    p.add_argument("--device", default="", help="h100 | h200 | a100 | b200 | profile.json "
                   "(default: the config's comm.dry_run_device, h100 unless it sets another)")  # fmt: skip
    p.add_argument("--top", type=positive_int, default=20, help="op groups to list (default 20)")
    p.add_argument("--json", default="", help="also write the ledger to this JSON file")
    return p


def _cli_value(rest: list[str], key: str) -> str | None:
    """The last value of `--key V` / `--key=V` among the trainer's options `rest`, or None."""
    found = None
    for i, arg in enumerate(rest):
        if arg == key and i + 1 < len(rest):
            found = rest[i + 1]
        elif arg.startswith(key + "="):
            found = arg.split("=", 1)[1]
    return found


def check_options(opts, rest: list[str], parser: OneLineParser) -> None:
    """What can be refused before the step is built (seconds, not the minute the step takes):
    an unknown option of the ledger's own, `--device` against `--comm.dry_run_device`, and a
    `--json` file that could not be written. Raises ConfigError (one line)."""
    line = unknown_own_option(rest, parser)
    if line:
        raise ConfigError(line)
    named = _cli_value(rest, "--comm.dry_run_device")
    if opts.device and named is not None and named != opts.device:
        raise ConfigError(
            f"--device {opts.device} and --comm.dry_run_device {named} name different devices; "
            "give one of them (--device sets comm.dry_run_device)"
        )
    if opts.json:
        folder = os.path.dirname(os.path.abspath(opts.json))
        if os.path.isdir(opts.json):
            raise ConfigError(f"--json {opts.json!r} is a folder; give a file name, e.g. "
                              f"{os.path.join(opts.json, 'ledger.json')!r}")  # fmt: skip
        if not os.path.isdir(folder):
            raise ConfigError(f"--json {opts.json!r}: the folder {folder!r} does not exist; "
                              "give a file in an existing folder")  # fmt: skip
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"--json {opts.json!r}: the folder {folder!r} is not writable; "
                              "give a file in a folder you can write")  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "titanlab ledger") -> int:
    """Print the ledger (see the module); `prog` names the program in its usage lines."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(prog)
    opts, rest = parser.parse_known_args(argv)
    logging.getLogger("titanlab").setLevel(logging.WARNING)  # the table, not the start-up log
    try:
        check_options(opts, rest, parser)
        from titanlab.config.shipped import resolve_config_option
        from titanlab.ledger.report import render, to_json
        from titanlab.ledger.run import build_ledger

        args = resolve_config_option(["--job.config_file", opts.config, *rest])
        ledger = build_ledger(args, opts.device)
    except ConfigError as e:
        print(f"titanlab: error: {e}", file=sys.stderr)
        return 2
    print(render(ledger, opts.top))
    if opts.json:
        try:
            with open(opts.json, "w", encoding="utf-8") as f:
                f.write(to_json(ledger))
        except OSError as e:
            print(f"titanlab: error: --json {opts.json!r}: {e.strerror}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
