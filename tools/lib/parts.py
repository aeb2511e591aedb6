"""Parts of a long run, so that it can be spread over sessions of a few hours: item `name`
falls in part `crc32(name) mod n + 1` of `n`. `make test-full-part PART=k/n` takes part k of
the test modules (by path, `tests/full_parts.py`), of the parity matrix's layouts (by name,
`tools/parity_matrix.py --part k/n`) and of the flavors' dry runs (`tools/dry_run_flavors.py`)."""

from __future__ import annotations

import argparse
import zlib


def part_of(name: str, parts: int) -> int:
    """The part (1-based) among `parts` that `name` (a test module's path relative to the
    repository with forward slashes, or a layout's name) falls in."""
    return zlib.crc32(name.encode()) % parts + 1


def parse(value: str, what: str = "TITANLAB_FULL_PART") -> tuple[int, int]:
    """ "k/n" → (k, n). Raises ValueError (one line naming `what`) for anything else."""
    try:
        k, n = (int(v) for v in value.split("/"))
    except ValueError:
        raise ValueError(f"{what}={value!r}: give k/n, e.g. 1/4") from None
    if not 1 <= k <= n:
        raise ValueError(f"{what}={value!r}: k must be between 1 and n")
    return k, n


def parse_part(parser: argparse.ArgumentParser, value: str) -> tuple[int, int]:
    """A tool's `--part k/n` → (k, n); anything else ends the tool with one line (argparse's
    error, exit status 2)."""
    try:
        return parse(value, "--part")
    except ValueError as e:
        parser.error(str(e))
