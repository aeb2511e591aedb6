"""`convert_checkpoint` run in this test's process: its exit status and what it printed to
stderr, as a subprocess would report them (argparse's usage errors exit through SystemExit).

Each test of the one-line errors keeps one case in a real subprocess (`python -m
tools.convert_checkpoint`), which proves that the process prints that line alone, with no
traceback, and exits 2; the rest of the cases check the message in-process, without a Python
start and torch import (~4 s each on CI's 2-core machine) per case."""

from __future__ import annotations

import pytest

from titanlab.checkpoint.convert_cli import main


def convert_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """(exit status, stderr) of `convert_checkpoint *args`."""
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err
