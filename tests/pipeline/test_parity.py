"""The parity experiment's chain (target stage, random-init baseline, sensitivity runs) and
the parity report's gate, signal and sensitivity sections on synthetic runs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from pipeline.experiment import load_experiment
from pipeline.reports.parity import write_report
from pipeline.target import fix_target
from pipeline.target import main as target_main
from tests.helpers.paths import REPO

BATCH = 100
STEPS = 50
START = 1_790_000_000  # the runs' clock (Unix seconds): 2026-09-21


def _pretrain(directory: Path, optimizer: str, seed: int, delay: float, end: float = 3.0,
              freeze_step: int | str = 10) -> Path:  # fmt: skip
    """A finished run whose validation loss falls linearly from 8 to ``end``, shifted later
    by ``delay`` steps (a slower run reaches any loss later)."""
    directory.mkdir(parents=True)
    config = {
        "seed": seed,
        "batch": {"global_batch_size": BATCH},
        "optimizer": {"name": optimizer, "freeze_step": freeze_step},
        "schedule": {"max_steps": STEPS},
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    records = [
        {"step": s, "loss": 6.0, "comm_bytes": 10, "time": START + s} for s in range(1, STEPS + 1)
    ]
    for step in range(5, STEPS + 1, 5):
        progress = min(1.0, max(0.0, (step - delay) / STEPS))
        loss = 8.0 - (8.0 - end) * progress
        records.append({"step": step, "val_mlm_loss": loss, "val_mlm_accuracy": 1 / loss})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def _finetune(directory: Path, scores: dict[str, list[float]]) -> Path:
    directory.mkdir(parents=True)
    results = {
        task: {
            "accuracy": sum(values) / len(values),
            "main_metric": "accuracy",
            "per_seed": {str(i + 1): {"accuracy": v} for i, v in enumerate(values)},
        }
        for task, values in scores.items()
    }
    (directory / "results.json").write_text(json.dumps(results))
    return directory


def test_the_target_stage_comes_between_the_reference_and_every_other_arm(tmp_path):
    exp = load_experiment(REPO / "configs/experiments/parity.yaml", [f"workdir={tmp_path}"])
    stages = exp.resolve(write=False)
    names = [s.name for s in stages]
    target = names.index("target")
    lamb = [i for i, n in enumerate(names) if n.startswith("pretrain/lamb-")]
    others = [i for i, n in enumerate(names) if n.startswith("pretrain/onebit")]
    assert len(lamb) == 5 and len(others) == 5 + 4
    assert max(lamb) < target < min(others)
    assert sorted(exp.stage("target").depends) == sorted(names[i] for i in lamb)
    assert all("target" in stages[i].depends for i in others)
    assert "--fraction" in exp.stage("target").args
    # the random-init baseline fine-tunes LAMB seed 1's architecture from fresh weights
    baseline = exp.stage("finetune/random-init")
    assert baseline.stage_config().init == "random"
    assert "lamb-seed1" in baseline.stage_config().checkpoint
    assert baseline.depends == ["pretrain/lamb-seed1/phase1"]
    # sensitivity runs: pretraining only, reported apart, and their freeze steps
    assert not any(n.startswith("finetune/onebit_freeze") for n in names)
    report = exp.stage("report")
    sensitivity = [a for a in report.args if a.startswith("onebit_freeze")]
    assert len(sensitivity) == 4
    freeze = {
        n: exp.stage(n).stage_config().optimizer.freeze_step
        for n in names
        if n.startswith("pretrain/onebit_freeze")
    }
    assert sorted(freeze.values(), key=str) == [1200, 300, 600, "auto"]
    for flag in ("--target", "--baseline", "--margin", "--min-seeds"):
        assert flag in report.args
    assert "pretrain/onebit_freeze10-seed1/phase1" in report.depends


def test_the_stretched_regime_keeps_every_dimensionless_quantity_of_the_parity_regime(tmp_path):
    def arms(name: str) -> dict:
        exp = load_experiment(REPO / "configs/experiments" / name, [f"workdir={tmp_path / name}"])
        return {s.name: s.stage_config() for s in exp.resolve(write=False) if s.kind == "pretrain"}

    short, long = arms("parity.yaml"), arms("parity_long.yaml")
    assert short.keys() == long.keys()
    for name, cfg in long.items():
        ref = short[name]
        assert cfg.schedule.max_steps == 2 * ref.schedule.max_steps
        for field in ("name", "power", "warmup_proportion"):
            assert getattr(cfg.schedule, field) == getattr(ref.schedule, field)
        steps, ref_steps = cfg.schedule.max_steps, ref.schedule.max_steps
        assert (cfg.model, cfg.batch) == (ref.model, ref.batch)
        if cfg.optimizer.freeze_step == "auto":  # the detector decides, in both regimes
            assert ref.optimizer.freeze_step == "auto"
        else:
            assert cfg.optimizer.freeze_step / steps == ref.optimizer.freeze_step / ref_steps
            # the second moment's fill at the freeze: the recipe's 1 - 0.999^1000 = 0.632
            fill = 1 - cfg.optimizer.betas[1] ** cfg.optimizer.freeze_step
            ref_fill = 1 - ref.optimizer.betas[1] ** ref.optimizer.freeze_step
            assert fill == pytest.approx(ref_fill, abs=1e-3)
            if "freeze" not in name:  # the sensitivity arms move the freeze on purpose
                assert fill == pytest.approx(0.633, abs=1e-3)
        assert Path(cfg.data.path).parts[-2:] == Path(ref.data.path).parts[-2:]
        assert cfg.optimizer.lr == ref.optimizer.lr


def test_the_target_stage_refuses_a_file_that_disagrees_with_the_config(tmp_path):
    exp = load_experiment(
        REPO / "configs/experiments/parity.yaml",
        [f"workdir={tmp_path}", "report.target_loss=3.5"],
    )
    exp.resolve(write=False)
    stage = exp.stage("target")
    assert stage.args[-2:] == ["--value", "3.5"]
    assert not stage.done()
    stage.output.write_text(json.dumps({"value": 3.4}))
    with pytest.raises(ValueError, match="a target is fixed once"):
        stage.done()
    stage.output.write_text(json.dumps({"value": 3.5}))
    assert stage.done()


def _arms(tmp_path: Path, onebit_delays: list[float]) -> tuple[list[str], list[str]]:
    lamb = [
        f"lamb={_pretrain(tmp_path / f'lamb{s}', 'lamb', s, d)}"
        for s, d in zip(range(1, 6), [0, 0.5, 1.0, 0.25, 0.75], strict=True)
    ]
    onebit = [
        f"onebit={_pretrain(tmp_path / f'onebit{s}', 'onebit_lamb', s, d)}"
        for s, d in enumerate(onebit_delays, start=1)
    ]
    return lamb, onebit


def test_target_is_fixed_from_the_reference_runs(tmp_path):
    lamb, _ = _arms(tmp_path, [])
    target = fix_target(lamb, 0.8)
    # the worst (latest) seed, delay 1 step: at step 40 its loss is 8 - 5 * 39 / 50
    assert target["value"] == pytest.approx(8.0 - 5.0 * 39 / 50)
    assert target["worst"] == "seed 3" and target["at_samples"] == 0.8 * STEPS * BATCH
    out = tmp_path / "target.json"
    assert target_main([*(a for spec in lamb for a in ("--run", spec)), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["value"] == pytest.approx(target["value"])
    fixed = fix_target(lamb, 0.8, value=4.2)
    assert fixed["value"] == 4.2 and fixed["source"] == "experiment config"
    assert fixed["rule_value"] == pytest.approx(target["value"])
    with pytest.raises(ValueError, match="one reference arm"):
        fix_target([*lamb, lamb[0].replace("lamb=", "other=")], 0.8)


@pytest.mark.parametrize(
    "delays, verdict",
    [([0.1, 0.6, 0.2, 0.9, 0.4], "pass"), ([9.0, 9.5, 9.2, 9.8, 9.1], "fail")],
)
def test_report_gates_samples_to_target(tmp_path, delays, verdict):
    lamb, onebit = _arms(tmp_path, delays)
    target = fix_target(lamb, 0.8)
    report = write_report([*lamb, *onebit], tmp_path / "report", target)
    gate = report["gate"]
    assert gate["gates"]["onebit"]["verdict"] == verdict
    assert all(r["samples_to_target"] is not None for r in gate["per_seed"]["lamb"])
    assert gate["reference_spread"]["seeds"] == 5
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Gate" in markdown and f"**{verdict}**" in markdown
    gate_section = markdown.split("## Gate")[1].split("## Pretraining")[0]
    assert "no significant difference" not in gate_section
    # fixed now, after the synthetic runs "started" in September: the report says so
    assert "**after** onebit seed 1" in gate["fixed_before"]
    target["fixed_at"] = "2026-01-01T00:00:00Z"
    early = write_report([*lamb, *onebit], tmp_path / "report2", target)["gate"]
    assert early["fixed_before"] == "before any of the other arms' 5 runs started"
    for name in ("val_loss_target.png", "samples_to_target.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    # no fine-tuning yet: no fine-tuning figure, and none left from an earlier report
    assert "finetune_scores.png" not in markdown
    assert not (tmp_path / "report" / "finetune_scores.png").exists()
    (tmp_path / "report2" / "finetune_scores.png").write_bytes(b"stale")
    write_report([*lamb, *onebit], tmp_path / "report2", target)
    assert not (tmp_path / "report2" / "finetune_scores.png").exists()


def test_a_run_that_never_reaches_the_target_is_reported_as_such(tmp_path):
    lamb, _ = _arms(tmp_path, [])
    slow = _pretrain(tmp_path / "slow", "onebit_lamb", 1, 0.0, end=6.0)
    onebit = [f"onebit={slow}"] + [
        f"onebit={_pretrain(tmp_path / f'ob{s}', 'onebit_lamb', s, 0.2)}" for s in range(2, 6)
    ]
    target = fix_target(lamb, 0.8)
    report = write_report([*lamb, *onebit], tmp_path / "report", target)
    rows = report["gate"]["per_seed"]["onebit"]
    assert rows[0]["samples_to_target"] is None
    assert report["gate"]["gates"]["onebit"]["verdict"] == "fail"
    assert "never reached the target" in report["gate"]["gates"]["onebit"]["reason"]
    assert "| onebit | 1 | not reached |" in (tmp_path / "report" / "report.md").read_text()


def test_tasks_without_signal_get_no_verdict(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 0.2, 0.9, 0.4])
    scores = {"sst2": [0.80, 0.81], "mrpc": [0.70, 0.72]}
    runs = []
    for i, spec in enumerate([*lamb, *onebit]):
        ft = _finetune(tmp_path / f"ft{i}", scores)
        runs.append(f"{spec}:{ft}")
    baseline = _finetune(tmp_path / "random", {"sst2": [0.60, 0.61], "mrpc": [0.71, 0.70]})
    report = write_report(runs, tmp_path / "report", baseline_spec=f"random-init={baseline}")
    sst2, mrpc = report["finetune"]["sst2"], report["finetune"]["mrpc"]
    assert sst2["signal"]["signal"] and not mrpc["signal"]["signal"]
    assert sst2["metrics"]["accuracy"]["random-init"]["mean"] == pytest.approx(0.605)
    assert mrpc["metrics"]["accuracy"]["onebit"]["verdict"] == "no signal at this scale"
    assert sst2["metrics"]["accuracy"]["onebit"]["verdict"] != "no signal at this scale"
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| mrpc | accuracy |" in markdown and "**no signal at this scale**" in markdown
    # the difference's 95 % interval over pretraining seeds: every seed scored alike, so
    # both arms' per-seed means are equal and the interval is the point 0
    row = sst2["metrics"]["accuracy"]["onebit"]
    assert row["difference"] == pytest.approx(0.0) and row["interval"] == pytest.approx([0, 0])
    assert "+0.0000 [+0.0000, +0.0000]" in markdown


def test_a_fine_tuning_difference_carries_its_interval():
    """Known numbers: per-seed means 0.80/0.82/0.84 against 0.70/0.74/0.78 give a difference
    of -0.08 with Welch's t interval (df from Welch-Satterthwaite)."""
    from pipeline.reports.parity import compare_finetuning

    def arm(name, scores):
        seeds = [{"finetune": {"sst2": {"accuracy": v, "main_metric": "accuracy"}}}
                 for v in scores]  # fmt: skip
        return {"name": name, "seeds": seeds}

    table = compare_finetuning([arm("lamb", [0.80, 0.82, 0.84]), arm("ob", [0.70, 0.74, 0.78])])
    row = table["sst2"]["metrics"]["accuracy"]["ob"]
    se = math.sqrt(0.02**2 / 3 + 0.04**2 / 3)
    df = se**4 / ((0.02**2 / 3) ** 2 / 2 + (0.04**2 / 3) ** 2 / 2)
    assert df == pytest.approx(2.9412, abs=1e-4)
    half = 3.2187586 * se  # scipy.stats.t.ppf(0.975, 50 / 17)
    assert row["difference"] == pytest.approx(-0.08)
    assert row["interval"] == pytest.approx([-0.08 - half, -0.08 + half], abs=1e-6)
    one = compare_finetuning([arm("lamb", [0.80]), arm("ob", [0.70])])
    assert one["sst2"]["metrics"]["accuracy"]["ob"]["interval"] is None


