"""What the stages' entry points share: the ``--config FILE [section.field=value ...]``
command line with the config's fields in ``--help``, and one line on stderr for an error
a user can fix."""

from __future__ import annotations

import argparse
import sys

from onebit_bert.config import HELP_HEADING, config_help
from onebit_bert.io import NoSpaceError


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_class: type,
    *,
    shipped: str | None = None,
    overrides: str = "section.field=value",
    heading: str | None = HELP_HEADING,
) -> argparse.ArgumentParser:
    """Give ``parser`` a ``--config`` file and ``overrides``, and list ``config_class``'s
    fields under ``heading`` after its help (None: not listed). ``shipped``: the folder of
    the shipped configs, and ``--config`` is required; None: it is optional (the overrides
    alone can make a config)."""
    if shipped is None:
        parser.add_argument("--config", help="YAML config (optional; overrides also work alone)")
    else:
        parser.add_argument("--config", required=True, help=f"YAML config (see {shipped})")
    parser.add_argument("overrides", nargs="*", help=f"{overrides} overrides")
    if heading is not None:
        parser.epilog = config_help(config_class, heading=heading)
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def report_error(err: BaseException | str, code: int) -> int:
    """Print ``error: <err>`` on stderr (a full device without its ``[Errno 28]``) and
    return ``code``, the exit status."""
    text = err.strerror if isinstance(err, NoSpaceError) else err
    print(f"error: {text}", file=sys.stderr, flush=True)
    return code
