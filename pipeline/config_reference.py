"""The configuration reference (docs/guide/configuration.md), generated from the config
dataclasses: one table per stage with every key, its type, its default and its docstring.

``python -m pipeline.config_reference`` rewrites the page; ``--check`` exits 1 when the page
is not what the dataclasses say (``make config-docs`` and a test use it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.config import DataPrepConfig
from finetune.config import FinetuneConfig
from onebit_bert.config import describe_config
from onebit_bert.io import atomic_write_text
from pipeline.experiment import ExperimentConfig
from pretrain.config import PretrainConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "configuration.md"
STAGES = (
    ("Data preparation", "python -m data_prep", DataPrepConfig),
    ("Pretraining", "python -m pretrain", PretrainConfig),
    ("Fine-tuning", "python -m finetune", FinetuneConfig),
    ("Experiments", "python -m pipeline run", ExperimentConfig),
)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole page."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `make config-docs` (do not edit by hand; a",
        "test fails when this page and the code disagree). Every key can be set in a YAML file",
        "(`--config`) or on the command line as `section.field=value`; later wins.",
        "",
    ]
    for title, command, cls in STAGES:
        lines += [f"## {title}", "", f"`{command}` (`{cls.__module__}.{cls.__name__}`)", ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for item in describe_config(cls):
            if item.section:
                continue
            lines.append(
                f"| `{item.key}` | {_cell(item.type)} | {_cell(item.default)} | {_cell(item.doc)} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.config_reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is stale: run make config-docs", file=sys.stderr)
            return 1
        return 0
    atomic_write_text(args.out, text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
