"""Pages that quote a comparison report cannot drift from it.

A comparison's ``report.json`` renders its own headline (:func:`headline`: per bandwidth,
the leading group, the recipes clearly behind, LAMB's time). A page quotes it between two
markers naming the report::

    <!-- headline: docs/results/compare/tuned/report.json -->
    ...generated text...
    <!-- /headline -->

``python -m pipeline.reports.pages`` rewrites every such block from its report
(``--check``: only says which pages differ, exit code 1), and checks the README's table
rows that cite a comparison report: each decimal they quote must be one of the report's
answers (:func:`row_drift`; exit code 1 when not: a row is fixed by hand).
:func:`report_md_drift` checks the other direction: every table of a ``report.md`` that its
``report.json`` holds the numbers of (strategies, groups, crossover, same data, tuning) is
rendered again from the JSON and must appear in it line for line.
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


ROW_NUMBER = re.compile(r"(?<![\d.])(\d+\.\d+)(?![\d.]|\s*×)")
"""A decimal number in a table row, other than a ratio (``1.62×``)."""


def quotable(report: dict) -> set[float]:
    """The values a page may quote from a comparison report's answers: every group entry's
    mean time and interval in hours and its p against the first, the crossovers (Gbit/s;
    at each repeat, their ranges), the paired samples ratio with its interval and p, and
    the test's alpha."""
    values = {ranking.ALPHA}
    for row in report.get("groups") or []:
        for entry in row["ranking"]:
            values.update(v / 3600 for v in (entry["mean"], *(entry.get("interval") or ())))
            if entry.get("p_vs_first") is not None:
                values.add(entry["p_vs_first"])
    for row in report.get("crossover") or []:
        found = (row["crossover_gbps"], *row["crossover_range_gbps"],
                 *row.get("crossover_by_repeat_gbps", ()))  # fmt: skip
        values.update(v for v in found if v is not None)
        paired = row.get("samples_paired")
        if paired:
            values.update((paired["geometric_mean"], paired["p"], *paired["interval"]))
    return values


def row_drift(text: str, report_md: str, report: dict) -> list[str]:
    """The numbers of ``text``'s table rows that cite ``report_md`` (a markdown link to it)
    which none of the report's quotable values (:func:`quotable`) gives at the same
    decimals (empty: no drift). Ratios (``1.62×``) and whole numbers are not checked."""
    values = quotable(report)
    stale = []
    for line in text.splitlines():
        if not line.startswith("| ") or f"]({report_md})" not in line:
            continue
        for token in ROW_NUMBER.findall(line):
            decimals = len(token.split(".")[1])
            if not any(f"{v:.{decimals}f}" == token for v in values):
                stale.append(f"{token} in: {line[:60]}…")
    return stale


def readme_drift(root: Path = REPO) -> list[str]:
    """:func:`row_drift` of README.md's rows that cite a comparison report (one with
    groups)."""
    text = (root / "README.md").read_text()
    stale = []
    for link in sorted(set(re.findall(r"\]\((docs/results/[^)#]*/report\.md)\)", text))):
        json_path = root / f"{link.removesuffix('.md')}.json"
        report = json.loads(json_path.read_text()) if json_path.is_file() else {}
        if "groups" in report:  # a comparison report; other reports are not read here
            stale += row_drift(text, link, report)
    return stale


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
    numbers = readme_drift()
    if numbers:  # a row is prose: it is fixed by hand, never rewritten
        print("README.md rows quote numbers their report does not give (edit them by hand): "
              + "; ".join(numbers))  # fmt: skip
    return 1 if (stale and args.check) or numbers else 0


if __name__ == "__main__":
    sys.exit(main())
