"""The comparison report on tiny synthetic runs: the target, samples/bytes/time to it
(interpolated, stage by stage against a netem JSON), verdicts by Welch or by the
reference's prediction interval, the report.json shape and the markdown."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import yaml

from onebit_bert.recipes import get_recipe
from pipeline.experiment import ReportSpec
from pipeline.reports import compare, compare_prior, crossover, gate, ranking, timing
from pipeline.reports.stats import t_quantile, welch_t_test
from pipeline.tuning import data_identity as tuning_data
from pipeline.tuning import successive_halving, trials, tuning_record

BATCH = 100


def _pretrain(directory: Path, config: dict, val: list[tuple[int, float]], per_step_bytes: dict,
              stage=lambda step: "full", seed: int = 1, steps: int = 6) -> Path:  # fmt: skip
    """A finished pretraining run: config.yaml, status.json (4 ranks), metrics.jsonl with
    one record per step (loss, bytes by kind, stage) and validation records."""
    directory.mkdir(parents=True)
    config = {"seed": seed, "batch": {"global_batch_size": BATCH}, **config}
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    (directory / "status.json").write_text(json.dumps({"state": "complete", "world_size": 4}))
    records = []
    for step in range(1, steps + 1):
        kinds = per_step_bytes(step) if callable(per_step_bytes) else per_step_bytes
        record = {"step": step, "loss": 6.0 - step * 0.1, "stage": stage(step)}
        record["comm_bytes"] = sum(kinds.values())
        record.update({f"comm_bytes_{k}": v for k, v in kinds.items()})
        records.append(record)
    for step, loss in val:
        records.append(
            {
                "step": step,
                "val_mlm_loss": loss,
                "val_mlm_accuracy": 1 / loss,
                "val_nsp_accuracy": 0.6,
            }  # fmt: skip
        )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _finetune(directory: Path, sst2: float) -> Path:
    directory.mkdir(parents=True)
    result = {"accuracy": sst2, "main_metric": "accuracy",
              "per_seed": {"1": {"accuracy": sst2}}}  # fmt: skip
    (directory / "results.json").write_text(json.dumps({"sst2": result}))
    return directory


LAMB = {"optimizer": {"name": "lamb"}}
ONEBIT = {"optimizer": {"name": "onebit_lamb", "freeze_step": 2}}
CO2 = {"optimizer": {"name": "lamb"}, "strategy": {"name": "co2", "outer_every": 2}}


@pytest.fixture
def runs(tmp_path):
    specs = []
    # LAMB, 3 seeds: final losses 4.0, 4.2, 4.4 -> target 4.2
    for seed, final in ((1, 4.0), (2, 4.2), (3, 4.4)):
        pre = _pretrain(tmp_path / f"lamb{seed}", LAMB, [(2, 5.0), (4, 4.6), (6, final)],
                        {"gradients": 1000}, seed=seed)  # fmt: skip
        ft = _finetune(tmp_path / f"ft_lamb{seed}", 0.80 + 0.01 * seed)
        specs.append(f"lamb={pre}:{ft}")
    # 1-bit LAMB, 1 seed: crosses 4.2 halfway between steps 4 (4.4) and 6 (4.0): step 5
    pre = _pretrain(
        tmp_path / "onebit",
        ONEBIT,
        [(2, 5.0), (4, 4.4), (6, 4.0)],
        lambda step: {"gradients": 1000} if step <= 2 else {"momentum": 40},
        stage=lambda step: "warmup" if step <= 2 else "compression",
    )
    specs.append(f"onebit={pre}:{_finetune(tmp_path / 'ft_onebit', 0.60)}")
    # CO2, 1 seed: never reaches 4.2; not in the netem JSON
    pre = _pretrain(tmp_path / "co2", CO2, [(2, 5.2), (4, 5.0), (6, 4.9)],
                    lambda step: {"parameters": 500 if step % 2 == 0 else 0})  # fmt: skip
    specs.append(f"co2={pre}:{_finetune(tmp_path / 'ft_co2', 0.82)}")
    return specs


@pytest.fixture
def netem(tmp_path):
    rows = [
        {
            "bandwidth_mbit": bw,
            "world_size": 4,
            "runs": {
                "lamb": {"samples_per_s": 10.0 * scale},
                "onebit_lamb": {
                    "samples_per_s": 50.0 * scale,
                    "warmup": {"samples_per_s": 10.0 * scale},
                },
            },
        }
        for bw, scale in ((25, 1.0), (10000, 10.0))
    ]
    rows.append({"bandwidth_mbit": 25, "world_size": 2, "runs": {"lamb": {"samples_per_s": 1.0}}})
    path = tmp_path / "netem.json"
    path.write_text(json.dumps({"model": "bert-mini", "seq_length": 128, "batch_per_rank": 64,
                                "results": rows}))  # fmt: skip
    return path


def test_report_content(runs, netem, tmp_path):
    out = tmp_path / "report"
    report = compare.write_report(runs, out, str(netem))
    assert report["target"]["val_mlm_loss"] == pytest.approx(4.2)
    by = {(r["name"], r["seed"]): r for r in report["runs"]}
    # the parity report's shape, plus seed, strategy and the time-to-target block
    for run in report["runs"]:
        assert {"name", "seed", "strategy", "final", "final_train_loss", "comm_bytes_total",
                "time_to_target"} <= set(run)  # fmt: skip
        assert set(run["final"]) >= {"val_mlm_loss", "val_mlm_accuracy"}
    assert by[("onebit", 1)]["strategy"] == "onebit_lamb"
    assert by[("co2", 1)]["strategy"] == "co2"

    # LAMB seed 1 crosses 4.2 between steps 4 (4.6) and 6 (4.0): step 4 + 2 * 0.4 / 0.6
    lamb1 = by[("lamb", 1)]["time_to_target"]
    step = 4 + 2 * 0.4 / 0.6
    assert lamb1["samples"] == pytest.approx(step * BATCH)
    assert lamb1["bytes"] == pytest.approx(1000 * step)
    assert lamb1["seconds"]["25"] == pytest.approx(step * BATCH / 10.0)
    assert lamb1["seconds"]["10000"] == pytest.approx(step * BATCH / 100.0)
    assert not by[("lamb", 3)]["time_to_target"]["reached"]  # ends at 4.4

    # 1-bit LAMB: step 5; two warmup steps at 10 samples/s, three at 50
    onebit = by[("onebit", 1)]["time_to_target"]
    assert onebit["samples"] == pytest.approx(500)
    assert onebit["bytes"] == pytest.approx(2 * 1000 + 3 * 40)
    assert onebit["bytes_by_kind"] == pytest.approx({"gradients": 2000, "momentum": 120})
    assert onebit["seconds"]["25"] == pytest.approx(2 * BATCH / 10 + 3 * BATCH / 50)
    # CO2 never reaches it, and the netem JSON has no co2 entry
    co2 = by[("co2", 1)]
    assert not co2["time_to_target"]["reached"] and co2["time_to_target"]["seconds"] == {}
    assert co2["comm_bytes_by_kind"] == {"parameters": 1500}

    # verdicts: one seed against LAMB's three (prediction interval)
    sst2 = report["finetune"]["sst2"]
    assert sst2["main_metric"] == "accuracy"
    assert sst2["strategies"]["onebit"]["verdict"] == "differs"  # 0.60 against 0.81-0.83
    assert sst2["strategies"]["co2"]["verdict"] == "within the reference's seed spread"
    assert sst2["strategies"]["co2"]["test"] == "prediction interval"
    assert set(sst2["runs"]) == {"lamb-seed1", "lamb-seed2", "lamb-seed3", "onebit-seed1",
                                 "co2-seed1"}  # fmt: skip
    loss = report["pretraining"]["val_mlm_loss"]
    assert loss["lamb"]["mean"] == pytest.approx(4.2)

    # per bandwidth, the first to the target: 1-bit LAMB (26 s, one seed, so no test);
    # LAMB's third seed never reaches the target and counts with its run's end (600
    # samples at 10 samples/s: 60 s) as a lower bound; co2 never reaches the target (and
    # has no measured speed, which it does not need)
    first = {w["bandwidth_mbit"]: w for w in report["groups"]}
    assert sorted(first) == [25, 10000]
    assert first[25]["leaders"] == ["onebit"] and first[10000]["leaders"] == ["onebit"]
    assert [t["name"] for t in first[25]["ranking"]] == ["onebit", "lamb"]
    lamb_row = first[25]["ranking"][1]
    assert lamb_row["seconds"] == pytest.approx([step * BATCH / 10.0, 60.0, 60.0])
    assert lamb_row["censored"] == [False, False, True] and lamb_row["lower_bound"]
    assert (lamb_row["reached"], lamb_row["seeds"]) == (2, 3)
    assert first[25]["untested"] == ["lamb"] and first[25]["behind"] == []
    assert first[25]["not_reached"] == ["co2"] and first[25]["not_measured"] == []
    end = by[("lamb", 3)]["time_to_target"]["run_end"]
    assert end["samples"] == 600 and end["seconds"]["25"] == pytest.approx(60.0)

    text = (out / "report.md").read_text()
    assert "## Which recipes reach the target first" in text
    assert not re.search(r"[^\n]\n#", text), "every heading follows a blank line"
    assert "| 25 Mbit/s | onebit 26.0 s (1/1) is first, on one seed: no test | – | lamb ≥ " in text
    # the strategies table: LAMB's samples and times are lower bounds (a seed missed)
    assert re.search(r"\| lamb \(`lamb`\) \| 1, 2, 3 \|.*\| 2/3 \| ≥ 578 \|", text)
    assert "Target validation MLM loss **4.2000**" in text
    assert "| onebit (`onebit_lamb`) | 1 |" in text
    assert "time to target @ 25 Mbit/s" in text and "time to target @ 10 Gbit/s" in text
    assert "Not in the netem JSON: co2." in text
    assert "| sst2 | accuracy |" in text and "**differs**" in text
    for name in ("val_loss_samples.png", "val_loss_bytes.png", "val_loss_time_25mbit.png",
                 "val_loss_time_10000mbit.png", "report.json"):  # fmt: skip
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))


def test_without_netem_there_is_no_modelled_time(runs, tmp_path):
    report = compare.write_report(runs, tmp_path / "r", target_loss=4.5)
    onebit = next(r for r in report["runs"] if r["name"] == "onebit")
    assert onebit["time_to_target"]["samples"] == pytest.approx(200 + 200 * 0.5 / 0.6)
    assert onebit["time_to_target"]["seconds"] == {}
    assert "No netem benchmark JSON" in (tmp_path / "r" / "report.md").read_text()
    assert report["target"] == {"val_mlm_loss": 4.5, "from": "given (--target-loss)"}


def test_pretraining_only_runs_give_the_pretraining_comparison(runs, tmp_path):
    """``NAME=PRETRAIN_DIR`` (no fine-tuning yet): the same target and time-to-target, and
    a report that says there is no fine-tuning table instead of failing."""
    full = compare.write_report(runs, tmp_path / "full", target_loss=4.5)
    bare = [spec.split(":")[0] for spec in runs]
    report = compare.write_report(bare, tmp_path / "bare", target_loss=4.5)
    assert report["finetune"] == {}
    assert [r["time_to_target"] for r in report["runs"]] == [
        r["time_to_target"] for r in full["runs"]
    ]
    text = (tmp_path / "bare" / "report.md").read_text()
    assert "no fine-tuning verdicts" in text and "| sst2 |" not in text
    # one seed has no spread to show; three do
    rows = {line.split(" (`")[0]: line for line in text.splitlines() if " (`" in line}
    assert "±" not in rows["| onebit"] and "±" in rows["| lamb"]
    assert "| sst2 |" in (tmp_path / "full" / "report.md").read_text()
    with pytest.raises(ValueError, match=r"NAME=PRETRAIN_DIR\[:FINETUNE_DIR\]"):
        compare.write_report(["lamb", *bare], tmp_path / "r")


def test_two_seeds_use_welch(tmp_path, runs):
    extra = _pretrain(tmp_path / "onebit2", ONEBIT, [(6, 4.1)], {"momentum": 40}, seed=2)
    specs = [*runs, f"onebit={extra}:{_finetune(tmp_path / 'ft_onebit2', 0.62)}"]
    report = compare.write_report(specs, tmp_path / "r")
    row = report["finetune"]["sst2"]["strategies"]["onebit"]
    assert row["test"] == "welch" and row["verdict"] == "differs" and row["p"] < 0.05


def test_bad_inputs_say_what_is_wrong(runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        compare.write_report(runs, tmp_path / "r", str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a bench.netem JSON"):
        compare.write_report(runs, tmp_path / "r", str(bad))
    with pytest.raises(ValueError, match="at least two names"):
        compare.write_report(runs[:3], tmp_path / "r")


def test_sweeps_at_other_bandwidths_merge_into_one_table(runs, netem, tmp_path):
    """Two bench.netem files of the same settings (one per bandwidth) give the same times as
    one file with both; files of other settings, or measuring a point twice, are refused."""
    whole = json.loads(netem.read_text())
    parts = []
    for bandwidth in (25, 10000):
        part = {**whole, "results": [r for r in whole["results"]
                                     if r["bandwidth_mbit"] == bandwidth]}  # fmt: skip
        path = tmp_path / f"netem_{bandwidth}.json"
        path.write_text(json.dumps(part))
        parts.append(str(path))
    one = compare.write_report(runs, tmp_path / "one", str(netem))
    two = compare.write_report(runs, tmp_path / "two", parts)
    assert [r["time_to_target"] for r in two["runs"]] == [r["time_to_target"] for r in one["runs"]]
    assert two["time_model"]["netem"] == parts
    assert "time to target @ 10 Gbit/s" in (tmp_path / "two" / "report.md").read_text()

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(Path(parts[1]).read_text()), "batch_per_rank": 32}))
    with pytest.raises(ValueError, match="batch_per_rank is 32 but .* has 64"):
        timing.load_netem([parts[0], str(other)])
    with pytest.raises(ValueError, match="25 Mbit/s on 4 ranks is measured in"):
        timing.load_netem([str(netem), parts[0]])
    # the experiment's report stage passes each file
    spec = ReportSpec(kind="compare", netem=parts)
    assert spec.args() == ["--netem", parts[0], "--netem", parts[1]]
    assert ReportSpec(kind="compare", netem=parts[0]).args() == ["--netem", parts[0]]


def test_a_recipe_measured_alone_later_joins_the_same_points(runs, netem, tmp_path):
    """A second bench.netem file of the same settings may measure other recipes at the same
    points; each recipe is measured once per point and at one round length."""
    whole = json.loads(netem.read_text())
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    keep = {
        **whole,
        "strategies": ["lamb"],
        "results": [{**r, "runs": {"lamb": r["runs"]["lamb"]}} for r in whole["results"]],
    }
    later = {**whole, "strategies": ["onebit_lamb"], "outer_every_by_recipe": {"co2": 8},
             "results": [{**r, "runs": {"onebit_lamb": r["runs"]["onebit_lamb"]}}
                         for r in whole["results"] if "onebit_lamb" in r["runs"]]}  # fmt: skip
    first.write_text(json.dumps(keep))
    second.write_text(json.dumps(later))
    merged = timing.load_netem([str(first), str(second)])
    assert merged["runs_from"] == {"lamb": [str(first)], "onebit_lamb": [str(second)]}
    assert len(merged["results"]) == len(whole["results"])
    one = compare.write_report(runs, tmp_path / "one", str(netem))
    two = compare.write_report(runs, tmp_path / "two", [str(first), str(second)])
    assert [r["time_to_target"] for r in two["runs"]] == [r["time_to_target"] for r in one["runs"]]
    assert "separate runs of the benchmark" in (tmp_path / "two" / "report.md").read_text()
    with pytest.raises(ValueError, match="onebit_lamb at 25 Mbit/s on 4 ranks is measured in"):
        timing.load_netem([str(netem), str(second)])
    # a local-step recipe measured at two round lengths is two settings, not one
    tau4 = {
        **keep,
        "strategies": ["co2"],
        "results": [{**r, "runs": {"co2": {"samples_per_s": 1.0}}} for r in keep["results"]],
    }
    tau4["outer_every"] = 4
    tau8 = {**tau4, "outer_every_by_recipe": {"co2": 8},
            "results": [{**r, "bandwidth_mbit": r["bandwidth_mbit"] + 1}
                         for r in tau4["results"]]}  # fmt: skip
    (tmp_path / "tau4.json").write_text(json.dumps(tau4))
    (tmp_path / "tau8.json").write_text(json.dumps(tau8))
    with pytest.raises(ValueError, match="co2 runs rounds of 8 steps but .* measured it at 4"):
        timing.load_netem([str(tmp_path / "tau4.json"), str(tmp_path / "tau8.json")])
    # the round length of a file that measured no local-step recipe means nothing: it
    # merges with a file of another one, and a local-step recipe keeps its own file's rounds
    no_rounds = {**later, "outer_every": 8, "outer_every_by_recipe": None}
    (tmp_path / "no_rounds.json").write_text(json.dumps(no_rounds))
    merged = timing.load_netem([str(tmp_path / "tau4.json"), str(tmp_path / "no_rounds.json")])
    assert merged["outer_every"] == 4 and merged["outer_every_by_recipe"] == {}
    assert timing.rounds_of(merged, "co2") == 4
    co2_at_8 = {**tau4, "outer_every": 8}
    (tmp_path / "co2_at_8.json").write_text(json.dumps(co2_at_8))
    merged = timing.load_netem([str(first), str(tmp_path / "co2_at_8.json")])
    assert merged["outer_every_by_recipe"] == {"co2": 8}
    assert timing.rounds_of(merged, "co2") == 8


def test_a_local_step_run_is_timed_only_at_its_own_setting(netem, tmp_path):
    """The benchmark must have measured a local-step run's recipe at the run's round length
    and with its inner optimizer; two files that measured one recipe differently do not
    merge."""
    whole = json.loads(netem.read_text())
    measured = {
        **whole,
        "strategies": ["slowmo_node"],
        "outer_every": 4,
        "outer_every_by_recipe": {"slowmo_node": 8},
        "inner_by_recipe": {"slowmo_node": "adamw"},
        "results": [{**r, "runs": {"slowmo_node": {"samples_per_s": 1.0}}}
                    for r in whole["results"]],
    }  # fmt: skip
    world = whole["results"][0]["world_size"]
    run = {"name": "slowmo", "pretrain_dir": "DIR", "strategy": "slowmo_node",
           "world_size": world, "optimizer": "adamw", "outer_every": 8}  # fmt: skip
    compare.check_netem_setting(run, measured)
    with pytest.raises(ValueError, match="steps lamb inside .* --inner slowmo_node=lamb"):
        compare.check_netem_setting({**run, "optimizer": "lamb"}, measured)
    with pytest.raises(ValueError, match="rounds of 16 steps .* measured slowmo_node at 8"):
        compare.check_netem_setting({**run, "outer_every": 16}, measured)
    # the recipe's own optimizer when --inner did not name one
    own = {**measured, "inner_by_recipe": None}
    with pytest.raises(ValueError, match="measured slowmo_node with lamb"):
        compare.check_netem_setting(run, own)
    compare.check_netem_setting({**run, "optimizer": "lamb"}, own)
    # not measured on the run's world size: nothing to check
    compare.check_netem_setting({**run, "world_size": world + 1, "optimizer": "sgd"}, measured)
    first, second = tmp_path / "adamw.json", tmp_path / "lamb.json"
    first.write_text(json.dumps(measured))
    moved = [{**r, "bandwidth_mbit": r["bandwidth_mbit"] + 1} for r in own["results"]]
    second.write_text(json.dumps({**own, "results": moved}))
    assert timing.load_netem([str(first)])["inner_by_recipe"] == {"slowmo_node": "adamw"}
    with pytest.raises(ValueError, match="steps its own optimizer inside but .* with adamw"):
        timing.load_netem([str(first), str(second)])


def test_crossing_and_t_quantile():
    assert gate.samples_to_target([(0, 5.0), (10, 3.0)], 4.0) == pytest.approx(5.0)
    assert gate.samples_to_target([(0, 3.0), (10, 2.0)], 4.0) == 0.0
    assert gate.samples_to_target([(0, 5.0), (10, 4.5)], 4.0) is None
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.96, abs=1e-3)
    assert math.isfinite(t_quantile(0.975, 1))


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"optimizer": {"name": "lamb"}}, "lamb"),
        ({"optimizer": {"name": "adamw"}}, "adamw"),
        ({"optimizer": {"name": "lamb"}, "comm": {"compression": {"grad": "powersgd"}}},
         "powersgd"),
        ({"optimizer": {"name": "onebit_lamb"}}, "onebit_lamb"),
        ({"optimizer": {"name": "onebit_lamb"}, "comm": {"compression": {"grad": "int8"}}},
         "hybrid_onebit_lamb:int8"),
        ({"optimizer": {"name": "onebit_lamb"}, "comm": {"compression": {"grad": "onebit"}}},
         "hybrid_onebit_lamb:onebit"),
        ({"optimizer": {"name": "onebit_lamb"}, "comm": {"overlap": True}}, "onebit_lamb_overlap"),
        ({"optimizer": {"name": "zero_one_adam"},
          "comm": {"compression": {"momentum": "onebit_tensor"}}}, "zero_one_adam"),
        ({"optimizer": {"name": "zero_one_adam"}}, None),  # fused scales: not the recipe
        ({"optimizer": {"name": "sgd"}, "strategy": {"name": "decentlam", "topology": None}},
         "decentlam/ring"),
        ({"optimizer": {"name": "sgd"}, "strategy": {"name": "dmsgd", "topology": "ring"}},
         "dmsgd/ring"),
        ({"optimizer": {"name": "lamb"}, "strategy": {"name": "slowmo"}}, "slowmo"),
    ],
)  # fmt: skip
def test_strategy_keys_match_the_netem_benchmark(config, key):
    assert compare.strategy_key(config) == key


def test_hybrid_speeds_only_for_the_benchmarked_codec():
    netem = {
        "hybrid_codec": "int8",
        "results": [
            {"world_size": 4, "bandwidth_mbit": 25, "runs": {"hybrid_onebit_lamb": {
                "samples_per_s": 20.0, "warmup": {"samples_per_s": 14.0}}}}
        ],
    }  # fmt: skip
    assert timing.speeds(netem, "hybrid_onebit_lamb:int8", 4) == {
        25.0: {"default": 20.0, "warmup": 14.0, "compression": 20.0}
    }
    assert timing.speeds(netem, "hybrid_onebit_lamb:onebit", 4) == {}
    assert timing.speeds(netem, "hybrid_onebit_lamb:int8", 2) == {}


def _record(tmp_path, recipe: str, budget_trials: int, name: str):
    candidates = trials(get_recipe(recipe), budget_trials)
    halving = successive_halving(
        candidates, lambda t, s: 5.0 - t.index * 0.1 - s / 1000, [100, 200]
    )
    path = tmp_path / name
    path.write_text(json.dumps(tuning_record(get_recipe(recipe), candidates, halving)))
    return str(path)


def test_the_comparison_shows_each_recipes_tuning_and_refuses_unequal_budgets(runs, tmp_path):
    """pipeline.reports.compare --tuning: the search spaces, every trial and the chosen settings in
    the report; unequal budgets refused unless allowed (and then said)."""
    equal = [
        _record(tmp_path, "lamb", 3, "lamb.json"),
        _record(tmp_path, "onebit_lamb", 3, "ob.json"),
    ]
    report = compare.write_report(runs, tmp_path / "r", target_loss=4.5, tuning_paths=equal)
    assert report["tuning"]["lamb"]["chosen"] == "lamb-t2"  # the lowest loss: highest index
    assert len(report["tuning"]["onebit_lamb"]["trials"]) == 3
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Tuning" in text and "| lamb-t2 (chosen) |" in text and "unequal" not in text
    assert "`optimizer.lr` [0.005, 0.01, 0.02]" in text
    unequal = [equal[0], _record(tmp_path, "co2", 2, "co2.json")]
    with pytest.raises(ValueError, match="unequal budgets"):
        compare.write_report(runs, tmp_path / "u", target_loss=4.5, tuning_paths=unequal)
    assert compare.main([*(a for r in runs for a in ("--run", r)), "--target-loss", "4.5",
                         *(a for t in unequal for a in ("--tuning", t)),
                         "--out", str(tmp_path / "u")]) == 2  # fmt: skip
    compare.write_report(runs, tmp_path / "a", target_loss=4.5, tuning_paths=unequal,
                         allow_unequal_budgets=True)  # fmt: skip
    assert "unequal budgets" in (tmp_path / "a" / "report.md").read_text()


def _timed(seconds, bandwidths=(25,), end=None):
    """A seed's time-to-target block: reached in ``seconds``, or (None) not, its run
    ending at ``end`` seconds."""
    reached = seconds is not None
    block = {"reached": reached, "measured_bandwidths": list(bandwidths),
             "seconds": {"25": seconds} if reached else {}}  # fmt: skip
    if not reached and end is not None:
        block["run_end"] = {"seconds": {"25": end}}
    return {"time_to_target": block}


def test_the_answer_is_a_group_of_leaders_and_the_recipes_clearly_behind():
    data = {
        "runs": [_timed(10.0)],
        "arms": [
            {"name": "slow", "seeds": [_timed(30.0), _timed(32.0), _timed(None, end=33.0)]},
            {"name": "fast", "seeds": [_timed(10.0), _timed(11.0)]},
            {"name": "tied", "seeds": [_timed(9.0), _timed(14.0)]},
            {"name": "one seed", "seeds": [_timed(12.0)]},
            {"name": "never", "seeds": [_timed(None, end=50.0)]},
            {"name": "unmeasured", "seeds": [{"time_to_target": {
                "reached": True, "measured_bandwidths": [], "seconds": {}}}]},
            {"name": "never, unmeasured", "seeds": [_timed(None, bandwidths=())]},
        ],
    }  # fmt: skip
    (row,) = compare.winners(data)
    assert [t["name"] for t in row["ranking"]] == ["fast", "tied", "one seed", "slow"]
    # "tied" (11.5 s on average) cannot be told from "fast" (10.5 s): both lead; never one
    # winner from a tie
    assert row["leaders"] == ["fast", "tied"] and row["behind"] == ["slow"]
    assert row["untested"] == ["one seed"]
    assert row["not_reached"] == ["never", "never, unmeasured"]
    assert row["not_measured"] == ["unmeasured"]
    # the seed that missed counts with its run's end, and makes the mean a lower bound
    slow = row["ranking"][3]
    assert slow["seconds"] == [30.0, 32.0, 33.0] and slow["lower_bound"]
    assert slow["mean"] == pytest.approx(95 / 3) and 0 < slow["p_vs_first"] < 0.05
    tied = row["ranking"][1]
    # detectable difference: (t(0.975, df) + t(0.8, df)) * se, Welch-Satterthwaite df
    va, vb = 0.5 / 2, 12.5 / 2
    df = (va + vb) ** 2 / (va**2 + vb**2)
    dd = (t_quantile(0.975, df) + t_quantile(0.8, df)) * math.sqrt(va + vb)
    assert tied["detectable_difference_pct"] == pytest.approx(100 * dd / 10.5)
    assert tied["p_vs_first"] > 0.05
    text = "\n".join(ranking.group_lines([row]))
    assert "leaders not separable at this power (detectable difference" in text
    # each mean with its 95 % t interval over the seeds; one seed has none
    lo, hi = ranking.interval([[10.0, 11.0]])
    half = t_quantile(0.975, 1) * 0.5
    assert (lo, hi) == pytest.approx((10.5 - half, 10.5 + half))
    # two seeds far apart: the t interval would reach below zero; a time cannot
    lo_far, hi_far = ranking.interval([[1.0, 9.0]])
    assert lo_far == 0.0 and hi_far == pytest.approx(5.0 + t_quantile(0.975, 1) * 4.0)
    assert row["ranking"][0]["interval"] == pytest.approx([lo, hi])
    assert "| slow ≥ 31.7 s [27.9 s, 35.5 s] (2/3) | one seed 12.0 s (1/1) |" in text
    assert f"fast 10.5 s [{lo:.1f} s, {hi:.1f} s] (2/2), tied 11.5 s [" in text
    # without the tie, the first stands alone, and the answer says against what
    data["arms"] = [a for a in data["arms"] if a["name"] != "tied"]
    (alone,) = compare.winners(data)
    assert alone["leaders"] == ["fast"] and alone["behind"] == ["slow"]
    assert ranking.answer(alone).startswith("fast 10.5 s [")
    assert "(2/2) is ahead of every recipe tested against it (Welch, p < 0.05)" in (
        ranking.answer(alone)
    )
    # where the seeds pair, the answer names the paired test it ran
    next(e for e in alone["ranking"] if e["name"] == "slow")["test"] = "paired"
    assert "against it (paired t-test, p < 0.05)" in ranking.answer(alone)
    # with nothing behind it (every other recipe untested), no test is claimed
    alone["untested"], alone["behind"] = alone["untested"] + ["slow"], []
    assert "is first; no other recipe could be tested against it" in ranking.answer(alone)


def test_detectable_difference_shrinks_with_seeds_and_needs_two_a_side():
    a2, b2 = [10.0, 11.0], [10.5, 11.5]
    a8, b8 = a2 * 4, b2 * 4
    small, large = ranking.detectable_difference(a8, b8), ranking.detectable_difference(a2, b2)
    assert 0 < small < large
    assert ranking.detectable_difference([1.0], [1.0, 2.0]) is None
    assert ranking.detectable_difference([1.0, 1.0], [2.0, 2.0]) == 0.0


def test_a_censored_seed_takes_its_whole_runs_stages_from_a_sibling():
    netem = {"results": [{"bandwidth_mbit": 25, "world_size": 4, "runs": {"onebit_lamb": {
        "samples_per_s": 50.0, "warmup": {"samples_per_s": 10.0}}}}]}  # fmt: skip
    reached = {
        "time_to_target": {"reached": True, "stage_steps": {"warmup": 2, "compression": 3.5}}
    }
    missed = {"strategy": "onebit_lamb", "world_size": 4, "global_batch_size": 100,
              "steps": 10, "time_to_target": {"reached": False}}  # fmt: skip
    ranking.attach_run_ends([{"name": "x", "seeds": [reached, missed]}], netem)
    end = missed["time_to_target"]["run_end"]
    assert end["stage_steps"] == {"warmup": 2, "compression": 8}
    assert end["samples"] == 1000 and end["seconds"]["25"] == pytest.approx(20 + 16)
    assert "run_end" not in reached["time_to_target"]


def test_an_earlier_report_carries_its_runs_into_a_new_one(runs, netem, tmp_path):
    """--prior: a report built from an earlier report.json plus a new strategy's runs says
    what a report built from every run directory says (tables, winners, tuning, times,
    curves), names the carried runs, and refuses another target or other netem files."""
    lamb_t, ob_t, co2_t = (_record(tmp_path, r, 3, f"{r}.json")
                           for r in ("lamb", "onebit_lamb", "co2"))  # fmt: skip
    runs = [spec.rsplit(":", 1)[0] for spec in runs]  # carried runs bring no fine-tuning
    earlier = compare.write_report(runs[:4], tmp_path / "earlier", str(netem),
                                   tuning_paths=[lamb_t, ob_t])  # fmt: skip
    assert all("curve" in r for r in earlier["runs"]) and earlier["prior"] == []
    onebit = next(r for r in earlier["runs"] if r["name"] == "onebit")
    assert [p["samples"] for p in onebit["curve"]] == [200, 400, 600]
    assert [p["bytes"] for p in onebit["curve"]] == [2000, 2080, 2160]
    # warmup steps at 10 samples/s, compression steps at 50 (25 Mbit/s): 2 x 10 s + 2 x 2 s
    assert onebit["curve"][1]["seconds"]["25"] == pytest.approx(24.0)

    prior = str(tmp_path / "earlier" / "report.json")
    both = compare.write_report(runs[4:], tmp_path / "both", str(netem), tuning_paths=[co2_t],
                                prior_paths=[prior])  # fmt: skip
    direct = compare.write_report(runs, tmp_path / "direct", str(netem),
                                  tuning_paths=[lamb_t, ob_t, co2_t])  # fmt: skip
    both, direct = (json.loads((tmp_path / d / "report.json").read_text())
                    for d in ("both", "direct"))  # fmt: skip
    carried = [r.pop("carried_from") for r in both["runs"] if "carried_from" in r]
    assert carried == [prior] * 4
    assert both["runs"] == direct["runs"]
    for key in ("target", "pretraining", "tuning", "groups", "time_model"):
        assert both[key] == direct[key], key
    assert both["prior"] == [{"path": prior, "names": ["lamb", "onebit"]}]
    text = (tmp_path / "both" / "report.md").read_text()
    note = next(line for line in text.splitlines() if line.startswith("Carried from"))
    assert f"`{prior}`: lamb, onebit" in note and "samples only" not in note
    assert text.replace(note + "\n\n", "") == (tmp_path / "direct" / "report.md").read_text()
    assert (tmp_path / "both" / "val_loss_time_25mbit.png").is_file()

    # --drop: a recipe tuned again replaces its carried runs and tuning record
    again = compare.write_report(runs[3:4], tmp_path / "again", str(netem), tuning_paths=[ob_t],
                                 prior_paths=[prior], drop_prior=["onebit"])  # fmt: skip
    alone = compare.write_report(runs[:4], tmp_path / "alone", str(netem),
                                 tuning_paths=[lamb_t, ob_t])  # fmt: skip
    again, alone = (json.loads((tmp_path / d / "report.json").read_text())
                    for d in ("again", "alone"))  # fmt: skip
    assert [r.pop("carried_from", None) for r in again["runs"]] == [prior] * 3 + [None]
    assert again["runs"] == alone["runs"]
    for key in ("target", "pretraining", "tuning", "groups"):
        assert again[key] == alone[key], key
    assert again["prior"] == [{"path": prior, "names": ["lamb"], "dropped": ["onebit"]}]
    assert "Left out of them, to be replaced by this report's runs and tuning: onebit." in (
        tmp_path / "again" / "report.md").read_text()  # fmt: skip
    # ... and its measurements in the carried netem file: the recipe tuned again is measured
    # again (here 5x faster), and the same measurement in two files is still refused
    faster = json.loads(netem.read_text())
    for row in faster["results"]:
        row["runs"] = {k: {"samples_per_s": 5 * v["samples_per_s"],
                           "warmup": {"samples_per_s": 5 * v["warmup"]["samples_per_s"]}}
                       for k, v in row["runs"].items() if k == "onebit_lamb"}  # fmt: skip
    remeasured = tmp_path / "onebit_again.json"
    remeasured.write_text(json.dumps(faster))
    with pytest.raises(ValueError, match="measured in .* as well"):
        compare.write_report(runs[3:4], tmp_path / "x", [str(netem), str(remeasured)],
                             prior_paths=[prior])  # fmt: skip
    moved = compare.write_report(runs[3:4], tmp_path / "moved", [str(netem), str(remeasured)],
                                 prior_paths=[prior], drop_prior=["onebit"])  # fmt: skip
    (onebit_again,) = [r for r in moved["runs"] if r["name"] == "onebit"]
    (onebit_before,) = [r for r in again["runs"] if r["name"] == "onebit"]
    assert onebit_again["time_to_target"]["seconds"]["25"] == pytest.approx(
        onebit_before["time_to_target"]["seconds"]["25"] / 5
    )
    lamb_runs = [r["time_to_target"] for r in moved["runs"] if r["name"] == "lamb"]
    assert lamb_runs == [r["time_to_target"] for r in again["runs"] if r["name"] == "lamb"]
    assert f"Their netem measurements are left out too: onebit_lamb in `{netem}`." in (
        tmp_path / "moved" / "report.md").read_text()  # fmt: skip
    assert "left out too" not in (tmp_path / "again" / "report.md").read_text()
    for drop, message in (("nope", "no carried report has runs of that name"),
                          ("lamb", "the reference.*no runs of it on other")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            compare.write_report(runs[3:4], tmp_path / "x", str(netem), prior_paths=[prior],
                                 drop_prior=[drop])  # fmt: skip
    with pytest.raises(ValueError, match="give them"):
        compare.write_report(runs[3:4], tmp_path / "x", str(netem), drop_prior=["onebit"])

    # a record from before curves were stored: plotted against samples only, and said
    old = json.loads(Path(prior).read_text())
    for record in old["runs"]:
        del record["curve"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    compare.write_report(runs[4:], tmp_path / "old", str(netem),
                         prior_paths=[tmp_path / "old.json"])  # fmt: skip
    assert "(lamb, onebit) appear in the plot against samples only" in (
        tmp_path / "old" / "report.md").read_text()  # fmt: skip

    with pytest.raises(ValueError, match="differs from the target"):
        compare.write_report(runs[4:], tmp_path / "x", str(netem), target_loss=4.5,
                             prior_paths=[prior])  # fmt: skip
    with pytest.raises(ValueError, match="pass the same file"):
        compare.write_report(runs[4:], tmp_path / "x", prior_paths=[prior])
    with pytest.raises(ValueError, match="tuned twice"):
        compare.write_report(runs[4:], tmp_path / "x", str(netem), tuning_paths=[lamb_t],
                             prior_paths=[prior])  # fmt: skip
    with pytest.raises(ValueError, match="lamb seed 1 is given twice"):
        compare.write_report(runs[:1], tmp_path / "x", str(netem), prior_paths=[prior])
    (tmp_path / "parity.json").write_text(json.dumps({"arms": [], "gate": {}}))
    with pytest.raises(ValueError, match="not a pipeline.reports.compare report.json"):
        compare.write_report(runs[4:], tmp_path / "x", prior_paths=[tmp_path / "parity.json"])
    assert compare.main(["--prior", str(tmp_path / "nothing.json"), "--out",
                         str(tmp_path / "x")]) == 2  # fmt: skip


def test_stage_steps_are_recovered_from_stored_times_or_refused():
    """A record that kept its times but not its stages: one speed, or a 1-bit warmup and
    compression split solved at one bandwidth and checked at the other."""
    measured = {25.0: {"default": 50.0, "warmup": 10.0, "compression": 50.0},
                10000.0: {"default": 400.0, "warmup": 200.0, "compression": 400.0}}  # fmt: skip
    run = {"global_batch_size": BATCH, "stages": {s: "warmup" if s <= 7 else "compression"
                                                 for s in range(1, 31)}}  # fmt: skip
    split = timing.stage_steps(run, 20.5)
    assert split == {"warmup": 7, "compression": 13.5}
    seconds = timing.seconds_by_bandwidth(timing.stage_steps(run, 20.5), BATCH, measured)
    assert seconds["25"] == pytest.approx(7 * 10 + 13.5 * 2)
    assert timing.infer_stage_steps(20.5, seconds, measured, BATCH) == split
    # still in the warmup at the crossing
    early = timing.seconds_by_bandwidth(timing.stage_steps(run, 5.5), BATCH, measured)
    assert timing.infer_stage_steps(5.5, early, measured, BATCH) == {"warmup": 5.5,
                                                                    "compression": 0.0}  # fmt: skip
    # one speed
    flat = {f"{bw:g}": 20.5 * BATCH / sp["default"] for bw, sp in measured.items()}
    assert timing.infer_stage_steps(20.5, flat, measured, BATCH) == {"default": 20.5}
    # times no split reproduces at both bandwidths, one bandwidth only, an unmeasured one
    wrong = {**seconds, "10000": seconds["10000"] * 1.01}
    assert timing.infer_stage_steps(20.5, wrong, measured, BATCH) is None
    assert timing.infer_stage_steps(20.5, {"25": seconds["25"]}, measured, BATCH) is None
    assert timing.infer_stage_steps(20.5, {"100": 3.0}, measured, BATCH) is None


def test_carried_runs_are_retimed_with_a_new_sweep(runs, netem, tmp_path):
    """--prior --retime: carried records, even ones that kept no stages, get the times a
    report built from their run directories gets with the new netem file; a run measured
    at another setting, or whose stored times its own netem files do not give, is refused."""
    runs = [spec.rsplit(":", 1)[0] for spec in runs]
    compare.write_report(runs[:4], tmp_path / "earlier", str(netem))
    earlier = json.loads((tmp_path / "earlier" / "report.json").read_text())
    for record in earlier["runs"]:  # as records from before stages were stored
        record["time_to_target"].pop("stage_steps", None)
        for point in record["curve"]:
            point.pop("stage_steps")
    prior = tmp_path / "earlier.json"
    prior.write_text(json.dumps(earlier))
    sweep = json.loads(netem.read_text())
    for row in sweep["results"]:  # another sweep: every speed changed, the warmup's most
        for entry in row["runs"].values():
            entry["samples_per_s"] *= 1.5
            if "warmup" in entry:
                entry["warmup"]["samples_per_s"] *= 3.0
    new = tmp_path / "joint.json"
    new.write_text(json.dumps(sweep))

    retimed = compare.write_report(runs[4:], tmp_path / "retimed", str(new),
                                   prior_paths=[str(prior)], retime_prior=True)  # fmt: skip
    direct = compare.write_report(runs, tmp_path / "direct", str(new))

    def times(report):
        out = {}
        for r in report["runs"]:
            for i, block in enumerate([r["time_to_target"], *r["curve"]]):
                for bw, value in block["seconds"].items():
                    out[(r["name"], r["seed"], i, bw)] = value
        return out

    assert times(retimed) == pytest.approx(times(direct)) and len(times(direct)) == 30
    onebit = next(r for r in retimed["runs"] if r["name"] == "onebit")
    assert onebit["retimed"] is True
    assert onebit["time_to_target"]["stage_steps"] == {"warmup": 2, "compression": 3}
    # 2 warmup steps at 30 samples/s, 3 compression steps at 75 (25 Mbit/s)
    assert onebit["time_to_target"]["seconds"]["25"] == pytest.approx(2 * 100 / 30 + 3 * 100 / 75)
    assert retimed["groups"] == direct["groups"]
    assert retimed["time_model"]["carried_runs_retimed"] is True
    assert "re-timed with this report's netem files" in (
        tmp_path / "retimed" / "report.md").read_text()  # fmt: skip
    argv = ["--prior", str(prior), "--netem", str(new), "--retime", "--out", str(tmp_path / "cli")]
    assert compare.main([*argv, "--run", runs[4]]) == 0
    cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert times(cli) == pytest.approx(times(direct))
    # without --retime the earlier report's netem files are required, as before
    with pytest.raises(ValueError, match="pass the same file"):
        compare.write_report(runs[4:], tmp_path / "x", str(new), prior_paths=[str(prior)])
    # stored times that the earlier netem files do not give
    bad = json.loads(prior.read_text())
    bad["runs"][0]["time_to_target"]["seconds"]["25"] *= 2
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="stored times are not"):
        compare.write_report(runs[4:], tmp_path / "x", str(new), retime_prior=True,
                             prior_paths=[str(tmp_path / "bad.json")])  # fmt: skip
    with pytest.raises(ValueError, match="needs an earlier report"):
        compare.write_report(runs, tmp_path / "x", str(new), retime_prior=True)


def test_retiming_refuses_a_local_step_recipe_measured_at_another_round_length(tmp_path):
    old = {"outer_every": 4, "outer_every_by_recipe": {"slowmo_node": 8},
           "inner_by_recipe": {"slowmo_node": "adamw"},
           "results": [{"bandwidth_mbit": 25, "world_size": 4,
                        "runs": {"slowmo_node": {"samples_per_s": 20.0}}}]}  # fmt: skip
    run = {"name": "slowmo_node", "strategy": "slowmo_node", "world_size": 4}
    compare_prior._check_same_setting("old.json", run, old, old)  # the same setting: fine
    # a run no recipe describes has nothing to check and no known stages
    compare_prior._check_same_setting("old.json", {**run, "strategy": None}, old, old)
    assert compare_prior._single_stage(None) is False and compare_prior._single_stage("slowmo_node")
    new = {**old, "outer_every_by_recipe": {}}
    with pytest.raises(ValueError, match="rounds of 8 steps and adamw inside.*has 4"):
        compare_prior._check_same_setting("old.json", run, old, new)


def test_each_strategy_is_also_set_against_the_reference_on_its_own_data(tiny_corpus, tmp_path):
    """--data-reference: runs of the reference's recipe on other data; a strategy whose
    seeds all ran on that data is set against them (Welch), the main reference's shift to
    them is reported, and both carry into a later report."""
    other = tmp_path / "other_corpus"  # the same shards under another tokenizer
    other.mkdir()
    for path in tiny_corpus.iterdir():
        (other / path.name).symlink_to(path)
    manifest = json.loads((tiny_corpus / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "f" * 64
    (other / "manifest.json").unlink()
    (other / "manifest.json").write_text(json.dumps(manifest))

    def run(name, corpus, seed, final):
        config = {**LAMB, "data": {"path": str(corpus)}}
        val = [(2, 5.0), (4, 4.6), (6, final)]
        return f"{name}={_pretrain(tmp_path / f'{name}{seed}', config, val, {'g': 10}, seed=seed)}"

    specs = [run("lamb", tiny_corpus, s, f) for s, f in ((1, 4.18), (2, 4.2), (3, 4.22))]
    specs += [run("mixed", tiny_corpus, 1, 4.3), run("mixed", other, 2, 4.3)]
    specs += [run("onnew", other, s, f) for s, f in ((1, 4.50), (2, 4.52))]
    references = [run("lambnew", other, s, f) for s, f in ((1, 4.49), (2, 4.53), (3, 4.51))]
    references = [spec.replace("lambnew=", "lamb=") for spec in references]
    out = tmp_path / "report"
    # runs of two data identities are not ranked together unless asked
    with pytest.raises(ValueError, match="2 different data identities.*--mixed-data"):
        compare.write_report(specs, out, data_reference_specs=references)
    assert compare.main([*(a for s in specs for a in ("--run", s)), "--out", str(out)]) == 2
    report = compare.write_report(specs, out, data_reference_specs=references, mixed_data=True)
    assert report["data"]["mixed"] and len(report["data"]["identities"]) == 2
    assert "**Mixed data: these records were pretrained on 2 data identities" in (
        out / "report.md").read_text()  # fmt: skip
    (group,) = report["same_data"]
    assert group["data"]["tokenizer_sha256"] == "f" * 64 and group["seeds"] == [1, 2, 3]
    assert group["final_val_mlm_loss"]["mean"] == pytest.approx(4.51)
    # the main reference (LAMB on the first corpus, 4.2 on average) against LAMB on this one
    assert group["main_reference_shift"]["difference"] == pytest.approx(0.31)
    assert group["main_reference_shift"]["test"] == "welch"
    # only the strategy whose seeds all ran on the other data is set against it
    (arm,) = group["arms"]
    assert arm["name"] == "onnew" and arm["difference"] == pytest.approx(0.0)
    assert arm["verdict"] == "no significant difference" and arm["p"] > 0.5
    # against the main reference the same runs differ
    main = report["pretraining"]["val_mlm_loss"]["onnew"]
    assert main["difference"] == pytest.approx(0.31) and main["verdict"] == "differs"
    text = (out / "report.md").read_text()
    assert "## Against the reference on the same data" in text
    assert re.search(
        r"\| onnew \| 4\.5100 \| [+-]0\.0000 \| welch \| 1 \| no significant difference \| 0/2 \|",
        text,
    )
    by = {(r["name"], r["seed"]): r for r in report["runs"]}
    assert by[("onnew", 1)]["data"]["tokenizer_sha256"] == "f" * 64
    assert by[("lamb", 1)]["data"] == tuning_data(tiny_corpus)
    # a later report carrying this one keeps the references and the section
    later = compare.write_report([], tmp_path / "later", prior_paths=[str(out / "report.json")],
                                 mixed_data=True)  # fmt: skip
    assert [r["data"] for r in later["runs"]] == [r["data"] for r in report["runs"]]
    assert later["same_data"] == report["same_data"]
    # dropping the reference: its runs on the other data take its place, and with the
    # strategies of the first data dropped too, the report holds one data identity
    one = compare.write_report([], tmp_path / "one", prior_paths=[str(out / "report.json")],
                               drop_prior=["lamb", "mixed"])  # fmt: skip
    assert [(r["name"], r["seed"]) for r in one["runs"]] == [
        ("lamb", 1), ("lamb", 2), ("lamb", 3), ("onnew", 1), ("onnew", 2)]  # fmt: skip
    assert not one["data"]["mixed"] and "data_references" not in one
    assert one["pretraining"]["val_mlm_loss"]["lamb"]["mean"] == pytest.approx(4.51)
    assert one["pretraining"]["val_mlm_loss"]["onnew"]["verdict"] == "no significant difference"
    assert one["prior"][0]["promoted"] == "lamb"
    assert "The reference lamb is now its carried runs on other data" in (
        tmp_path / "one" / "report.md").read_text()  # fmt: skip
    with pytest.raises(ValueError, match="2 different data identities"):
        compare.write_report([], tmp_path / "x", prior_paths=[str(out / "report.json")],
                             drop_prior=["lamb"])  # fmt: skip
    with pytest.raises(ValueError, match="lamb seed 1 on the same data is given twice"):
        compare.write_report([], tmp_path / "twice", prior_paths=[str(out / "report.json")],
                             data_reference_specs=references[:1], mixed_data=True)  # fmt: skip
    # runs on other data of another name than the reference's: refused
    with pytest.raises(ValueError, match="must be the reference's \\(lamb=RUN_DIR\\)"):
        renamed = [references[0].replace("lamb=", "onnew=")]
        compare.write_report(specs, tmp_path / "other_name", data_reference_specs=renamed,
                             mixed_data=True)  # fmt: skip
    # a reference whose data folder is gone has no known data: refused
    gone = run("lambgone", tmp_path / "no_such_corpus", 4, 4.5).replace("lambgone=", "lamb=")
    with pytest.raises(ValueError, match="data folder .*no_such_corpus.* is not readable"):
        compare.write_report(specs, tmp_path / "gone", data_reference_specs=[gone],
                             mixed_data=True)  # fmt: skip


def test_a_carried_run_takes_its_data_from_the_tuning_that_evaluated_it():
    from pipeline.reports.same_data import assign_data

    data = {"tokenizer_sha256": "a" * 64, "shards_sha256": "b" * 64}
    tuning = {"x": {"data": data, "evaluation": [{"seed": 2, "run_dir": "/r/x-eval-seed2"}]},
              "y": {"evaluation": [{"seed": 2, "run_dir": "/r/y-eval-seed2"}]}}  # fmt: skip
    runs = [{"pretrain_dir": "/r/x-eval-seed2"}, {"pretrain_dir": "/r/y-eval-seed2"},
            {"pretrain_dir": "/r/z", "data": {**data, "shards_sha256": "c" * 64}}]  # fmt: skip
    assign_data(runs, tuning)
    assert runs[0]["data"] == data and runs[1]["data"] is None
    assert runs[2]["data"]["shards_sha256"] == "c" * 64  # a recorded identity is kept


def _paired_seed(seed, seconds, data="d1"):
    return {"seed": seed, "global_batch_size": 128, "steps": 1400,
            "data": {"tokenizer_sha256": data, "shards_sha256": "s"},
            "time_to_target": {"reached": True, "measured_bandwidths": [25],
                               "seconds": {"25": seconds}}}  # fmt: skip


def test_seeds_that_share_initialisation_and_data_are_compared_in_pairs():
    # seeds spread by +-20 % together: Welch cannot see a 5 % gap, the pairs can
    lead = [100.0, 120.0, 80.0, 110.0, 90.0, 105.0]
    slow = [t * f for t, f in zip(lead, (1.05, 1.06, 1.04, 1.05, 1.055, 1.045), strict=True)]
    first = {"name": "first", "seeds": [_paired_seed(k + 1, t) for k, t in enumerate(lead)]}
    other = {"name": "other", "seeds": [_paired_seed(k + 1, t) for k, t in enumerate(slow)]}
    (row,) = ranking.groups([first, other], [25.0])
    entry = row["ranking"][1]
    assert entry["test"] == "paired" and entry["pairs_vs_first"] == 6
    assert row["behind"] == ["other"] and entry["p_vs_first"] < 1e-4
    logs = [math.log(b / a) for a, b in zip(lead, slow, strict=True)]
    sd = statistics.stdev(logs)
    assert entry["detectable_difference_pct"] == pytest.approx(
        100 * math.expm1((t_quantile(0.975, 5) + t_quantile(0.8, 5)) * sd / math.sqrt(6))
    )
    assert welch_t_test(lead, slow).p > 0.5  # what the unpaired test would have said
    # other data, or no data recorded (an earlier vocabulary): no pairs, Welch on every seed
    for data in ("d2", None):
        moved = {"name": "other", "seeds": [
            {**_paired_seed(k + 1, t), "data": data and {"tokenizer_sha256": data}}
            for k, t in enumerate(slow)]}  # fmt: skip
        (row,) = ranking.groups([first, moved], [25.0])
        assert row["ranking"][1]["test"] == "welch" and row["leaders"] == ["first", "other"]
    # one shared seed is no pair test; one seed each and unpaired: untested
    single = {"name": "other", "seeds": [_paired_seed(1, slow[0]), _paired_seed(9, 130.0)]}
    (row,) = ranking.groups([first, single], [25.0])
    assert row["ranking"][1]["test"] == "welch"
    alone = {"name": "other", "seeds": [_paired_seed(9, 130.0)]}
    (row,) = ranking.groups([first, alone], [25.0])
    assert row["untested"] == ["other"]


def _repeated_sweep(netem, path, scales=(0.8, 1.25)):
    """``netem``'s sweep measured once per scale, every speed scaled: a sweep with repeats."""
    sweep = json.loads(netem.read_text())
    rows = []
    for repeat, scale in enumerate(scales):
        for row in sweep["results"]:
            scaled = {k: ({**v, "samples_per_s": v["samples_per_s"] * scale,
                           **({"warmup": {"samples_per_s": v["warmup"]["samples_per_s"] * scale}}
                              if "warmup" in v else {})})
                      for k, v in row["runs"].items()}  # fmt: skip
            rows.append({**row, "repeat": repeat, "runs": scaled})
    path.write_text(json.dumps({**sweep, "sweep_id": "s1", "repeats": len(scales),
                                "results": rows}))  # fmt: skip
    return path


