"""The advisor: a described cluster answered in-process from the comparison's report, and
the --measure path on 2 real gloo ranks (the probe, its fit, and the CLI inside a job)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from collections import Counter

import pytest

from pipeline.reports import advise, crossover, linkmodel
from tests.helpers.distributed_harness import run_ranks

REPORT = linkmodel.REPO / advise.REPORT


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = advise.main(argv)
    return code, out.getvalue()


def test_a_described_cluster_gets_groups_times_and_evidence():
    code, text = _run(["--nodes", "16", "--gpus-per-node", "8", "--link-gbps", "10", "--json"])
    assert code == 0
    advice = json.loads(text)
    assert advice["cluster"] == {"nodes": 16, "gpus_per_node": 8, "ranks": 128,
                                 "link_gbps": 10.0, "latency_us": 0.0}  # fmt: skip
    groups = advice["groups"]
    assert groups["leaders"] and set(groups["leaders"]).isdisjoint(groups["behind"])
    assert "zero_one_adam" in advice["never_reached"]  # no seed reached the target
    # LAMB's time is the model's, at the preset's scales (BERT-Large on an H200)
    report = json.loads(REPORT.read_text())
    profiles, _ = linkmodel.load_profiles(report["time_model"]["netem"])
    scales = advice["scales"]
    lamb = crossover.recipe_times(report, profiles, 10e9, 128, 8, **scales)["lamb"]
    assert advice["recipes"]["lamb"]["mean"] == pytest.approx(lamb["mean"])
    evidence = advice["recipes"]["lamb"]["evidence"]
    assert evidence["seeds"] == [2, 3, 4, 5, 6, 7] and evidence["reached"] == 6
    assert "4 workers" in evidence["regime"] and evidence["speeds_from"]
    assert "small regime" in advice["caveat"] and "bert-tiny" in advice["caveat"]

    code, text = _run(["--nodes", "16", "--gpus-per-node", "8", "--link-gbps", "10"])
    assert "Answer: leaders not separable" in text or "is ahead of every recipe tested" in text
    assert "Caveat: The evidence comes from a small regime" in text


def test_a_slower_link_favours_the_recipes_that_send_less():
    report = json.loads(REPORT.read_text())
    profiles, _ = linkmodel.load_profiles(report["time_model"]["netem"])
    slow = advise.advise(report, profiles, 16, 8, 0.1, params=335_000_000, netem_params=11267900)
    fast = advise.advise(report, profiles, 16, 8, 100, params=335_000_000, netem_params=11267900)
    slow_ratio = slow["recipes"]["lamb"]["mean"] / slow["recipes"]["powersgd"]["mean"]
    fast_ratio = fast["recipes"]["lamb"]["mean"] / fast["recipes"]["powersgd"]["mean"]
    assert slow_ratio > fast_ratio
    with pytest.raises(ValueError, match="nodes >= 1"):
        advise.advise(report, profiles, 0, 8, 10)


def test_bad_arguments_say_what_to_give(capsys):
    with pytest.raises(SystemExit):
        advise.main([])
    assert "--nodes N --link-gbps B" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        advise.main(["--nodes", "2", "--link-gbps", "1", "--report", "no/report.json"])
    assert "no such report.json" in capsys.readouterr().err


def _probe(comm):
    return advise.measure_link(comm, 1, sizes=(1 << 12, 1 << 16, 1 << 18), repeats=2)


def _cli_in_a_job(comm):
    os.environ.update(RANK=str(comm.rank), WORLD_SIZE=str(comm.world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")  # fmt: skip
    return _run(["--measure", "--json"])


def test_measure_fits_the_link_on_two_gloo_ranks():
    first, second = run_ranks(_probe, 2)
    assert first == second  # every rank fits the slowest rank's times
    assert first["ranks"] == 2 and len(first["probe"]) == 3
    assert math.isfinite(first["link_gbps"]) and first["link_gbps"] > 0
    assert first["latency_us"] >= 0
    (code0, text0), (code1, text1) = run_ranks(_cli_in_a_job, 2)
    assert code0 == code1 == 0 and text1 == ""  # rank 0 answers
    advice = json.loads(text0)
    assert advice["cluster"]["nodes"] == 2 and advice["cluster"]["gpus_per_node"] == 1
    assert advice["cluster"]["link_gbps"] == pytest.approx(advice["measured"]["link_gbps"])
    assert advice["groups"]["leaders"]


def test_seeds_pair_in_the_advice_as_they_pair_in_the_report():
    report = json.loads(REPORT.read_text())
    profiles, _ = linkmodel.load_profiles(report["time_model"]["netem"])
    for run in report["runs"]:  # a record whose data is not known pairs with nothing
        if run["name"] == "lamb":
            run.pop("data", None)
    recorded = {r["name"] for r in report["runs"] if r.get("data")}
    assert "lamb" not in recorded and len(recorded) > 1
    tests = []
    for link in (0.025, 10.0):
        groups = advise.advise(report, profiles, 1, 4, link)["groups"]
        first, *others = groups["ranking"]
        tested = [e for e in others if "test" in e]
        assert tested
        for entry in tested:
            both = {first["name"], entry["name"]} <= recorded
            assert entry["test"] == ("paired" if both else "welch"), (link, entry["name"])
            tests.append(entry["test"])
    assert {"paired", "welch"} <= set(tests)
    counts = Counter(r["name"] for r in report["runs"])
    low, high = min(counts.values()), max(counts.values())
    assert high == 6 and f"{low} to {high} fresh seeds per recipe" in advise.caveat(report)