def test_sensitivity_runs_are_shown_apart(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 0.2, 0.9, 0.4])
    sens = [
        f"freeze{f}={_pretrain(tmp_path / f'f{f}', 'onebit_lamb', 1, 0.3, freeze_step=f)}"
        for f in (5, 20)
    ]
    target = fix_target(lamb, 0.8)
    report = write_report([*lamb, *onebit], tmp_path / "report", target, sens)
    rows = report["sensitivity"]
    assert [r["freeze_fraction"] for r in rows] == [0.1, 0.4]
    assert all(r["samples_to_target"] is not None for r in rows)
    assert "freeze5" not in report["gate"]["gates"]
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Sensitivity (not gated)" in markdown
    assert (tmp_path / "report" / "sensitivity.png").stat().st_size > 0


def test_a_sensitivity_run_with_freeze_auto_reports_the_step_it_chose(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 0.2, 0.9, 0.4])
    auto = _pretrain(tmp_path / "auto", "onebit_lamb", 1, 0.3, freeze_step="auto")
    records = (auto / "metrics.jsonl").read_text().splitlines()
    staged = [{**r, "stage": "warmup" if r["step"] <= 12 else "compression"}
              for r in map(json.loads, records)]  # fmt: skip
    (auto / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in staged))
    target = fix_target(lamb, 0.8)
    report = write_report([*lamb, *onebit], tmp_path / "report", target, [f"auto={auto}"])
    (row,) = report["sensitivity"]
    assert (row["freeze_step"], row["freeze_rule"]) == (12, "auto")
    assert row["freeze_fraction"] == 12 / STEPS
    assert "| auto | 1 | auto: 12 |" in (tmp_path / "report" / "report.md").read_text()


