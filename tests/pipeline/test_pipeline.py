"""The pipeline CLI without a cluster: resolving experiments, selecting and skipping
stages, and the rendered SLURM scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_bert.config import ConfigError
from pipeline.__main__ import main
from pipeline.experiment import load_experiment
from pipeline.slurm import SlurmChain, render
from tests.helpers.paths import REPO
from tests.helpers.runs import SMOKE_JOBS

SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"


def smoke(tmp_path: Path, *overrides: str):
    exp = load_experiment(SMOKE, [f"workdir={tmp_path / 'work'}", *overrides])
    exp.resolve()
    return exp


def test_stages_are_resolved_in_chain_order(tmp_path):
    exp = smoke(tmp_path)
    assert [s.name for s in exp.stages] == ["inputs", *SMOKE_JOBS]
    configs = tmp_path / "work" / "configs"
    assert sorted(p.name for p in configs.iterdir()) == [
        "data.yaml",
        "finetune_lamb.yaml",
        "finetune_onebit.yaml",
        "pretrain_lamb_phase1.yaml",
        "pretrain_onebit_phase1.yaml",
    ]
    import yaml

    onebit = yaml.safe_load((configs / "pretrain_onebit_phase1.yaml").read_text())
    assert onebit["optimizer"]["name"] == "onebit_lamb"
    assert onebit["data"]["path"] == str(tmp_path / "work" / "data" / "seq128")
    assert onebit["run_dir"] == str(tmp_path / "work" / "pretrain" / "onebit" / "phase1")
    finetune = yaml.safe_load((configs / "finetune_onebit.yaml").read_text())
    assert finetune["checkpoint"] == onebit["run_dir"] + "/final"
    assert finetune["data_root"] == str(tmp_path / "work" / "inputs")
    assert (tmp_path / "work" / "experiment.yaml").is_file()
    assert exp.stage("report").args == [
        "--run",
        f"lamb={tmp_path}/work/pretrain/lamb/phase1:{tmp_path}/work/finetune/lamb",
        "--run",
        f"onebit={tmp_path}/work/pretrain/onebit/phase1:{tmp_path}/work/finetune/onebit",
    ]


def test_phase_two_starts_from_phase_one(tmp_path):
    phase = {"config": "configs/pretrain/smoke.yaml", "seq_length": 128}
    runs = json.dumps([{"name": "lamb", "phases": [phase, phase]}])
    exp = smoke(tmp_path, f"runs={runs}")
    second = exp.stage("pretrain/lamb/phase2")
    assert second.depends == ["pretrain/lamb/phase1"]
    import yaml

    cfg = yaml.safe_load(second.config_path.read_text())
    assert cfg["model"]["init_from"] == str(exp.stage("pretrain/lamb/phase1").output)


def test_pretraining_seeds_make_one_instance_per_run_and_seed(tmp_path):
    exp = smoke(tmp_path, "seeds=[1, 2]")
    assert [s.name for s in exp.stages if s.kind in ("pretrain", "finetune")] == [
        "pretrain/lamb-seed1/phase1",
        "finetune/lamb-seed1",
        "pretrain/lamb-seed2/phase1",
        "finetune/lamb-seed2",
        "pretrain/onebit-seed1/phase1",
        "finetune/onebit-seed1",
        "pretrain/onebit-seed2/phase1",
        "finetune/onebit-seed2",
    ]
    import yaml

    second = yaml.safe_load(exp.stage("pretrain/onebit-seed2/phase1").config_path.read_text())
    assert second["seed"] == 2 and second["optimizer"]["name"] == "onebit_lamb"
    assert second["run_dir"] == str(tmp_path / "work" / "pretrain" / "onebit-seed2" / "phase1")
    assert second["logging"]["run_name"] == "onebit-seed2-phase1"
    # fine-tuning logs in its pretraining run's wandb group, named after the instance
    tuned = yaml.safe_load(exp.stage("finetune/onebit-seed2").config_path.read_text())
    assert tuned["logging"]["experiment"] == second["logging"]["experiment"]
    assert tuned["logging"]["run_name"] == "onebit-seed2"
    assert tuned["logging"]["job_type"] == "finetune"
    # the report groups instances by run name: a repeated name is another pretraining seed
    names = [a.partition("=")[0] for a in exp.stage("report").args if a != "--run"]
    assert names == ["lamb", "lamb", "onebit", "onebit"]
    with pytest.raises(ValueError, match="seeds must be distinct"):
        smoke(tmp_path, "seeds=[1, 1]")


def test_a_run_may_have_seeds_of_its_own(tmp_path):
    import yaml

    raw = yaml.safe_load(SMOKE.read_text())
    raw["runs"][1]["seeds"] = [5]
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = load_experiment(path, [f"workdir={tmp_path / 'work'}", "seeds=[1, 2]"])
    exp.resolve()
    assert [s.name for s in exp.stages if s.kind == "pretrain"] == [
        "pretrain/lamb-seed1/phase1",
        "pretrain/lamb-seed2/phase1",
        "pretrain/onebit-seed5/phase1",
    ]


def test_stage_selection(tmp_path):
    exp = smoke(tmp_path)
    assert [s.name for s in exp.select(["pretrain"])] == [
        "pretrain/lamb/phase1",
        "pretrain/onebit/phase1",
    ]
    assert [s.name for s in exp.select(["finetune/onebit", "data"])] == ["data", "finetune/onebit"]
    with pytest.raises(ValueError, match="unknown stage"):
        exp.select(["pretrain/adam"])


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (["runs=[]"], ValueError, "unique names"),
        (
            ["runs=[{name: a, phases: [{config: configs/pretrain/smoke.yaml, seq_length: 512}]}]"],
            ValueError,
            "does not prepare",
        ),
        (["data.overrides=[instances.mode=mlm]"], ConfigError, "must be one of"),
        (["finetune.overrides=['tasks=[sst3]']"], ConfigError, "unknown task"),
        (["runs=[{name: 'a b', phases: [{seq_length: 128}]}]"], ValueError, "run name"),
    ],
)
def test_bad_experiments_fail_before_anything_runs(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        smoke(tmp_path, *overrides)
    assert not (tmp_path / "work" / "data").exists()


def test_run_skips_completed_stages(tmp_path, capsys):
    args = ["run", "--config", str(SMOKE), f"workdir={tmp_path / 'work'}", "--stages", "inputs"]
    assert main(args) == 0
    assert (tmp_path / "work" / "inputs" / "corpus.jsonl").is_file()
    assert main(args) == 0
    assert "inputs: complete, skipped" in capsys.readouterr().out


def test_an_invocation_saves_only_the_configs_of_the_stages_it_launches(tmp_path, capsys):
    """Two invocations on one workdir, each running other stages with other overrides (a
    sweep beside a fine-tuning chain), must not rewrite each other's stage configs: the
    later one's resolve once turned the earlier one's data_root back to null."""
    import yaml

    work = tmp_path / "work"
    configs = work / "configs"
    base = ["--config", str(SMOKE), f"workdir={work}"]
    assert main(["run", *base, "--stages", "inputs"]) == 0
    assert (work / "experiment.yaml").is_file() and not configs.exists()

    first = ["submit", *base, "finetune.overrides=[data_root=/first]", "--dry-run"]
    assert main([*first, "--stages", "finetune/lamb"]) == 0
    assert sorted(p.name for p in configs.iterdir()) == ["finetune_lamb.yaml"]
    second = ["submit", *base, "finetune.overrides=[data_root=/second]", "--dry-run"]
    assert main([*second, "--stages", "pretrain/onebit", "finetune/onebit"]) == 0
    saved = {p.name: yaml.safe_load(p.read_text()) for p in configs.iterdir()}
    assert sorted(saved) == [
        "finetune_lamb.yaml",
        "finetune_onebit.yaml",
        "pretrain_onebit_phase1.yaml",
    ]
    assert saved["finetune_lamb.yaml"]["data_root"] == "/first"
    assert saved["finetune_onebit.yaml"]["data_root"] == "/second"


def test_status_lists_every_stage(tmp_path, capsys):
    assert main(["status", "--config", str(SMOKE), f"workdir={tmp_path / 'work'}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7 and all(line.split()[-1] == "pending" for line in lines)


def test_bad_config_is_one_clear_error(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sbatch_scripts_are_rendered_and_chained(tmp_path, capsys):
    exp = smoke(tmp_path)
    chain = SlurmChain(exp)
    stages = [s for s in exp.stages if s.kind != "inputs"]
    jobs = chain.submit(stages, dry_run=True)
    printed = capsys.readouterr().out.splitlines()
    assert list(jobs) == [s.name for s in stages]
    assert "--dependency" not in printed[0]  # data waits for nothing
    assert "--dependency=afterok:-1" in printed[1]  # phase 1 after data
    assert "--dependency=afterok:-3:-5" in printed[-1]  # the report after both arrays
    scripts = {p.name: p.read_text() for p in (tmp_path / "work" / "slurm").glob("*.sbatch")}
    pretrain = scripts["pretrain_onebit_phase1.sbatch"]
    for expected in (
        "#SBATCH --nodes=2",
        "#SBATCH --signal=B:USR1@60",
        "checkpoint.preemption_lead_s=60",  # the run checks its save time against the lead
        "#SBATCH --requeue",
        "--nproc-per-node=2",
        "scontrol requeue",
        "SIGUSR1",
        "export GLOO_SOCKET_IFNAME=lo",
    ):
        assert expected in pretrain
    finetune = scripts["finetune_lamb.sbatch"]
    # one array task per (task, fine-tuning seed): 4 tasks x 1 seed in the smoke config
    assert "#SBATCH --array=0-3" in finetune and "TASKS=(sst2 mrpc stsb squad)" in finetune
    assert "finetune run --config" in scripts["report.sbatch"]
    for name, text in scripts.items():
        assert "{{" not in text, name
        check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert check.returncode == 0, (name, check.stderr)


def test_template_placeholders_must_be_filled():
    assert render("a {{x}} ${Y}", {"x": 1}) == "a 1 ${Y}"
    with pytest.raises(KeyError, match="placeholder"):
        render("{{missing}}", {})


def test_cli_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "submit" in out.stdout


def test_batches_that_do_not_divide_are_refused_before_submission(tmp_path, capsys):
    args = [
        "submit",
        "--config",
        str(SMOKE),
        f"workdir={tmp_path / 'work'}",
        "--dry-run",
        "slurm.nodes=3",
    ]
    assert main(args) == 2
    assert "not a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "experiments").glob("*.yaml")))
def test_shipped_experiments_resolve(path, tmp_path):
    exp = load_experiment(path, [f"workdir={tmp_path / 'work'}"])
    stages = exp.resolve()
    assert stages[-1].kind == "report"
    exp.check_world_size(exp.cfg.local.nproc_per_node, stages)


def test_local_stage_threads_share_the_cores():
    from pipeline.__main__ import stage_threads

    assert stage_threads("pretrain", 4, cores=2) == 1
    assert stage_threads("pretrain", 2, cores=16) == 8
    assert stage_threads("finetune", 4, cores=2) == 2
    assert stage_threads("data", 1, cores=16) == 16


def test_an_offline_chain_exports_the_hubs_switches_and_the_submitters_cache(tmp_path, monkeypatch):
    from pipeline.slurm import job_environment

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf cache"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    exp = smoke(tmp_path, "slurm.offline=true")
    assert exp.cfg.slurm.offline
    env = job_environment(exp.cfg.slurm)
    assert env["HF_HUB_OFFLINE"] == env["HF_DATASETS_OFFLINE"] == "1"
    assert env["HF_HOME"] == str(tmp_path / "hf cache") and "HF_DATASETS_CACHE" not in env
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # slurm.env still there
    SlurmChain(exp).submit([s for s in exp.stages if s.kind != "inputs"], dry_run=True)
    for script in (tmp_path / "work" / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert "export HF_HUB_OFFLINE=1" in text and "export HF_DATASETS_OFFLINE=1" in text
        assert f"export HF_HOME='{tmp_path / 'hf cache'}'" in text
    # online (the default): none of it
    assert "HF_HUB_OFFLINE" not in job_environment(smoke(tmp_path / "b").cfg.slurm)
