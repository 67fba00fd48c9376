"""Pages that quote the comparison report agree with its report.json: the headline blocks
of README.md and docs/guide/, and report.md's own tables, rendered again from the JSON."""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.reports import pages, ranking
from tests.helpers.paths import REPO

TUNED = REPO / "docs" / "results" / "compare" / "tuned"


def test_every_quoted_headline_matches_its_report():
    quoted = pages.pages()
    assert REPO / "README.md" in quoted and REPO / "docs/guide/strategies.md" in quoted
    stale = [str(p.relative_to(REPO)) for p in quoted if pages.refresh(p.read_text(), p)
             != p.read_text()]  # fmt: skip
    assert not stale, f"run python -m pipeline.reports.pages: {stale} differ from their reports"


def test_the_tuned_reports_tables_are_its_json():
    drift = pages.report_md_drift(TUNED)
    assert not drift, f"report.md lines its report.json does not give: {drift[:3]}"


def test_a_changed_number_is_caught(tmp_path):
    shutil.copy(TUNED / "report.json", tmp_path / "report.json")
    text = (TUNED / "report.md").read_text()
    # one time in the strategies table, one in the groups' answer
    report = json.loads((TUNED / "report.json").read_text())
    shown = ranking.human_seconds(report["groups"][0]["ranking"][0]["mean"])
    assert shown in text
    (tmp_path / "report.md").write_text(text.replace(shown, "999.99 h", 1))
    assert len(pages.report_md_drift(tmp_path)) >= 1
    page = tmp_path / "page.md"
    block = f"<!-- headline: {TUNED.relative_to(REPO)}/report.json -->\n"
    page.write_text(f"x\n{block}stale\n<!-- /headline -->\ny\n")
    fresh = pages.refresh(page.read_text(), page)
    assert "stale" not in fresh and fresh.startswith("x\n") and fresh.endswith("y\n")
    first = report["groups"][0]["ranking"][0]
    assert f"{first['mean'] / 3600:.2f} h" in fresh
    assert pages.refresh(fresh, page) == fresh
    page.write_text("<!-- headline: docs/no/report.json -->\n<!-- /headline -->\n")
    with pytest.raises(FileNotFoundError, match="docs/no/report.json.*fix the marker"):
        pages.refresh(page.read_text(), page)


def test_the_report_json_carries_one_data_identity_one_sweep_and_the_groups():
    report = json.loads((TUNED / "report.json").read_text())
    assert all("data" in r for r in report["runs"])
    assert report["data"]["mixed"] is False and len(report["data"]["identities"]) == 1
    sweeps = report["time_model"]["sweeps"]
    assert len(sweeps) == 1 and sweeps[0]["sweep_id"] and sweeps[0]["repeats"] >= 2
    plan = ranking.load_preregistration(REPO / ranking.PREREGISTERED)
    stated = report["groups_preregistration"]
    assert stated == {**plan.as_dict(), "path": ranking.PREREGISTERED} and stated["leaders"]
    assert [row["bandwidth_mbit"] for row in report["groups"]] == list(plan.bandwidths_mbit)
    for row in report["groups"]:
        assert row["leaders"] and "paired" in row["test"]
        censored = [e for e in row["ranking"] if e["lower_bound"]]
        assert all(any(e["censored"]) for e in censored)
        # the groups are read: every leader has the seeds the rule asks, each a pair
        by_name = {e["name"]: e for e in row["ranking"]}
        for name in row["leaders"]:
            assert by_name[name]["seeds"] >= plan.seeds
        for name in row["leaders"][1:]:
            assert by_name[name]["pairs_vs_first"] >= plan.seeds
    assert ranking.seeds_owed(report, plan.within, plan.seeds, plan.leaders) == []


def test_the_headline_says_which_seeds_the_preregistration_still_owes():
    report = json.loads((TUNED / "report.json").read_text())
    plan = ranking.load_preregistration(REPO / ranking.PREREGISTERED).as_dict()
    many = {**plan, "seeds": 99}  # more than any recipe has
    owed = ranking.seeds_owed(report, many["within"], many["seeds"])
    text = pages.headline({**report, "groups_preregistration": many}, "r.json")
    first = f"{owed[0]['name']} ({owed[0]['seeds']}/99)"
    assert f"pre-registered on {plan['preregistered']}" in text and first in text
    assert "provisional" in text
    done = {**plan, "seeds": 1}
    assert "to 1 seeds, all run):" in pages.headline(
        {**report, "groups_preregistration": done}, "r.json"
    )


def test_the_readmes_rows_quote_only_the_reports_numbers():
    assert pages.readme_drift() == [], "edit the README's rows to the report's numbers"
    report = json.loads((TUNED / "report.json").read_text())
    link = "docs/results/compare/tuned/report.md"
    first = report["groups"][0]["ranking"][0]
    shown = f"{first['mean'] / 3600:.2f}"
    cross = report["crossover"][0]["crossover_gbps"]
    row = f"| q | a | {shown} h, α 0.05, 1.62× at 100 Mbit/s, {cross:.2f} Gbit/s | [d]({link}) |"
    assert pages.row_drift(row, link, report) == []
    # a number the report does not give, at the same decimals, is caught
    stale = row.replace(f"{shown} h", "9.99 h")
    assert [s.split()[0] for s in pages.row_drift(stale, link, report)] == ["9.99"]
    # a row that cites another page is not read
    assert pages.row_drift(stale.replace(link, "other.md"), link, report) == []
