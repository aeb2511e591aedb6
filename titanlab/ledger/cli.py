"""`titanlab ledger CONFIG [--device h100] [--top 20] [--json FILE] [--section.key value ...]`:
one training step of CONFIG at its real shape and world size, op by op, priced for `--device`
(a built-in profile, h100 | h200 | a100 | b200, or a profile file; default the config's
`comm.dry_run_device`), on this machine's CPU with fake tensors (docs/ledger.md). Every other
option is the trainer's, so the ledger is of exactly the run `run_train.sh` would start. Bad
input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from titanlab.config.job_config import ConfigError


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("config", help="a config file, or a shipped config by its name")
    p.add_argument("--device", default="", help="h100 | h200 | a100 | b200 | profile.json")
    p.add_argument("--top", type=int, default=20, help="op groups to list (default 20)")
    p.add_argument("--json", default="", help="also write the ledger to this JSON file")
    return p


def main(argv: list[str] | None = None, prog: str = "titanlab ledger") -> int:
    """Print the ledger (see the module); `prog` names the program in its usage lines."""
    argv = sys.argv[1:] if argv is None else argv
    opts, rest = _parser(prog).parse_known_args(argv)
    logging.getLogger("titanlab").setLevel(logging.WARNING)  # the table, not the start-up log
    try:
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
        with open(opts.json, "w", encoding="utf-8") as f:
            f.write(to_json(ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())