def test_fine_tuning_rests_on_the_seeds_fine_tuned_so_far(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 0.2, 0.9, 0.4])
    runs = []
    for i, spec in enumerate([*lamb, *onebit]):
        if i == len(lamb) + 1:  # one 1-bit seed without fine-tuning yet
            runs.append(spec)
            continue
        runs.append(f"{spec}:{_finetune(tmp_path / f'ft{i}', {'sst2': [0.80, 0.81]})}")
    report = write_report(runs, tmp_path / "report")
    rows = report["finetune"]["sst2"]["metrics"]["accuracy"]
    assert rows["lamb"]["n"] == 2 * len(lamb)
    assert rows["onebit"]["n"] == 2 * (len(onebit) - 1)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert f"onebit {len(onebit) - 1} of {len(onebit)}" in markdown


def test_an_arm_without_fine_tuning_is_named_and_left_out_of_the_table(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 0.2, 0.9, 0.4])
    variant = [s.replace("onebit=", "variant=") for s in onebit]
    scores = {"sst2": [0.80, 0.81]}
    runs = [f"{s}:{_finetune(tmp_path / f'ft{i}', scores)}" for i, s in enumerate(lamb + onebit)]
    report = write_report([*runs, *variant], tmp_path / "report")
    rows = report["finetune"]["sst2"]["metrics"]["accuracy"]
    assert set(rows) == {"lamb", "onebit"}
    assert rows["onebit"]["n"] == 2 * len(onebit)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "Not fine-tuned, so not in this table: variant." in markdown
    assert "| sst2 | accuracy (main) |" in markdown
    # without the reference's fine-tuning there is no table
    plain = write_report([*lamb, *runs[len(lamb) :]], tmp_path / "plain")
    assert plain["finetune"] == {} and "## Fine-tuning" not in (
        tmp_path / "plain" / "report.md").read_text()  # fmt: skip