def test_a_repeated_sweep_times_each_seed_at_every_repeat(runs, netem, tmp_path):
    """The report from a sweep measured twice: one speed per point at the repeats' mean
    step time, each seed's time at every repeat's speeds, the groups' intervals spanning
    them and the sweep named in report.json."""
    repeated = _repeated_sweep(netem, tmp_path / "repeated.json")
    report = compare.write_report(runs, tmp_path / "report", str(repeated))
    assert report["time_model"]["sweeps"] == [
        {"file": str(repeated), "sweep_id": "s1", "repeats": 2}
    ]
    by = {(r["name"], r["seed"]): r for r in report["runs"]}
    lamb1 = by[("lamb", 1)]["time_to_target"]
    step = 4 + 2 * 0.4 / 0.6
    # 10 samples/s scaled by 0.8 and 1.25: timed at the mean of the two step times
    assert lamb1["seconds"]["25"] == pytest.approx(step * BATCH * (1 / 8.0 + 1 / 12.5) / 2)
    assert lamb1["seconds_by_repeat"]["25"] == pytest.approx(
        [step * BATCH / 8.0, step * BATCH / 12.5]
    )
    # the censored seed's lower bound has its repeats too
    end = by[("lamb", 3)]["time_to_target"]["run_end"]
    assert end["seconds_by_repeat"]["25"] == pytest.approx([600 / 8.0, 600 / 12.5])
    group = {g["bandwidth_mbit"]: g for g in report["groups"]}[25]
    lamb = next(e for e in group["ranking"] if e["name"] == "lamb")
    assert len(lamb["by_repeat"]) == 2
    lo, hi = lamb["interval"]
    assert lo < min(lamb["by_repeat"][1]) and hi > max(lamb["by_repeat"][0])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "Sweeps: `s1` (2 repeats of every point, interleaved)" in text


