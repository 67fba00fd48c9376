"""The link and cluster-size model: the collectives' bytes per node, a sweep generated from
the model is predicted exactly, the crossover where two recipes' times meet, and the model
against the repository's own netem points."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.reports import crossover, crossover_check, linkmodel
from tests.helpers.netem_rows import V, two_seed_report
from tests.helpers.netem_rows import model_row as _row


def test_bytes_per_node_follow_each_collective():
    # a ring all-reduce: 2(p-1)/p of the payload through each node's link
    assert linkmodel.link_factor("ring", 4, 2) == pytest.approx(1.5)
    assert linkmodel.link_factor("ring", 64, 8) == pytest.approx(2 * 63 / 64)
    # the 1-bit all-to-all sends V/p to each rank outside the node, then a ring all-gather:
    # 1.75 on 2 nodes of 2 (the netem sweeps measured 2.50 MB for 1.43 MB of payload)
    assert linkmodel.link_factor("compressed", 4, 2) == pytest.approx(1.75)
    assert linkmodel.link_factor("compressed", 4, 1) == pytest.approx(1.5)
    assert linkmodel.link_factor("compressed", 128, 8) == pytest.approx(8 * 120 / 128 + 127 / 128)
    # the node hierarchy: the collective between n nodes only
    assert linkmodel.link_factor("node_ring", 128, 8) == pytest.approx(2 * 15 / 16)
    assert linkmodel.link_factor("node_compressed", 4, 4) == 0.0
    assert linkmodel.link_factor("neighbours", 8, 2, 2) == 2.0
    with pytest.raises(ValueError, match="unknown collective pattern"):
        linkmodel.link_factor("tree", 4, 2)


def test_each_recipe_stage_gets_its_collective():
    assert linkmodel.pattern_of("lamb", "default") == ("ring", 0)
    assert linkmodel.pattern_of("lamb_node", "default") == ("node_ring", 0)
    assert linkmodel.pattern_of("onebit_lamb", "warmup") == ("ring", 0)
    assert linkmodel.pattern_of("onebit_lamb", "compression") == ("compressed", 0)
    assert linkmodel.pattern_of("hybrid_onebit_lamb", "warmup") == ("compressed", 0)
    assert linkmodel.pattern_of("hybrid_onebit_lamb_node", "warmup") == ("node_compressed", 0)
    assert linkmodel.pattern_of("decentlam/ring", "default") == ("neighbours", 2)
    assert linkmodel.pattern_of("dmsgd/one_peer_exponential", "default") == ("neighbours", 1)


def test_a_sweep_made_by_the_model_is_predicted_exactly(tmp_path):
    path = tmp_path / "netem.json"
    path.write_text(json.dumps({"results": [_row(25, 8.0, 8.5), _row(10000, 8.0, 8.5)]}))
    other = tmp_path / "other.json"  # another sweep on a machine 2x as fast: rescaled
    other.write_text(json.dumps({"results": [_row(100, 4.0, 4.25, compute_only=60.0)]}))
    result = crossover_check.check([str(path), str(other)])
    assert len(result["points"]) == 3 * 3
    assert all(abs(p["error"]) < 1e-9 for p in result["points"])
    assert {p["from"] for p in result["points"]} == {"same sweep", "other sweeps"}
    assert result["summary"]["all"]["max_abs_error"] < 1e-9


def test_the_crossover_is_where_the_times_meet(tmp_path):
    path = tmp_path / "netem.json"
    path.write_text(json.dumps({"results": [_row(25, 8.0, 8.5), _row(10000, 8.0, 8.5)]}))
    profiles, _ = linkmodel.load_profiles([str(path)])

    report = two_seed_report()
    bps = crossover.crossover(report, profiles, "lamb", "onebit_lamb", 4, 2)
    # 2100 (8 + 1.5 V 8/B) = 400 (8 + 1.5 V 8/B) + 2100 (8.5 + 1.75 V/32 8/B), solved for B
    saved = (2100 - 400) * 1.5 * V * 8 - 2100 * 1.75 * V / 32 * 8
    assert bps == pytest.approx(saved / (400 * 8 + 2100 * 0.5), rel=1e-6)
    assert crossover.crossover(report, profiles, "lamb", "onebit_lamb", 4, 2, hi_bps=1e7) is None
    rows = crossover.report_crossovers(report, [str(path)], "lamb", "onebit_lamb")
    assert [r["ranks"] for r in rows] == [4, 16, 64]
    assert rows[0]["crossover_gbps"] == pytest.approx(bps / 1e9, rel=1e-6)
    low, high = rows[0]["crossover_range_gbps"]
    assert low < rows[0]["crossover_gbps"] < high  # the seeds' spread widens it both ways
    assert "| 4 | " in "\n".join(crossover.crossover_lines(rows))
    assert crossover.report_crossovers(report, [str(path)], "lamb", "adamw") == []
    times = crossover.recipe_times(report, profiles, bps, 4, 2)
    assert times["lamb"]["mean"] == pytest.approx(times["onebit_lamb"]["mean"], rel=1e-6)
    assert len(times["lamb"]["seconds"]) == 2 and times["lamb"]["std"] > 0


def test_the_model_against_the_repositorys_netem_points():
    result = crossover_check.check()
    summary = result["summary"]
    assert summary["all"]["points"] >= 150
    # median error of the modelled samples/s, each point predicted from the others
    assert summary["same sweep"]["median_abs_error"] < 0.1
    assert math.isfinite(summary["all"]["max_abs_error"])


def test_a_crossing_outside_the_searched_links_says_on_which_side(tmp_path):
    report = two_seed_report()

    def rows_for(onebit_compute):
        path = tmp_path / f"netem_{onebit_compute}.json"
        path.write_text(json.dumps({"results": [_row(bw, 8.0, onebit_compute)
                                                for bw in (25, 10000)]}))  # fmt: skip
        return crossover.report_crossovers(report, [str(path)], "lamb", "onebit_lamb")

    # 1-bit LAMB's compression step computes faster than LAMB's step: at the means it pays
    # at every link, at the spread's pessimistic end it stops paying at a finite link
    (fast, *_) = rows_for(6.0)
    assert fast["crossover_gbps"] is None and fast["beyond"]["mean"] == "above"
    low, high = fast["crossover_range_gbps"]
    assert low is not None and crossover.LO_GBPS < low < crossover.HI_GBPS
    assert high is None and fast["beyond"]["high"] == "above" and "low" not in fast["beyond"]
    text = "\n".join(crossover.crossover_lines([fast]))
    assert f"| 4 | > 1000 | {low:.2g} to > 1000 |" in text
    assert "pays at every link up to 1000 Gbit/s" in text
    # a compression step far slower than LAMB's: it pays on no link at all
    (slow, *_) = rows_for(600.0)
    assert slow["crossover_gbps"] is None and slow["crossover_range_gbps"] == [None, None]
    assert slow["beyond"] == {"mean": "below", "low": "below", "high": "below"}
    assert "| 4 | < 0.001 | < 0.001 to < 0.001 |" in "\n".join(crossover.crossover_lines([slow]))
    # inside the searched links nothing is open and the range keeps its dash
    (inside, *_) = rows_for(8.5)
    assert "beyond" not in inside
    assert " to " not in "\n".join(crossover.crossover_lines([inside]))


def test_the_samples_to_the_target_are_compared_on_paired_seeds(tmp_path):
    path = tmp_path / "netem.json"
    path.write_text(json.dumps({"results": [_row(25, 8.0, 8.5), _row(10000, 8.0, 8.5)]}))
    report = two_seed_report()
    # without a data identity the seeds pair with nothing: no comparison, no sentence
    rows = crossover.report_crossovers(report, [str(path)], "lamb", "onebit_lamb")
    assert "samples_paired" not in rows[0]
    assert "Samples to the target" not in "\n".join(crossover.crossover_lines(rows))

    data = {"tokenizer_sha256": "t", "shards_sha256": "s"}
    steps = {("lamb", 1): 2000, ("lamb", 2): 2200, ("lamb", 3): 2100, ("onebit_lamb", 1): 2400,
             ("onebit_lamb", 2): 2200, ("onebit_lamb", 3): 2310}  # fmt: skip
    for run in report["runs"]:
        run.update(data=data, steps=3000)
        run["time_to_target"]["samples"] = 128 * steps[(run["name"], run["seed"])]

    def seed(like, k, stage, steps, reached=True):
        block = {"reached": True, "samples": 128 * steps, "stage_steps": {stage: steps}}
        if not reached:
            block = {"reached": False, "run_end": {"stage_steps": {stage: steps}}}
        report["runs"].append({**report["runs"][like], "seed": k, "time_to_target": block})

    seed(0, 3, "default", 2100)
    seed(2, 3, "compression", 2310)
    seed(0, 4, "default", 1900)
    seed(2, 4, "compression", 3000, reached=False)  # a seed that missed pairs with nothing

    paired = crossover.paired_samples(report, "lamb", "onebit_lamb")
    ratios = [1.2, 1.0, 1.1]
    assert paired["seeds"] == [1, 2, 3]
    assert paired["ratios"] == pytest.approx(ratios)
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    assert paired["geometric_mean"] == pytest.approx(math.exp(mean))
    half = 4.302653 * sd / math.sqrt(3)  # t(0.975, 2)
    assert paired["interval"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)])
    assert paired["t"] == pytest.approx(mean / (sd / math.sqrt(3)))
    assert paired["df"] == 2 and 0.05 < paired["p"] < 0.5
    # the paired test's detectable difference on 3 pairs: (t(0.975, 2) + t(0.8, 2)) sd / sqrt(3)
    assert paired["detectable_difference"] == pytest.approx(
        math.expm1((4.302653 + 1.060660) * sd / math.sqrt(3)), rel=1e-4
    )

    rows = crossover.report_crossovers(report, [str(path)], "lamb", "onebit_lamb")
    assert rows[0]["samples_paired"] == paired
    text = "\n".join(crossover.crossover_lines(rows))
    assert "on the 3 seeds that pair and reached it in both: ×1.097, 95 % interval" in text
    low, high = (f"{math.exp(mean + k * half):.3f}" for k in (-1, 1))
    assert f"×1.097, 95 % interval [{low}, {high}] (geometric mean" in text
    assert "per seed 1: 1.200, 2: 1.000, 3: 1.100" in text
    assert crossover.paired_samples(report, "lamb", "adamw") is None