def test_zero_one_adams_parity_config_keeps_the_deepspeed_recipes_shares():
    """configs/pretrain/parity_zero_one_adam.yaml: DeepSpeed's 0/1 Adam BERT recipe with
    each step count at its share of the run, on the parity regime otherwise."""
    from onebit_bert.config import load_config
    from onebit_bert.recipes import identify
    from pretrain.config import PretrainConfig

    pretrain = REPO / "configs/pretrain"
    cfg = load_config(PretrainConfig, pretrain / "parity_zero_one_adam.yaml", [])
    ref = load_config(PretrainConfig, pretrain / "parity.yaml", [])
    ds = load_config(PretrainConfig, pretrain / "bert_large_seq128_4k_zero_one_adam.yaml", [])
    steps, ds_steps = cfg.schedule.max_steps, ds.schedule.max_steps
    # DeepSpeed freezes the variance at the end of its lr warmup; so does this config
    assert ds.optimizer.var_freeze_step == round(ds.schedule.warmup_proportion * ds_steps)
    assert cfg.optimizer.var_freeze_step == round(cfg.schedule.warmup_proportion * steps)
    share = ds.optimizer.local_step_scaler / ds_steps
    assert abs(cfg.optimizer.local_step_scaler - share * steps) <= 0.5
    for field in ("var_update_scaler", "local_step_clipper"):
        assert getattr(cfg.optimizer, field) == getattr(ds.optimizer, field)
    assert cfg.comm.compression.momentum == ds.comm.compression.momentum == "onebit_tensor"
    assert identify(dataclasses.asdict(cfg)) == "zero_one_adam"
    assert identify(dataclasses.asdict(ds)) == "zero_one_adam"
    # everything else is the parity regime
    assert (cfg.model, cfg.batch, cfg.schedule, cfg.data) == (ref.model, ref.batch, ref.schedule,
                                                             ref.data)  # fmt: skip
    assert (cfg.optimizer.lr, cfg.optimizer.betas) == (ref.optimizer.lr, ref.optimizer.betas)


