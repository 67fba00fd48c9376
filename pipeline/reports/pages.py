"""Pages that quote a comparison report cannot drift from it.

A comparison's ``report.json`` renders its own headline (:func:`headline`: per bandwidth,
the leading group, the recipes clearly behind, LAMB's time). A page quotes it between two
markers naming the report::

    <!-- headline: docs/results/compare/tuned/report.json -->
    ...generated text...
    <!-- /headline -->

``python -m pipeline.reports.pages`` rewrites every such block from its report (``--check``: only
says which pages differ, exit code 1). :func:`report_md_drift` checks the other direction:
every table of a ``report.md`` that its ``report.json`` holds the numbers of (strategies,
groups, crossover, same data, tuning) is rendered again from the JSON and must appear in it line for
line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from pipeline.reports import compare_markdown, ranking
from pipeline.reports.crossover import crossover_lines
from pipeline.reports.runs import group_arms
from pipeline.reports.same_data import same_data_lines
from pipeline.tuning import tuning_lines

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(
    r"(<!-- headline: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /headline -->)", re.DOTALL
)
PAGES = ("README.md", "docs/guide/*.md")
"""Where quoted headlines live (the dated results pages keep the numbers of their day)."""


def headline(report: dict, source: str, link: str | None = None) -> str:
    """The report's answer per bandwidth as a page quotes it (markdown, ending in a
    newline); ``link``: the report's path relative to the page (default ``source``)."""
    target = report["target"]["val_mlm_loss"]
    mixed = ""
    if (report.get("data") or {}).get("mixed"):
        count = len(report["data"]["identities"])
        mixed = f"; **the records ran on {count} data identities, ranked together**"
    lines = [
        f"From [`{source}`]({link or source}) (target validation MLM loss {target:.4f}; modelled "
        "time to the target, mean over seeds, a seed that missed counted with its run's end "
        "as a lower bound, ≥; seeds at the target / seeds; against the first, the paired "
        "two-sided t-test on the log ratio of the seeds' times, Welch's where fewer than two "
        f"seeds pair, α {ranking.ALPHA:g}, detectable difference at {ranking.POWER:.0%} "
        f"power{mixed}):",
        "",
    ]
    plan = report.get("groups_preregistration")
    if plan:
        owed = ranking.seeds_owed(report, plan["within"], plan["seeds"],
                                  plan.get("leaders", False))  # fmt: skip
        state = (f"**still owed: {ranking.owed_text(owed, plan['seeds'])}, so these groups "
                 "are provisional**" if owed else "all run")  # fmt: skip
        lines[0] = lines[0].removesuffix("):") + (
            f"; pre-registered on {plan['preregistered']}: every recipe within "
            f"{plan['within'] * 100:g} % of the first"
            f"{' or among the leaders' if plan.get('leaders') else ''} to {plan['seeds']} "
            f"seeds, {state}):"
        )
    for row in report.get("groups") or []:
        by_name = {e["name"]: e for e in row["ranking"]}
        text = f"- **{ranking.bandwidth_label(row['bandwidth_mbit'])}**: {ranking.answer(row)}"
        if row["behind"]:
            behind = ", ".join(ranking.entry_text(by_name[n]) for n in row["behind"])
            text += f"; clearly behind: {behind}"
        lines.append(text + ".")
    return "\n".join(lines) + "\n"


def refresh(text: str, page: Path, root: Path = REPO) -> str:
    """``text`` (of the page at ``page``) with every headline block rendered again from the
    report it names (a path from the repository root)."""

    def render(match: re.Match) -> str:
        path = match["path"]
        report_path = root / path
        if not report_path.is_file():
            raise FileNotFoundError(
                f"a headline block names {path}, which does not exist: fix the marker's path"
            )
        link = os.path.relpath(report_path, page.resolve().parent)
        body = headline(json.loads(report_path.read_text()), path, link)
        return f"{match.group(1)}{body}{match.group(4)}"

    return BLOCK.sub(render, text)


def pages(root: Path = REPO) -> list[Path]:
    """The pages with at least one headline block."""
    found = []
    for pattern in PAGES:
        for path in sorted(root.glob(pattern)):
            if BLOCK.search(path.read_text()):
                found.append(path)
    return found


def report_md_drift(report_dir: Path) -> list[str]:
    """The lines of ``report_dir/report.md``'s tables, rendered again from its
    ``report.json``, that the markdown does not hold (empty: no drift)."""
    report = json.loads((report_dir / "report.json").read_text())
    markdown = set((report_dir / "report.md").read_text().splitlines())
    runs = report["runs"]
    data = {"arms": group_arms(runs), "pretraining": report["pretraining"], "runs": runs}
    bandwidths = sorted({bw for r in runs for bw in r["time_to_target"]["measured_bandwidths"]})
    expected = compare_markdown.strategy_table_lines(
        compare_markdown.strategy_rows(data, bandwidths), bandwidths
    )
    expected += ranking.group_lines(report.get("groups") or [])
    if report.get("same_data"):
        expected += same_data_lines(report["same_data"], data["arms"][0]["name"])
    expected += crossover_lines(report.get("crossover") or [])
    expected += tuning_lines(report.get("tuning") or {})
    return [line for line in expected if line and line not in markdown]


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.pages [--check]``: rewrite (or check) the quoted headlines."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.reports.pages", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    args = parser.parse_args(argv)
    stale = []
    for path in pages():
        text = path.read_text()
        new = refresh(text, path)
        if new != text:
            stale.append(str(path.relative_to(REPO)))
            if not args.check:
                path.write_text(new)
    verb = "differ from their reports" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "every quoted headline matches its report")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