def test_carried_runs_are_retimed_at_every_repeat(runs, netem, tmp_path):
    runs = [spec.rsplit(":", 1)[0] for spec in runs]
    compare.write_report(runs[:4], tmp_path / "earlier", str(netem))
    repeated = _repeated_sweep(netem, tmp_path / "repeated.json")
    retimed = compare.write_report(runs[4:], tmp_path / "retimed", str(repeated),
                                   prior_paths=[str(tmp_path / "earlier" / "report.json")],
                                   retime_prior=True)  # fmt: skip
    direct = compare.write_report(runs, tmp_path / "direct", str(repeated))

    def per_repeat(report):
        return {(r["name"], r["seed"]): r["time_to_target"].get("seconds_by_repeat")
                for r in report["runs"]}  # fmt: skip

    assert per_repeat(retimed) == per_repeat(direct)
    assert per_repeat(direct)[("lamb", 1)]["25"][0] > per_repeat(direct)[("lamb", 1)]["25"][1]
    assert retimed["groups"] == direct["groups"]


def test_the_recipes_close_to_a_leader_that_owe_seeds(tmp_path, capsys):
    def entry(name, mean, seeds):
        return {"name": name, "mean": mean, "seeds": seeds}

    report = {
        "groups": [
            {"bandwidth_mbit": 25.0, "ranking": [entry("a", 100.0, 2), entry("b", 110.0, 2),
                                                 entry("c", 125.0, 6), entry("d", 126.0, 2)]},
            {"bandwidth_mbit": 10000.0, "ranking": [entry("d", 10.0, 2), entry("a", 30.0, 2)]},
            {"bandwidth_mbit": 100.0, "ranking": []},
        ],
        "tuning": {"b": {"nodes": 2}},
    }  # fmt: skip
    owed = ranking.seeds_owed(report, within=0.25, seeds=6)
    # c is close but has its 6 seeds; d is 26 % behind at 25 Mbit/s but first at 10 Gbit/s
    assert [(e["name"], e["nodes"], e["bandwidths_mbit"]) for e in owed] == [
        ("a", 1, [25.0]), ("b", 2, [25.0]), ("d", 1, [10000.0])]  # fmt: skip
    assert [e["name"] for e in ranking.seeds_owed(report, within=0.3, seeds=3)] == ["a", "b", "d"]
    # a leader owes seeds however far behind, when the leaders rule is on
    report["groups"][1]["leaders"] = ["d", "a"]
    report["groups"][0]["ranking"].append(entry("e", 500.0, 2))
    report["groups"][0]["leaders"] = ["a", "b", "c", "e"]
    assert [e["name"] for e in ranking.seeds_owed(report, 0.25, 6, leaders=True)] == [
        "a", "b", "d", "e"]  # fmt: skip
    assert "e" not in [e["name"] for e in ranking.seeds_owed(report, 0.25, 6)]
    del report["groups"][0]["ranking"][-1], report["groups"][0]["leaders"]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert ranking.main(["--report", str(path)]) == 0  # the pre-registered 25 %, 6 seeds
    assert capsys.readouterr().out == "a 1\nb 2\nd 1\n"
    tighter = tmp_path / "tighter.yaml"
    tighter.write_text(PREREGISTERED.read_text().replace("within: 0.25", "within: 0.05"))
    assert ranking.main(["--report", str(path), "--preregistered", str(tighter)]) == 0
    assert capsys.readouterr().out == "a 1\nd 1\n"  # b is 10 % behind: no longer close
    with pytest.raises(SystemExit):
        ranking.main(["--report", str(tmp_path / "none.json")])
    assert "no such file" in capsys.readouterr().err