def test_the_paired_report_checks_pairing_and_the_preregistration(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 1.1, 0.35, 0.85])  # each twin +0.1 step
    target = fix_target(lamb, 0.8)
    stamp = "2026-12-01T00:00:00Z"  # after the synthetic runs started (September)
    report = write_report([*lamb, *onebit], tmp_path / "r", target, min_seeds=5,
                          test="paired", preregistered=stamp)  # fmt: skip
    gate = report["gate"]
    result = gate["gates"]["onebit"]
    assert gate["test"] == "paired" and result["test"].startswith("one-sided paired t-test")
    assert result["seeds"] == [1, 2, 3, 4, 5] and result["planned_pairs"] == 5
    assert result["verdict"] == "pass"
    assert gate["welch"]["onebit"]["verdict"] in ("pass", "undecided")
    assert gate["olympic_ratio"]["onebit"] == pytest.approx(1.0, abs=0.02)
    assert gate["preregistered_before"] == "**after** onebit seed 1, onebit seed 2, " \
        "onebit seed 3, onebit seed 4, onebit seed 5 had started"  # fmt: skip
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert f"pre-registered {stamp} (**after**" in markdown
    assert "| onebit | pass |" in markdown.replace("**", "")  # Welch's secondary line
    early = write_report([*lamb, *onebit], tmp_path / "r2", target, test="paired",
                         preregistered="2026-09-01T00:00:00Z")["gate"]  # fmt: skip
    assert early["preregistered_before"] == "before any of the other arms' 5 runs started"
    # a candidate whose seed-3 run used another batch is not its twin: no verdict
    config = tmp_path / "onebit3" / "config.yaml"
    config.write_text(config.read_text().replace("global_batch_size: 100", "global_batch_size: 99"))
    mismatched = write_report([*lamb, *onebit], tmp_path / "r3", target, test="paired",
                              preregistered=stamp)["gate"]["gates"]["onebit"]  # fmt: skip
    assert mismatched["verdict"] == "no verdict"
    assert "seed 3 differs in batch" in mismatched["reason"]
    # a seed in one arm only
    missing = write_report([*lamb, *onebit[:4]], tmp_path / "r4", target, test="paired",
                           preregistered=stamp)["gate"]["gates"]["onebit"]  # fmt: skip
    assert "not seed-matched" in missing["reason"] and "[1, 2, 3, 4, 5]" in missing["reason"]


