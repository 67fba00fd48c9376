"""What every report's command line shares: ``--run`` and ``--out``, and one way to fail.

A report's ``main`` builds its parser with :func:`report_parser`, adds its own options and
hands :func:`run` the function that writes it; that function returns the line to print.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def report_parser(
    module: str, description: str, run_help: str, runs_required: bool = True
) -> argparse.ArgumentParser:
    """``python -m <module>``'s parser with ``--run`` (repeatable) and ``--out``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--run", action="append", required=runs_required, default=[], help=run_help)
    parser.add_argument("--out", required=True, help="report directory")
    return parser


def run(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    write: Callable[[argparse.Namespace], str],
) -> int:
    """Parse ``argv`` and write the report: 0 after printing what ``write`` returned; 2
    after one line on stderr when the inputs are wrong (a missing or unreadable file, a
    value the report refuses)."""
    args = parser.parse_args(argv)
    try:
        done = write(args)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(done)
    return 0
