"""Command-line parsing for titanlab's tools: a usage error is one line, exit status 2."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors print one `<prog>: error: ...` line (no
    usage block) and exit with status 2. Sub-parsers made with `parser_class=OneLineParser`
    inherit the behaviour."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog.split()[0]}: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """An argparse `type` for counts that must be >= 1: argparse reports the ValueError's
    wording as `argument --top: -3 is not a positive integer (>= 1)`."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (>= 1)")
    return value


def closest_option(name: str, parser: argparse.ArgumentParser) -> str:
    """`; did you mean '--device'?` when `name` (e.g. `--devices`) is close to one of
    `parser`'s own long options, else ""."""
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def unknown_own_option(rest: list[str], parser: argparse.ArgumentParser) -> str:
    """The error line for the first of `rest` (what `parse_known_args` left over for the
    trainer's `--section.key` options) that has no dot, so is no such option: an unknown option
    of `parser` itself, with the closest one (`--devices`: did you mean '--device'?) and the
    list of them; "" when there is none."""
    own = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    own = [s for s in own if s != "--help"]
    for arg in rest:
        name = arg.split("=", 1)[0]
        if not name.startswith("--") or "." in name:
            continue
        return (
            f"unknown option {name}{closest_option(name, parser)} (options: {', '.join(own)}, "
            "and the trainer's --section.key VALUE)"
        )
    return ""
