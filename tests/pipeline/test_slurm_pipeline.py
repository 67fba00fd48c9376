"""The smoke chain as real SLURM jobs on a local 2-node cluster, and preemption →
checkpoint → requeue → completion. Skipped (with the reason) where SLURM cannot run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from onebit_bert.config import load_config, save_config
from onebit_bert.metrics_log import read_metrics
from pipeline.experiment import Stage, load_experiment
from pipeline.slurm import SlurmChain
from pretrain.config import PretrainConfig
from tests.helpers.paths import REPO
from tests.helpers.runs import SMOKE_JOBS
from tests.helpers.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401

SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"

# A smaller smoke: fewer steps (1-bit LAMB compresses after step 10), two tasks, one epoch.
PRETRAIN = [
    "schedule.max_steps=20",
    "optimizer.freeze_step=10",
    "checkpoint.every=10",
    "data.validation_every=10",
    "logging.wandb=false",
]
# two fine-tuning seeds (the smoke config has one): the array runs one job per (task, seed)
FINETUNE = [
    "tasks=[sst2, squad]",
    "seeds=[1, 2]",
    "max_train_samples=64",
    "max_eval_samples=32",
    "epochs=[1]",
    "logging.wandb=false",
]


def _phase(optimizer: str) -> dict:
    return {
        "config": "configs/pretrain/smoke.yaml",
        "seq_length": 128,
        "overrides": [f"optimizer.name={optimizer}", *PRETRAIN],
    }


@pytest.fixture(scope="module")
def chain(slurm_cluster: SlurmCluster, tmp_path_factory):
    """Submit the whole smoke chain (inputs made here, everything else as jobs); wait."""
    workdir = tmp_path_factory.mktemp("slurm_smoke") / "work"
    runs = json.dumps(
        [
            {"name": "lamb", "phases": [_phase("lamb")]},
            {"name": "onebit", "phases": [_phase("onebit_lamb")]},
        ]
    )
    finetune = json.dumps(["data_root={workdir}/inputs", *FINETUNE])
    exp = load_experiment(
        SMOKE, [f"workdir={workdir}", f"runs={runs}", f"finetune.overrides={finetune}"]
    )
    exp.resolve()
    env = {**os.environ, **slurm_cluster.env}
    submit = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "submit",
            "--config",
            str(SMOKE),
            f"workdir={workdir}",
            f"runs={runs}",
            f"finetune.overrides={finetune}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submit.returncode == 0, submit.stdout + submit.stderr
    jobs = json.loads((workdir / "slurm" / "jobs.json").read_text())
    state = slurm_cluster.wait(jobs["report"], timeout=1200)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((workdir / "logs").glob("*.out")))
    assert state == "COMPLETED", logs
    return exp, jobs


@pytest.mark.slow
def test_smoke_chain_runs_as_slurm_jobs(chain, slurm_cluster):
    exp, jobs = chain
    assert set(jobs) == set(SMOKE_JOBS)
    for name, job in jobs.items():
        assert slurm_cluster.state(job) == "COMPLETED", name
    for stage in exp.stages:
        assert stage.done(), stage.name
    for run in ("lamb", "onebit"):
        status = json.loads((exp.path("pretrain", run, "phase1", "status.json")).read_text())
        assert status["state"] == "complete" and status["world_size"] == 4  # 2 nodes x 2
        results = json.loads(exp.path("finetune", run, "results.json").read_text())
        assert set(results) == {"sst2", "squad"} and len(results["sst2"]["per_seed"]) == 2
    records = read_metrics(exp.path("pretrain", "onebit", "phase1", "metrics.jsonl"))
    assert {r["stage"] for r in records if "stage" in r} == {"warmup", "compression"}
    report = exp.path("report", "report.md").read_text()
    assert "| lamb | lamb |" in report and "| onebit | onebit_lamb |" in report
    # The fine-tuning array ran one job per (task, seed) pair.
    assert len(list(exp.path("logs").glob("*finetune-*_*.out"))) == 2 * 2 * 2


def _wait_for_steps(metrics: Path, steps: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and len([r for r in read_metrics(metrics) if "loss" in r]) >= steps:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{metrics} never reached {steps} steps")


@pytest.mark.slow
def test_preemption_checkpoints_requeues_and_finishes_like_an_uninterrupted_run(
    chain, slurm_cluster, tmp_path
):
    exp, _ = chain
    base = exp.stage("pretrain/lamb/phase1").config_path
    overrides = ["schedule.max_steps=30", "checkpoint.every=1000", "logging.progress_every=1000"]
    preempted = load_config(PretrainConfig, base, [*overrides, f"run_dir={tmp_path / 'slurm'}"])
    save_config(preempted, tmp_path / "slurm.yaml")
    stage = Stage(
        "pretrain/lamb/phase1", "pretrain", tmp_path / "slurm.yaml", tmp_path / "slurm", []
    )
    script = tmp_path / "pretrain.sbatch"
    script.write_text(SlurmChain(exp).script(stage))
    job = slurm_cluster.sbatch(script, cwd=tmp_path)
    _wait_for_steps(tmp_path / "slurm" / "metrics.jsonl", 8)
    slurm_cluster.scancel(job, "USR1")  # as --signal=B:USR1@lead does before the time limit
    slurm_cluster.wait(job, timeout=180, states=("PENDING", "FAILED", "COMPLETED"))
    status = json.loads((tmp_path / "slurm" / "status.json").read_text())
    assert status["state"] == "preempted" and 8 <= status["step"] < 30
    checkpoint = tmp_path / "slurm" / "checkpoints" / f"step_{status['step']:08d}"
    assert (checkpoint / "complete.json").is_file()
    slurm_cluster.release_requeued(job)
    assert slurm_cluster.wait(job, timeout=600) == "COMPLETED"
    assert slurm_cluster.job_info(job).get("Restarts") == "1"
    assert json.loads((tmp_path / "slurm" / "status.json").read_text())["state"] == "complete"

    # The same configuration without interruption, 4 processes on this machine.
    reference = load_config(PretrainConfig, base, [*overrides, f"run_dir={tmp_path / 'ref'}"])
    save_config(reference, tmp_path / "ref.yaml")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            "-m",
            "pretrain",
            "--config",
            str(tmp_path / "ref.yaml"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    final = {}
    for name in ("slurm", "ref"):
        last = sorted((tmp_path / name / "checkpoints").glob("step_*"))[-1]
        final[name] = torch.load(last / "shared.pt", weights_only=False)["model"]
        losses = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r]
        final[name + "_loss"] = losses[-1]
    assert final["slurm_loss"] == final["ref_loss"]
    for key, tensor in final["ref"].items():
        assert torch.equal(tensor, final["slurm"][key]), key
