"""Plot runs' metrics against step to one PNG.

    python -m tools.plot_metrics RUN_DIR [RUN_DIR ...] [--out PATH] [--labels A B ...]

Each RUN_DIR is a dump folder holding `metrics.jsonl`; the PNG (default `<first RUN_DIR>/loss.png`)
has four panels: loss with validation loss dashed, tokens/s per rank, memory and gradient norm,
the runs overlaid with a legend. Needs matplotlib (`pip install 'titanlab[plot]'`).
Bad input (a folder without metrics.jsonl, matplotlib missing) ends with one line, exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlab.observability.plotting import plot_runs


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.plot_metrics", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="PNG path (default: <first RUN_DIR>/loss.png)")
    p.add_argument("--labels", nargs="+", default=None, help="legend names, one per run")
    a = p.parse_args(argv)
    if a.labels is not None and len(a.labels) != len(a.run_dirs):
        print(
            f"plot_metrics: error: --labels has {len(a.labels)} names for "
            f"{len(a.run_dirs)} runs; give one per RUN_DIR",
            file=sys.stderr,
        )
        return 2
    out = a.out or os.path.join(a.run_dirs[0], "loss.png")
    try:
        plot_runs(a.run_dirs, out, a.labels)
    except ValueError as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
