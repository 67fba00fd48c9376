"""A netem sweep measured more than once (``bench.netem --repeats``): its repeats combine
into one point whose speed is the mean step time, every report keeps their spread (times
per repeat, intervals, a "behind" that holds at every repeat), and the step model never
predicts a point from its own repeat."""

from __future__ import annotations

import json

import pytest

from bench import netem as bench_netem
from pipeline.reports import crossover_check, ranking, timing
from tests.helpers.netem_rows import model_row as _row
from tests.helpers.netem_rows import two_seed_report


def _point(bw, repeat, lamb, onebit, warmup, world=4):
    return {"bandwidth_mbit": bw, "world_size": world, "repeat": repeat,
            "compute_only_samples_per_s": 2 * lamb,
            "runs": {"lamb": {"samples_per_s": lamb, "step_seconds": 100 / lamb},
                     "onebit_lamb": {"samples_per_s": onebit,
                                     "warmup": {"samples_per_s": warmup}}}}  # fmt: skip


def _sweep(tmp_path, rows, name="netem.json", **settings):
    path = tmp_path / name
    path.write_text(json.dumps({"model": "bert-mini", "seq_length": 128, "batch_per_rank": 64,
                                "sweep_id": "20261129T000000Z-abcdef12", "repeats": 2,
                                **settings, "results": rows}))  # fmt: skip
    return path


def test_repeats_combine_at_the_mean_step_time_and_keep_their_speeds():
    rows = [_point(25, 0, 10.0, 40.0, 8.0), _point(25, 1, 30.0, 60.0, 12.0),
            _point(100, 0, 20.0, 50.0, 20.0)]  # fmt: skip
    combined = timing.combine_repeats(rows)
    assert [(r["bandwidth_mbit"], r.get("repeats")) for r in combined] == [(25, 2), (100, None)]
    lamb = combined[0]["runs"]["lamb"]
    # harmonic mean of 10 and 30 samples/s: the mean of their step times, 100/10 and 100/30
    assert lamb["samples_per_s"] == pytest.approx(15.0)
    assert lamb["step_seconds"] == pytest.approx(100 / 15.0)
    assert lamb["samples_per_s_repeats"] == [10.0, 30.0]
    assert combined[0]["runs"]["onebit_lamb"]["warmup"]["samples_per_s_repeats"] == [8.0, 12.0]
    assert combined[0]["compute_only_samples_per_s"] == pytest.approx(30.0)
    assert "repeat" not in combined[0] and "repeat" not in combined[1]


def test_two_rows_of_a_point_that_are_not_numbered_repeats_are_refused(tmp_path):
    rows = [_point(25, 0, 10.0, 40.0, 8.0), _point(25, 0, 30.0, 60.0, 12.0)]
    with pytest.raises(ValueError, match="25 Mbit/s on 4 ranks is measured 2 times"):
        timing.combine_repeats(rows)
    path = _sweep(tmp_path, [{k: v for k, v in r.items() if k != "repeat"} for r in rows])
    with pytest.raises(ValueError, match=r"--netem .*netem.json: 25 Mbit/s on 4 ranks"):
        timing.load_netem([str(path)])


def test_a_repeated_sweep_gives_one_speed_and_one_per_repeat(tmp_path):
    path = _sweep(tmp_path, [_point(25, 0, 10.0, 40.0, 8.0), _point(25, 1, 30.0, 60.0, 12.0)])
    netem = timing.load_netem([str(path)])
    assert netem["sweeps"] == [{"file": str(path), "sweep_id": "20261129T000000Z-abcdef12",
                                "repeats": 2}]  # fmt: skip
    assert len(netem["results"]) == 1
    assert timing.speeds(netem, "onebit_lamb", 4)[25.0] == pytest.approx(
        {"default": 48.0, "warmup": 9.6, "compression": 48.0}
    )
    per_repeat = timing.speeds_by_repeat(netem, "onebit_lamb", 4)[25.0]
    assert per_repeat == [{"default": 40.0, "warmup": 8.0, "compression": 40.0},
                          {"default": 60.0, "warmup": 12.0, "compression": 60.0}]  # fmt: skip
    split = {"warmup": 10, "compression": 90}
    times = timing.seconds_by_repeat(split, 96, timing.speeds_by_repeat(netem, "onebit_lamb", 4))
    assert times == {"25": pytest.approx([96 * (10 / 8 + 90 / 40), 96 * (10 / 12 + 90 / 60)])}
    # the mean-speed time lies between the repeats' times
    mean = timing.seconds_for(split, 96, timing.speeds(netem, "onebit_lamb", 4)[25.0])
    assert times["25"][1] < mean < times["25"][0]
    # a sweep measured once has no per-repeat times
    once = _sweep(tmp_path, [_point(25, 0, 10.0, 40.0, 8.0)], "once.json", repeats=1)
    assert timing.seconds_by_repeat(split, 96, timing.speeds_by_repeat(
        timing.load_netem([str(once)]), "onebit_lamb", 4)) == {}  # fmt: skip


def _seed(times_by_repeat):
    mean = sum(times_by_repeat) / len(times_by_repeat)
    return {"time_to_target": {"reached": True, "measured_bandwidths": [25],
                               "seconds": {"25": mean},
                               "seconds_by_repeat": {"25": list(times_by_repeat)}}}  # fmt: skip


