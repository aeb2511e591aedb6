"""A pytest plugin (`-p tests.cover_plugin`) that writes, after collection, every item's cover
cells and whether CI runs it, to the JSON file `$TITANLAB_COVER_OUT` (`tests/coverage_spec.py`
reads it). Without that variable it does nothing.

An item runs in CI unless a `skip` marker, or a `skipif` marker whose condition is true in this
process, is on it. Conditions that are strings are not evaluated: the suite writes them as
booleans. Items marked `gpu` do not run in CI (it has no GPU).
"""

from __future__ import annotations

import json
import os


def _skip_reason(item) -> str | None:
    if item.get_closest_marker("gpu") is not None:
        return "needs a CUDA GPU"
    for mark in item.iter_markers("skip"):
        return str(mark.kwargs.get("reason", mark.args[0] if mark.args else "skip"))
    for mark in item.iter_markers("skipif"):
        condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
        if isinstance(condition, str):
            raise TypeError(f"{item.nodeid}: a skipif condition must be a bool, not {condition!r}")
        if condition:
            return str(mark.kwargs.get("reason", "skipif"))
    return None


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cover(*cells): the cover cells this test meets")


def pytest_collection_finish(session) -> None:
    out = os.environ.get("TITANLAB_COVER_OUT")
    if not out:
        return
    records = []
    for item in session.items:
        reason = _skip_reason(item)
        cells = sorted({c for mark in item.iter_markers("cover") for c in mark.args})
        records.append({"nodeid": item.nodeid, "cells": cells, "ci": reason is None,
                        "reason": reason})  # fmt: skip
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f)
