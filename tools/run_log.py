"""Reading the output of a failed training launch."""

from __future__ import annotations


def failure_line(log: str, limit: int = 300) -> str:
    """The line of a failed launch's output that says why it failed.

    The first line naming an error wins: under torchrun the rank that fails first prints the
    cause, and the other ranks then fail on broken connections. torchrun's own summary
    (`ChildFailedError`) is skipped, since it only says that a rank failed. Without an error
    line, the last line that is not a banner of `=` or `-` is returned, cut to `limit` chars.
    """
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and set(ln.strip()) - set("=-")]
    hits = [ln for ln in lines if ("Error" in ln or "error:" in ln) and "ChildFailed" not in ln]
    return (hits[0] if hits else (lines or ["(no output)"])[-1])[:limit]