def test_a_gap_the_sweeps_spread_could_make_is_not_called():
    # seeds agree closely; "b" is 4 % slower at the mean speeds, but its first repeat ran
    # faster than "a"'s second: behind at one pair of repeats, not at every pair
    a = {"name": "a", "seeds": [_seed([100.0, 104.0]), _seed([100.5, 104.5]),
                                _seed([99.5, 103.5])]}  # fmt: skip
    b = {"name": "b", "seeds": [_seed([103.0, 111.0]), _seed([103.5, 111.5]),
                                _seed([102.5, 110.5])]}  # fmt: skip
    (row,) = ranking.groups([a, b], [25.0])
    assert row["leaders"] == ["a", "b"] and row["behind"] == []
    entry_a, entry_b = row["ranking"]
    assert entry_b["p_vs_first"] > 0.05
    # each interval spans both repeats' t intervals
    assert entry_a["interval"][0] < 100.0 and entry_a["interval"][1] > 104.0
    assert ranking.interval(entry_a["by_repeat"]) == entry_a["interval"]
    text = ranking.entry_text(entry_a)
    assert text.startswith("a 1.7 min [1.6 min, 1.8 min]") and text.endswith("(3/3)")
    # measured once at the mean speeds, the same seeds are told apart
    once = [{"name": arm["name"], "seeds": [{"time_to_target": {
        **s["time_to_target"], "seconds_by_repeat": {}}} for s in arm["seeds"]]}
        for arm in (a, b)]  # fmt: skip
    (row,) = ranking.groups(once, [25.0])
    assert row["leaders"] == ["a"] and row["behind"] == ["b"]
    # a gap larger than the spread is behind at every pair
    far = {"name": "far", "seeds": [_seed([130.0, 138.0]), _seed([131.0, 139.0]),
                                    _seed([129.0, 137.0])]}  # fmt: skip
    (row,) = ranking.groups([a, far], [25.0])
    assert row["behind"] == ["far"]


def test_the_step_model_never_predicts_a_point_from_its_repeat(tmp_path):
    # one bandwidth measured twice: the repeat alone would "predict" it exactly before
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps({"results": [{**_row(25, 8.0, 8.5), "repeat": 0},
                                             {**_row(25, 8.0, 8.5), "repeat": 1}]}))  # fmt: skip
    assert crossover_check.check([str(alone)])["points"] == []
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"results": [
        {**_row(25, 8.0, 8.5), "repeat": 0}, {**_row(10000, 8.0, 8.5), "repeat": 0},
        {**_row(25, 8.0, 8.5), "repeat": 1}, {**_row(10000, 8.0, 8.5), "repeat": 1}]}))  # fmt: skip
    points = crossover_check.check([str(both)])["points"]
    assert len(points) == 2 * 3  # two bandwidths, three stages: once each
    assert all(abs(p["error"]) < 1e-9 for p in points)


def test_the_benchmark_alternates_the_recipes_order_and_names_its_sweep(capsys):
    assert bench_netem.repeat_order(["lamb", "co2", "adamw"], 0) == ["lamb", "co2", "adamw"]
    assert bench_netem.repeat_order(["lamb", "co2", "adamw"], 1) == ["adamw", "co2", "lamb"]
    a, b = bench_netem.new_sweep_id(), bench_netem.new_sweep_id()
    assert a != b and a[:8].isdigit() and a[8] == "T"
    with pytest.raises(SystemExit):
        bench_netem.main(["--repeats", "0", "--data", "/nonexistent"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_the_crossover_is_given_at_every_repeat_and_its_range_spans_them(tmp_path):
    from pipeline.reports import crossover, linkmodel

    # the second repeat ran 1-bit LAMB's compression stage slower: it pays on slower links
    rows = [
        {**_row(bw, 8.0, onebit), "repeat": r}
        for r, onebit in ((0, 8.5), (1, 9.5))
        for bw in (25, 10000)
    ]
    path = tmp_path / "netem.json"
    path.write_text(json.dumps({"repeats": 2, "sweep_id": "s", "results": rows}))
    assert linkmodel.repeats_in([str(path)]) == 2

    report = two_seed_report()
    (first, *_) = crossover.report_crossovers(report, [str(path)], "lamb", "onebit_lamb")
    fast, slow = first["crossover_by_repeat_gbps"]
    assert slow < first["crossover_gbps"] < fast
    # each repeat alone is that repeat's crossing
    alone, _ = linkmodel.load_profiles([str(path)], repeat=1)
    assert slow == pytest.approx(crossover.crossover(report, alone, "lamb", "onebit_lamb", 4, 2)
                                 / 1e9)  # fmt: skip
    low, high = first["crossover_range_gbps"]
    assert low < slow and high > fast
    # the range's ends are the seeds' ends at the combined speeds and at each repeat's
    sets = [linkmodel.load_profiles([str(path)])[0], *crossover.repeat_profiles([str(path)])]
    ends = {shift: [crossover.crossover(report, prof, "lamb", "onebit_lamb", 4, 2, shift=shift)
                    / 1e9 for prof in sets] for shift in (1.0, -1.0)}  # fmt: skip
    assert (low, high) == pytest.approx((min(ends[1.0]), max(ends[-1.0])))
    text = "\n".join(crossover.crossover_lines([first]))
    assert "at every repeat of the sweep" in text
    assert "| ranks | crossover | at each repeat |" in text
    crossover.plot(report, linkmodel.load_profiles([str(path)])[0], tmp_path / "c.png",
                   by_repeat=crossover.repeat_profiles([str(path)]))  # fmt: skip
    assert (tmp_path / "c.png").stat().st_size > 1000
