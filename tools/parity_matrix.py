r"""The layout parity matrix: every valid layout against one process, from one seed checkpoint.

    python tools/parity_matrix.py                       # every valid layout of 1, 2, 4, 8 ranks
    python tools/parity_matrix.py --subset ci           # the pairwise subset CI runs
    python tools/parity_matrix.py --world-sizes 2 4 --only ddp
    python tools/parity_matrix.py --world-sizes 4 8 --only '-(2d|2\.5d|3d)'   # a regex

The layouts come from `titanlab.planning.layouts.enumerate_layouts` (degrees, schedules,
gradient accumulation, CP's rotate method, where ranks shard each ZeRO stage 0-3 with and
without offload, and 2D / 2.5D / 3D tensor parallel where tp is q² / q²·d / q³), and the trainer's own validator decides which are valid; a refused layout is listed with its one-line reason. Each
valid layout trains `debugmodel_deep` for 3 steps (fp32, deterministic, global batch 8 × 64
tokens) from the same seed checkpoint, on the fewest of its 8 blocks the layout's pipeline
stages need (`least_blocks`: 2 without a pipeline), and its losses are compared with the
1-process run's on those blocks, which trains 5 (to show it trains: the loss falls below step
1's). Three steps cover every
part of a step a layout changes: the forward at the seed (step 1), a first update (gradients,
clipping, the optimizer's first step; step 2) and a second one from the optimizer's state,
the warmup over (step 3). Running a layout against the reference is `tools/lib/parity_runs.py`.
Results are appended as they come to `docs/parity_matrix.jsonl` with the commit each ran on
(`tools/lib/parity_record.py`; a rerun skips the layouts recorded while the training code is
unchanged, on any machine), `--part k/n` runs one part of the layouts (by name, as `make
test-full-part` does), and the table is written between markers in `docs/parallelism.md`
(`--output`).
`make test-parity-full` runs the whole matrix.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from titanlab.planning.layout_cover import pairwise_subset
from titanlab.planning.layouts import Layout, check_layout, enumerate_layouts
from tools.lib import parity_record
from tools.lib.parity_runs import BASE_ARGS as BASE_ARGS
from tools.lib.parity_runs import GLOBAL_BATCH as GLOBAL_BATCH
from tools.lib.parity_runs import LAYOUT_STEPS as LAYOUT_STEPS
from tools.lib.parity_runs import STEPS as STEPS
from tools.lib.parity_runs import TOLERANCE as TOLERANCE
from tools.lib.parity_runs import least_blocks as least_blocks
from tools.lib.parity_runs import Outcome as Outcome
from tools.lib.parity_runs import prepare_reference as prepare_reference
from tools.lib.parity_runs import run_layout as run_layout
from tools.lib.parts import parse_part, part_of

WORLD_SIZES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD = (False, True)
TP_MODES = ("1d", "2d", "2.5d", "3d")
CI_TP_MODES = ("1d",)
# PP × TP × FSDP on 8 ranks must be in the CI subset even though pairs alone do not force it;
# so must CP's second rotate method with each other parallelism and with gradient accumulation.
MUST = (
    frozenset({"pp:1F1B", "tp", "fsdp", "8ranks"}),
    frozenset({"cp:alltoall", "fsdp", "grad_accum"}),
    frozenset({"cp:alltoall", "hsdp"}),
    frozenset({"cp:alltoall", "tp", "pp:1F1B"}),
)


def _base_config(extra: list[str] | tuple[str, ...] = ()):
    from titanlab.components import builders as components
    from titanlab.config.manager import build_config

    config = build_config([*BASE_ARGS, *extra])
    tokenizer = components.build_tokenizer(config)
    return config, components.build_model_args(config, tokenizer.vocab_size)


def valid_layouts(
    world_sizes=WORLD_SIZES,
    extra: list[str] | tuple[str, ...] = (),
    device_type: str = "cpu",
    **enumerate_options,
) -> list[Layout]:
    """The layouts of `world_sizes` the trainer accepts for the base run plus `extra` options
    (e.g. an MoE model: `with_ep=True` then adds every expert-parallel degree)."""
    config, model_args = _base_config(extra)
    return [
        lay
        for ws in world_sizes
        for lay in enumerate_layouts(ws, **enumerate_options)
        if check_layout(config, lay, GLOBAL_BATCH, model_args, device_type) is None
    ]


def global_microbatches(layout: Layout) -> int:
    """Forward passes per rank per step (accumulation steps × pipeline microbatches of 1
    sample): the global microbatches a per-microbatch statistic is taken over."""
    local = layout.local_batch_size(GLOBAL_BATCH) or 1
    return layout.grad_accum * (local if layout.pp > 1 else 1)


def matrix(world_sizes=WORLD_SIZES, device_type: str = "cpu") -> list[tuple[Layout, str | None]]:
    """Every candidate layout of `world_sizes` with the validator's verdict (None: valid)."""
    config, model_args = _base_config()
    return [
        (lay, check_layout(config, lay, GLOBAL_BATCH, model_args, device_type))
        for ws in world_sizes
        for lay in enumerate_layouts(
            ws, with_cp=True, zero_stages=ZERO_STAGES, offload=OFFLOAD, tp_modes=TP_MODES
        )
    ]


