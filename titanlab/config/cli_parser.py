"""Command-line parsing for titanlab's tools: a usage error is one line, exit status 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors print one `<prog>: error: ...` line (no
    usage block) and exit with status 2. Sub-parsers made with `parser_class=OneLineParser`
    inherit the behaviour."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog.split()[0]}: error: {message}", file=sys.stderr)
        sys.exit(2)