def test_an_arm_added_later_is_checked_against_its_own_time(tmp_path):
    lamb, onebit = _arms(tmp_path, [0.1, 0.6, 1.1, 0.35, 0.85])
    late = [
        f"late={_pretrain(tmp_path / f'late{s}', 'onebit_lamb', s, d)}"
        for s, d in zip(range(1, 6), [0.1, 0.6, 1.1, 0.35, 0.85], strict=True)
    ]
    target = fix_target(lamb, 0.8)
    test, added = "2026-09-01T00:00:00Z", "2026-12-01T00:00:00Z"  # runs start in September
    report = write_report([*lamb, *onebit, *late], tmp_path / "r", target, min_seeds=5,
                          test="paired", preregistered=test,
                          arms_fixed={"late": added})  # fmt: skip
    gate = report["gate"]
    assert gate["preregistered_before"] == "before any of the other arms' 10 runs started"
    assert gate["arms_fixed"] == {
        "late": {
            "at": added,
            "before": "**after** late seed 1, late seed 2, late seed 3, "
            "late seed 4, late seed 5 had started",
        }  # fmt: skip
    }
    markdown = (tmp_path / "r" / "report.md").read_text()
    assert f"Arm late added under this test at {added} (**after** late seed 1" in markdown
    with pytest.raises(ValueError, match="no such candidate arm"):
        write_report([*lamb, *onebit], tmp_path / "r2", target, test="paired",
                     preregistered=test, arms_fixed={"lamb": added})  # fmt: skip
    from pipeline.reports.parity import main

    args = [a for spec in [*lamb, *onebit] for a in ("--run", spec)]
    assert main([*args, "--out", str(tmp_path / "r3"), "--target", str(_write_target(
        tmp_path, target)), "--test", "paired", "--preregistered", test,
        "--arm-fixed", "onebit=2026-09-02T00:00:00Z"]) == 0  # fmt: skip
    written = json.loads((tmp_path / "r3" / "report.json").read_text())["gate"]
    assert written["arms_fixed"]["onebit"]["at"] == "2026-09-02T00:00:00Z"
    assert main([*args, "--out", str(tmp_path / "r4"), "--arm-fixed", "onebit=soon"]) != 0


def _write_target(tmp_path: Path, target: dict) -> Path:
    path = tmp_path / "target.json"
    path.write_text(json.dumps(target))
    return path