def ci_layouts(device_type: str = "cpu") -> list[Layout]:
    """The representative subset CI runs: pairwise coverage of the valid layouts at ZeRO stage 3
    with 1D tensor parallel (`in_ci`). The ZeRO variants (each stage's collectives and losses
    are checked in CI by tests/integration/test_comm_bytes.py) and 2D / 2.5D / 3D tensor
    parallel (DTensor runs of 30-70 s each on 2 cores; CI checks 2D's loss, gradients and
    communication against 1D in tests/unit/tooling/test_tp_mode_bench.py and 2D × FSDP in
    tests/unit/distributed/tensor_parallel/test_grid_dp.py) run in `make test-parity-full`."""
    return pairwise_subset(
        [lay for lay, why in matrix(device_type=device_type) if why is None and in_ci(lay)],
        must=MUST,
    )


def in_ci(layout: Layout) -> bool:
    """Whether `layout` may be in CI's subset (see `ci_layouts`)."""
    return not layout.variants and layout.tp_mode in CI_TP_MODES


def format_table(outcomes: list[Outcome]) -> str:
    """Markdown table: one row per layout, worst |Δloss| or the refusal."""
    header = f"| layout | ranks | worst \\|Δloss\\| ({LAYOUT_STEPS} steps) | result |"
    rows = [header, "|---|---|---|---|"]
    for o in sorted(outcomes, key=lambda o: (o.world_size, o.refused is not None, o.layout)):
        if o.refused:
            rows.append(f"| {o.layout} | {o.world_size} | — | refused: {o.refused} |")
        elif o.error:
            rows.append(f"| {o.layout} | {o.world_size} | — | **failed**: {o.error} |")
        else:
            verdict = "pass" if o.passed else f"**FAIL** (> {TOLERANCE:g})"
            rows.append(f"| {o.layout} | {o.world_size} | {o.max_abs_diff:.2e} | {verdict} |")
    return "\n".join(rows)