PREREGISTERED = Path(__file__).resolve().parents[2] / ranking.PREREGISTERED


def test_the_preregistered_test_is_the_one_the_ranking_computes(tmp_path):
    plan = ranking.load_preregistration(PREREGISTERED)
    assert (plan.test, plan.alpha, plan.power) == ("paired", ranking.ALPHA, ranking.POWER)
    assert (plan.within, plan.seeds, plan.bandwidths_mbit) == (0.25, 6, (25.0, 10000.0))
    assert plan.leaders and plan.amended.startswith("2026-11-30T")  # before the owed seeds
    text = PREREGISTERED.read_text()
    for old, new, says in [("alpha: 0.05", "alpha: 0.1", "alpha is 0.1"),
                           ("test: paired", "test: welch", "test is 'welch'"),
                           ("seeds: 6\n", "", "missing ['seeds']"),
                           ("seeds: 6", "seeds: 6\nmargin: 1", "unknown ['margin']")]:  # fmt: skip
        changed = tmp_path / "changed.yaml"
        changed.write_text(text.replace(old, new))
        with pytest.raises(ValueError, match=re.escape(says)):
            ranking.load_preregistration(changed)
    with pytest.raises(FileNotFoundError, match="no such pre-registration file"):
        ranking.load_preregistration(tmp_path / "none.yaml")


