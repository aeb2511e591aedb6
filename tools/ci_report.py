"""The end of a CI run: each stage's time, the whole run's time against the budget, and the
slowest tests of every pytest stage together (`.ci/run` calls it, also when a stage failed).

Usage: python tools/ci_report.py REPORTS_DIR [--wall SECONDS] [--slowest N] [--budget-min M]

REPORTS_DIR holds `stages.tsv` (one `name<TAB>seconds` line per finished stage, written by
`.ci/run`; a stage run in the background beside others is marked "(overlapped)") and the
pytest stages' JUnit files (`*.xml`, `--junitxml`). A test's time is its
setup, call and teardown together (pytest's JUnit default, `junit_duration_report = total`).
"""

from __future__ import annotations

import argparse
import glob
import os
import xml.etree.ElementTree as ET


def read_stages(folder: str) -> list[tuple[str, float]]:
    """(stage, seconds) in the order the stages ran."""
    path = os.path.join(folder, "stages.tsv")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [(name, float(seconds)) for name, seconds in rows]


def read_tests(folder: str) -> list[tuple[float, str, str]]:
    """(seconds, stage, test id) of every test case in the JUnit files of `folder`."""
    tests = []
    for path in sorted(glob.glob(os.path.join(folder, "*.xml"))):
        stage = os.path.splitext(os.path.basename(path))[0]
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            tests.append((float(case.get("time") or 0.0), stage, name))
    return tests


def report(
    folder: str, wall: float | None = None, slowest: int = 20, budget_min: float = 30.0
) -> str:
    """The stage table, the run's time against `budget_min` (`wall` seconds, or else the sum of
    the stages that were not overlapped), and the `slowest` tests."""
    lines = ["", "CI stages (seconds):"]
    stages = read_stages(folder)
    for name, seconds in stages:
        lines.append(f"  {name:<24} {seconds:7.0f}  ({seconds / 60:4.1f} min)")
    total = wall if wall is not None else sum(s for n, s in stages if "overlapped" not in n)
    verdict = "within" if total <= budget_min * 60 else "OVER"
    lines.append(f"  {'total':<24} {total:7.0f}  ({total / 60:4.1f} min, {verdict} the "
                 f"{budget_min:g}-minute budget)")  # fmt: skip
    tests = sorted(read_tests(folder), reverse=True)
    if tests:
        lines += ["", f"The {min(slowest, len(tests))} slowest of {len(tests)} tests (seconds):"]
        for seconds, stage, name in tests[:slowest]:
            lines.append(f"  {seconds:7.1f}  [{stage}] {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the reports folder (stages.tsv and JUnit *.xml)")
    parser.add_argument("--wall", type=float, help="the run's wall-clock seconds")
    parser.add_argument("--slowest", type=int, default=20, help="how many tests to list")
    parser.add_argument("--budget-min", type=float, default=30.0, help="CI budget, minutes")
    args = parser.parse_args()
    print(report(args.folder, args.wall, args.slowest, args.budget_min))


if __name__ == "__main__":
    main()
