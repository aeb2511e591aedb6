"""`tools/ci_report.py`: the stage table with the run's time against the budget, and the slowest
tests of every pytest stage together, longest first."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
from tools.ci_report import report

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.{stage}.test_a" name="test_{a}" time="{ta}"/>
<testcase classname="tests.{stage}.test_b" name="test_{b}" time="{tb}"/>
</testsuite></testsuites>"""


def test_stages_total_and_slowest_tests_across_stages(tmp_path):
    (tmp_path / "stages.tsv").write_text(
        "setup\t60.5\nllama-cpp (overlapped)\t150.0\nunit\t300.0\nintegration\t900.0\n"
    )
    (tmp_path / "unit.xml").write_text(JUNIT.format(stage="unit", a="x", ta=1.5, b="y", tb=20))
    (tmp_path / "integration.xml").write_text(
        JUNIT.format(stage="integration", a="z", ta=95.25, b="w", tb=0.1)
    )
    text = report(str(tmp_path), slowest=3)
    assert "1260  (21.0 min, within the 30-minute budget)" in text  # overlapped not summed
    slow = text.split("slowest of 4 tests")[1].splitlines()[1:]
    assert [line.split()[-1] for line in slow] == [
        "tests.integration.test_a::test_z", "tests.unit.test_b::test_y", "tests.unit.test_a::test_x"
    ]  # fmt: skip
    assert "OVER the 30-minute budget" in report(str(tmp_path), wall=1801)
