"""Measure the communication of one training step per rank and check it against closed forms.

    python tools/comm_bytes.py [--layouts "FSDP 2,TP 2"] [--dataset DIR] [--no-write]

For each layout it launches the real trainer under torchrun (gloo, `debugmodel_deep`, seq 64,
local batch 2, 2 steps) with `TITANLAB_COMM_COUNT` set, so every rank writes the calls and
bytes of each collective kind of step 2 (`titanlab/distributed/comm_counter.py` defines
"bytes"). `predict` gives the same numbers from the model dims and the layout alone; the
table of both replaces the block between the markers in docs/parallelism.md (unless
--no-write). The formulas are explained in that document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "parallelism.md")
BEGIN, END = "<!-- comm-table:begin (tools/comm_bytes.py) -->", "<!-- comm-table:end -->"

from tools.lib.comm_measure import (  # re-exported: the tests use comm_bytes.*
    dump_folder,
    losses,
    make_dataset,
    measure,
    train_args,
)
from tools.lib.comm_predict import (  # re-exported: the tests use comm_bytes.*
    LAYOUTS,
    Layout,
    histogram,
    model_args,
    param_bytes,
    parameter_traffic,
    predict,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "dump_folder",
    "histogram",
    "losses",
    "make_dataset",
    "measure",
    "model_args",
    "param_bytes",
    "parameter_traffic",
    "predict",
    "train_args",
]


def table_rows(lay: Layout, measured: list[dict], args) -> list[tuple]:
    """(layout, ranks, kind, calls measured/predicted, measured bytes, predicted bytes, ratio,
    measured ring wire bytes, every size equal) rows; ranks with equal numbers are shown once."""
    groups: dict[str, list[int]] = {}
    for r, kinds in enumerate(measured):
        key = json.dumps([kinds, histogram(predict(lay, args, r))], sort_keys=True)
        groups.setdefault(key, []).append(r)
    rows = []
    for key, ranks in groups.items():
        kinds, _ = json.loads(key)
        terms = predict(lay, args, ranks[0])
        pred_hist = histogram(terms)
        label = "all" if len(ranks) == lay.nproc else ",".join(map(str, ranks))
        for kind in sorted(set(kinds) | set(pred_hist)):
            m = kinds.get(kind, {"calls": 0, "bytes": 0, "sizes": {}})
            pc = sum(t.calls for t in terms if t.kind == kind)
            pb = sum(t.calls * t.nbytes for t in terms if t.kind == kind)
            ratio = m["bytes"] / pb if pb else float("nan")
            rows.append(
                (
                    lay.name,
                    label,
                    kind,
                    f"{m['calls']}/{pc}",
                    m["bytes"],
                    pb,
                    ratio,
                    m.get("wire_bytes", 0),
                    m["sizes"] == pred_hist.get(kind, {}),
                )
            )
    return rows


def format_table(rows: list[tuple]) -> str:
    lines = [
        "| layout | ranks | kind | calls measured/predicted | bytes measured | bytes predicted"
        " | ratio | every call's size as predicted | ring bytes sent (measured) |",
        "|---|---|---|---|---:|---:|---:|---|---:|",
    ]
    for name, ranks, kind, calls, mb, pb, ratio, wire, same in rows:
        lines.append(
            f"| {name} | {ranks} | {kind} | {calls} | {mb:,} | {pb:,} | {ratio:.3f} | "
            f"{'yes' if same else 'NO'} | {wire:,} |"
        )
    return "\n".join(lines)


def write_doc(table: str) -> None:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{table}\n{END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="", help="comma-separated layout names (default: all)")
    ap.add_argument(
        "--dataset", default="", help="prepared dataset (default: a small one made here)"
    )
    ap.add_argument("--workdir", default="", help="where runs write (default: a temporary folder)")
    ap.add_argument("--no-write", action="store_true", help=f"do not update {DOC}")
    opts = ap.parse_args()
    wanted = [n.strip() for n in opts.layouts.split(",") if n.strip()]
    unknown = set(wanted) - {lay.name for lay in LAYOUTS}
    if unknown:
        ap.error(f"unknown layouts {sorted(unknown)}; choose from {[l.name for l in LAYOUTS]}")
    workdir = opts.workdir or tempfile.mkdtemp(prefix="comm_bytes_")
    dataset = opts.dataset or make_dataset(os.path.join(workdir, "data"))
    args, rows = model_args(), []
    for lay in LAYOUTS:
        if not wanted or lay.name in wanted:
            rows += table_rows(lay, measure(lay, dataset, workdir), args)
            print(f"measured {lay.name}", file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table)
    if not opts.no_write and not wanted:
        write_doc(table)
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
