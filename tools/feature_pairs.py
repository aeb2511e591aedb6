"""The feature-pair matrix: every pair of options that changes what runs either trains like one
process or is refused before launch.

    python tools/feature_pairs.py                 # pairs and EP/PP × PEFT triples, Inductor
    python tools/feature_pairs.py --subset ci     # the covering rows CI runs (every pair)
    python tools/feature_pairs.py --subset pairs  # a row of its own for every supported pair
    python tools/feature_pairs.py --list          # the verdicts only (no training), in a minute

A *factor* is one option family (the model, the 2-rank layout, PEFT, distillation, compile,
activation checkpointing, precision, float8, the loss (plain, or the chunked fused linear +
cross-entropy), the data, the optimizer (AdamW or Muon)); a *level* is one value of it,
written as
the command-line options that select it. For every pair of levels of two factors, the trainer's
own pre-flight (`titanlab.planning.preflight.check`, the function `run_train.sh` calls) decides on a
2-rank run whether it is supported; everything else stays at its factor's first level.

- A refused pair must be refused with one line that names an option of each of its two levels.
- The triples that touch expert or pipeline parallel and PEFT (EP 2 or PP 2 × a PEFT level ×
  any level of a third factor, `triple_verdicts`) are judged the same way (`--subset full`).
- The supported pairs (and, in `--subset full`, the supported triples) are covered by *rows*
  (one level of every factor): the greedy covering of AETG (Cohen et al. 1997) puts each in at
  least one row, and no row holds a refused pair or triple; `--subset pairs` gives each
  supported pair a row of its own (the pair, the rest at first levels), to find which pair of a
  failing row is at fault. A row is checked by the pre-flight again (a combination of more
  levels may be refused where its pairs are not; the row then falls back to its seed's own
  row). Each row trains 2 steps on 2 ranks from one seed
  checkpoint per model (global batch 4 × 64 tokens; 2 × 64 in a row with bf16, fp16 or float8,
  whose matmuls run ~40x slower than fp32 on CPUs without native bf16) and is compared with the
  same options on
  1 process, eager (compile, expert, tensor, context and pipeline parallel off; the global
  batch split into as many accumulation steps as the layout has global microbatches, over each
  of which MoE's load-balance loss is taken), then exports and loads its export
  (`check_export`).
- There is no third outcome: a row that crashes after launch, or whose export loses or cannot
  load a part of what trained, fails.

Tolerances: |Δloss| <= 1e-5 in fp32 (the layout matrix's bound); with bf16 / fp16 compute or
float8 (emulated) matmuls, <= 2e-2, the bound of `tests/integration/test_mixed_precision.py`:
rounding to 8 (bf16) mantissa bits happens in a different order on 2 ranks than on 1, and
float8's dynamic scales are taken per rank. Exports: logits within 1e-4 of titanlab's own
loader (the bound of the LoRA export tests).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.lib.feature_covering import covering_rows, pair_rows
from tools.lib.feature_matrix import row_name
from tools.lib.feature_runs import make_fixtures, run_rows, write_doc
from tools.lib.feature_verdicts import companions, names_both, pair_verdicts, triple_verdicts
from tools.lib.runs import REPO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subset", choices=("ci", "full", "pairs"), default="full")
    parser.add_argument("--list", action="store_true", help="verdicts only, no training")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "outputs", "feature_pairs"))
    parser.add_argument("--compile-backend", default="inductor", help="for rows that compile")
    parser.add_argument(
        "--output",
        default=None,
        help="markdown file for the table (e.g. docs/feature_pairs.md); default: none",
    )
    opts = parser.parse_args(argv)
    fixtures = make_fixtures(opts.work_dir)
    helpers = companions(fixtures)
    verdicts = pair_verdicts(fixtures, helpers)
    refused = {p: why for p, why in verdicts.items() if why is not None}
    unnamed = [p for p, why in refused.items() if not names_both(p, str(why), helpers)]
    for (a, b), why in refused.items():
        named = "" if (a, b) not in unnamed else " [DOES NOT NAME BOTH]"
        print(f"refused  {a.label} × {b.label}: {why}{named}")
    triples = triple_verdicts(fixtures, helpers, verdicts) if opts.subset == "full" else {}
    for triple, why in triples.items():
        if why is not None:
            print(f"refused  {' × '.join(lv.label for lv in triple)}: {why}")
    if opts.subset == "pairs":
        rows = pair_rows(verdicts, helpers)
    else:
        rows = covering_rows(verdicts, fixtures, helpers, triples=triples)
    print(f"pairs: {len(verdicts) - len(refused)} supported, {len(refused)} refused "
          f"({len(unnamed)} refusals not naming both options); triples: "
          f"{sum(why is None for why in triples.values())} supported, "
          f"{sum(why is not None for why in triples.values())} refused; {len(rows)} rows")  # fmt: skip
    command = "python tools/feature_pairs.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if opts.list:
        for row in rows:
            print("row", row_name(row))
        if opts.output:
            write_doc(opts.output, verdicts, rows, [], command)
        return 0

    def report(outcome) -> None:
        print(
            f"{'pass' if outcome.passed else 'FAIL'}  {outcome.row}: "
            f"{outcome.max_abs_diff if outcome.error is None else outcome.error} "
            f"[{outcome.export}] {outcome.seconds:.0f}s",
            flush=True,
        )

    outcomes = run_rows(rows, fixtures, opts.work_dir, opts.compile_backend, on_outcome=report)
    failed = sum(not o.passed for o in outcomes)
    print(f"supported {len(verdicts) - len(refused)} / refused {len(refused)} / failed {failed}")
    if opts.output:
        write_doc(opts.output, verdicts, rows, outcomes, command)
    return 1 if failed or unnamed else 0


if __name__ == "__main__":
    sys.exit(main())
