"""Plan the parallel layout of a training job on a cluster:

    python -m titanlab.plan --cluster h100 --nodes 8 --job.config_file train_configs/llama_8b.toml
    python -m titanlab.plan ... --explain ws64-fsdp8-tp8      # the arithmetic of one layout
    python -m titanlab.plan ... --apply outputs/plan.toml     # the best layout as a config file
    python -m titanlab.plan --calibrate cpu.json --nproc 4 ...  # measure this machine, then plan

`--cluster` is a built-in profile (h100, h200, a100, b200: 8 GPUs per node with NVLink and one
InfiniBand NIC per GPU) or a profile file (*.json); every other option is the trainer's
(`--section.key value`), so the plan is of exactly the run `run_train.sh` would start. The table
ranks every layout the trainer's validator accepts and the memory estimate fits by predicted step
time (titanlab/planning/perf_model.py; docs/planning.md gives the model and its sources), its
compute on a GPU profile priced by the per-op ledger (`--compute flops`: by the FLOP model).
Bad input (an unknown profile, a malformed profile file, a job no layout holds) is one line,
exit 2.
"""

from __future__ import annotations

import argparse
import sys

from titanlab.config.job_config import ConfigError


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Plan the parallel layout of a training job on a cluster: rank every layout\n"
        "the trainer accepts by predicted step time.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", default="h100", help="h100 | h200 | a100 | b200 | profile.json")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the profile (default 1)")
    p.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    p.add_argument("--explain", default="", help="print the arithmetic of this layout")
    p.add_argument("--apply", default="", help="write the best (or --explain's) layout's config")
    p.add_argument("--calibrate", default="", help="measure this machine into PROFILE.json")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node for --calibrate")
    p.add_argument(
        "--compute", choices=("ledger", "flops"), default="ledger",
        help="GPU compute priced by the per-op ledger (default) or by the FLOP model (faster)",
    )  # fmt: skip
    # the trainer's options, left to its config parser (parse_known_args): listed, not parsed
    p.add_argument_group(
        "the trainer's options",
        "--job.config_file F    the job's config file, or a shipped config by its name\n"
        "--section.key VALUE    any other option of the trainer (`titanlab train --help`)",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "python -m titanlab.plan") -> int:
    """Plan (see the module); `prog` names the program in its usage lines."""
    argv = sys.argv[1:] if argv is None else argv
    opts, rest = _parser(prog).parse_known_args(argv)
    try:
        from titanlab.config.shipped import resolve_config_option
        from titanlab.ledger.planner_costs import ledger_costs
        from titanlab.planning.report import run

        priced = ledger_costs if opts.compute == "ledger" else None
        return run(opts, resolve_config_option(rest), priced)  # a shipped config by name too
    except ConfigError as e:
        print(f"titanlab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