def write_doc(
    path: str, outcomes: list[Outcome], command: str, host: str, block_name: str = "parity-matrix"
) -> None:
    """Replace the table between the markers in `path` (appended when the markers are absent)."""
    ran = [o for o in outcomes if not o.refused]
    passed = sum(o.passed for o in ran)
    block = "\n".join(
        [
            f"<!-- {block_name}:begin -->",
            f"Command: `{command}` on {host}. {len(outcomes)} candidate layouts, {len(ran)} valid, "
            f"{passed} within {TOLERANCE:g} of the 1-process losses over {LAYOUT_STEPS} steps, "
            f"{len(outcomes) - len(ran)} refused by the validator.",
            "",
            format_table(outcomes),
            f"<!-- {block_name}:end -->",
        ]
    )
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    begin, end = f"<!-- {block_name}:begin -->", f"<!-- {block_name}:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    ap.add_argument("--subset", choices=["full", "ci"], default="full")
    ap.add_argument(
        "--only", default="", help="run only layouts whose name matches this regular expression"
    )
    ap.add_argument("--work-dir", default=os.path.join(REPO, "outputs", "parity_matrix"))
    ap.add_argument(
        "--record",
        default=parity_record.RECORD,
        help="JSON-lines record of outcomes with their commits, reused while the training code "
        "is unchanged ('' to keep none)",
    )
    ap.add_argument("--part", default="", help="k/n: only the layouts of part k of n (by name)")
    ap.add_argument(
        "--output",
        default=os.path.join(REPO, "docs", "parallelism.md"),
        help="Markdown file to write the table into ('' to skip)",
    )
    ap.add_argument(
        "--block",
        default="parity-matrix",
        help="name of the marked block the table replaces (a partial run writes its own block)",
    )
    args = ap.parse_args(argv)

    verdicts = matrix(args.world_sizes)
    chosen = set(ci_layouts()) if args.subset == "ci" else {lay for lay, _ in verdicts}
    verdicts = [
        (lay, why) for lay, why in verdicts if lay in chosen and re.search(args.only, lay.name)
    ]
    whole = verdicts
    if args.part:
        k, n = parse_part(ap, args.part)
        verdicts = [(lay, why) for lay, why in verdicts if part_of(lay.name, n) == k]
    os.makedirs(args.work_dir, exist_ok=True)
    done = parity_record.load(args.record) if args.record else {}
    commit = parity_record.run_commit()
    if args.record and commit is None:
        print("the training code has uncommitted edits: this run's layouts are not reusable")
    dataset, seed, reference = prepare_reference(args.work_dir)
    outcomes = []
    for i, (lay, why) in enumerate(verdicts, 1):
        if why is not None:
            outcome = Outcome(lay.name, lay.world_size, None, refused=why)
        elif lay.name in done:
            outcome = done[lay.name]
        else:
            outcome = run_layout(lay, dataset, seed, reference, args.work_dir)
            outcome.commit = commit
            if args.record:
                parity_record.append(outcome, args.record)
        outcomes.append(outcome)
        status = (
            "refused"
            if outcome.refused
            else outcome.error or f"{outcome.max_abs_diff:.2e} {'ok' if outcome.passed else 'FAIL'}"
        )
        print(f"[{i}/{len(verdicts)}] {lay.name}: {status} ({outcome.seconds:.0f} s)", flush=True)
    print(format_table(outcomes))
    table = outcomes
    if args.part and args.record:  # the table is the whole selection's, once every part has run
        recorded = parity_record.load(args.record)
        table = [recorded.get(lay.name) or Outcome(lay.name, lay.world_size, None, refused=why)
                 for lay, why in whole if why is not None or lay.name in recorded]  # fmt: skip
        if len(table) < len(whole):
            print(
                f"table not written: {len(whole) - len(table)} layouts of other parts not run yet"
            )
            table = []
    if args.output and table:
        from titanlab.observability.hostinfo import cpu_model, ram_gib

        command = "python tools/parity_matrix.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        host = f"{cpu_model()}, {os.cpu_count()} cores, {ram_gib():.0f} GiB, no GPU (gloo)"
        write_doc(args.output, table, command.strip(), host, args.block)
    failed = [o for o in outcomes if not o.refused and not o.passed]
    print(
        f"parity matrix: {len(outcomes) - len(failed)} of {len(outcomes)} ok"
        f"{'; failed: ' + ', '.join(o.layout for o in failed) if failed else ''}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