def test_the_authors_regime_scales_their_recipe_onto_the_stretched_regime(tmp_path):
    exp = load_experiment(REPO / "configs/experiments/parity_authors.yaml", [f"workdir={tmp_path}"])
    arms = {s.name: s.stage_config() for s in exp.resolve(write=False) if s.kind == "pretrain"}
    stretched = load_experiment(
        REPO / "configs/experiments/parity_long.yaml", [f"workdir={tmp_path / 'long'}"]
    )
    long = {s.name: s.stage_config() for s in stretched.resolve(write=False)}
    reference = long["pretrain/lamb-seed1/phase1"]
    # DeepSpeedExamples bing_bert, 1-bit LAMB at 64K: 7,500 steps, EE, warmup 450,
    # x0.90 every 250, freeze 1,000, beta2 0.999
    for cfg in arms.values():
        steps = cfg.schedule.max_steps
        assert (cfg.model, cfg.batch, cfg.optimizer.lr, steps) == (
            reference.model, reference.batch, reference.optimizer.lr, 6000
        )  # fmt: skip
        assert cfg.schedule.name == "ee" and cfg.schedule.decay_rate == 0.9
        assert cfg.schedule.warmup_proportion == pytest.approx(450 / 7500)
        assert cfg.schedule.decay_step / steps == pytest.approx(250 / 7500)
        assert cfg.optimizer.freeze_step / steps == pytest.approx(1000 / 7500, abs=1e-3)
        assert cfg.optimizer.freeze_step > cfg.schedule.warmup_proportion * steps
        assert 1 / (1 - cfg.optimizer.betas[1]) == pytest.approx(cfg.optimizer.freeze_step)
        fill = 1 - cfg.optimizer.betas[1] ** cfg.optimizer.freeze_step
        assert fill == pytest.approx(1 - 0.999**1000, abs=1e-3)
        assert (cfg.optimizer.coeff_beta, cfg.optimizer.factor_min, cfg.optimizer.factor_max,
                cfg.optimizer.factor_threshold, cfg.optimizer.max_coeff,
                cfg.optimizer.min_coeff) == (0.9, 0.5, 4.0, 0.1, 0.3, 0.01)  # fmt: skip
        assert cfg.optimizer.bias_correction is False
    # the lr at the freeze: 0.79 of the peak, as in the authors' run
    from pretrain.schedule import lr_multiplier

    cfg = arms["pretrain/onebit_lamb-seed1/phase1"]
    assert lr_multiplier(cfg.schedule, cfg.optimizer.freeze_step) == pytest.approx(
        0.9 ** ((1000 - 450) / 250), abs=0.01
    )
    assert exp.cfg.report.test == "paired" and exp.cfg.report.preregistered
    assert exp.cfg.report.min_seeds == len(exp.cfg.seeds) == 5
    report_stage = exp.stage("report")
    assert report_stage.args[report_stage.args.index("--test") + 1] == "paired"
    assert "--preregistered" in report_stage.args
    fixed = report_stage.args[report_stage.args.index("--arm-fixed") + 1]
    assert fixed == "onebit_lamb_refresh=2026-11-28T22:07:00Z"


@pytest.mark.parametrize(
    "override, message",
    [
        ("report.preregistered=null", "needs report.preregistered"),
        ("report.preregistered=yesterday", "UTC"),
        ("report.preregistered=2026-11-28", "string"),
        ("report.arms_fixed={onebit_lamb_refresh: tomorrow}", "arms_fixed.onebit_lamb_refresh"),
        ("report.arms_fixed={lamb: '2026-11-28T22:07:00Z'}", "not a candidate run"),
    ],
)
def test_a_paired_gate_must_say_when_it_was_fixed(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        load_experiment(
            REPO / "configs/experiments/parity_authors.yaml", [f"workdir={tmp_path}", override]
        )


def test_the_larger_batch_pair_keeps_the_authors_shares_and_the_samples(tmp_path):
    def pretrain_configs(name: str) -> dict:
        exp = load_experiment(REPO / "configs/experiments" / name, [f"workdir={tmp_path}"])
        return {s.name: s.stage_config() for s in exp.resolve(write=False) if s.kind == "pretrain"}

    base = pretrain_configs("parity_authors.yaml")["pretrain/lamb-seed1/phase1"]
    arms = pretrain_configs("parity_mechanism.yaml")
    for name in ("lamb_b512", "onebit_lamb_b512"):
        big = arms[f"pretrain/{name}-seed1/phase1"]
        ratio = big.batch.global_batch_size // base.batch.global_batch_size
        assert ratio == 4
        assert big.schedule.max_steps * ratio == base.schedule.max_steps  # same samples
        assert big.optimizer.lr == pytest.approx(base.optimizer.lr * ratio**0.5)
        for field in ("name", "warmup_proportion", "decay_rate"):
            assert getattr(big.schedule, field) == getattr(base.schedule, field)
        assert big.schedule.decay_step * ratio == base.schedule.decay_step
        assert big.optimizer.freeze_step * ratio == base.optimizer.freeze_step
        assert 1 / (1 - big.optimizer.betas[1]) == pytest.approx(big.optimizer.freeze_step)
        assert big.model == base.model and big.data.path == base.data.path