def test_the_report_states_its_preregistration_and_the_seeds_it_owes(runs, netem, tmp_path):
    report = compare.write_report(runs, tmp_path / "r", str(netem),
                                  groups_config=str(PREREGISTERED))  # fmt: skip
    plan = ranking.load_preregistration(PREREGISTERED)
    assert report["groups_preregistration"] == plan.as_dict()
    text = (tmp_path / "r" / "report.md").read_text()
    owed = ranking.seeds_owed(report, 0.25, 6)
    assert owed and f"**Seeds still owed**: {owed[0]['name']} ({owed[0]['seeds']}/6)" in text
    few = tmp_path / "few.yaml"
    few.write_text(PREREGISTERED.read_text().replace("seeds: 6", "seeds: 2"))
    # without the one-seed onebit, LAMB (3 seeds) is the only recipe timed
    compare.write_report(runs[:3] + runs[4:], tmp_path / "done", str(netem),
                         groups_config=str(few))  # fmt: skip
    assert "Every such recipe has its 2 seeds." in (tmp_path / "done" / "report.md").read_text()
    assert "groups_preregistration" not in compare.write_report(runs, tmp_path / "n", str(netem))


def test_the_report_draws_where_onebit_lamb_stops_paying(runs, tmp_path):
    from tests.helpers.netem_rows import model_row

    named = [s.replace("onebit=", "onebit_lamb=", 1) for s in runs]
    path = tmp_path / "model.json"
    path.write_text(
        json.dumps(
            {
                "model": "bert-mini",
                "seq_length": 128,
                "batch_per_rank": 64,
                "results": [model_row(bw, 8.0, 8.5) for bw in (25, 10000)],
            }
        )
    )
    out = tmp_path / "paying"
    report = compare.write_report(named, out, str(path))
    rows = report["crossover"]
    assert [r["ranks"] for r in rows] == [4, 16, 64] and rows[0]["figure"] == "crossover.png"
    assert (out / "crossover.png").stat().st_size > 0
    text = (out / "report.md").read_text()
    assert "## Where onebit_lamb stops paying against lamb" in text
    assert "![modelled time to the target against the link](crossover.png)" in text
    # the section is rendered again from the JSON alone (the pages' drift check)
    assert "\n".join(crossover.crossover_lines(report["crossover"])) in text
