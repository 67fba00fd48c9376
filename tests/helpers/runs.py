"""Tiny pretraining runs: the config, in-process ranks (:func:`train_in_process`, also node
by node), torchrun launches that can be killed at once, the logged MLM losses, config
files and the repository root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from onebit_bert.config import from_dict, save_config
from onebit_bert.distributed.env import DistContext, LaunchEnv
from onebit_bert.metrics_log import read_metrics
from pretrain.config import PretrainConfig
from pretrain.train import train
from tests.helpers.paths import REPO

SMOKE_JOBS = (
    "data",
    "pretrain/lamb/phase1",
    "finetune/lamb",
    "pretrain/onebit/phase1",
    "finetune/onebit",
    "report",
)
"""The smoke experiment's stages that run as jobs, in chain order (``inputs`` runs first,
on the submitting host)."""


def tiny_config(corpus: Path, run_dir: Path, **overrides) -> dict:
    cfg = {
        "run_dir": str(run_dir),
        "model": {"preset": "bert-tiny", "max_position_embeddings": 64},
        "data": {"path": str(corpus), "validation_batches": 2},
        "batch": {"global_batch_size": 32, "micro_batch_size": 8},
        "optimizer": {
            "name": "lamb",
            "lr": 0.02,
            "freeze_step": 4,
            "eps": 1e-6,
            "weight_decay": 0.01,
            "max_coeff": 0.3,
        },
        "schedule": {"name": "poly", "max_steps": 12, "warmup_proportion": 0.2},
        "checkpoint": {"every": 4, "keep_last": 2},
        "logging": {"wandb": False, "progress_every": 1000},
        "seed": 7,
    }
    for key, value in overrides.items():
        *sections, field = key.split(".")
        target = cfg
        for section in sections:
            target = target.setdefault(section, {})
        target[field] = value
    return cfg


def dist_context(comm) -> DistContext:
    launch = LaunchEnv(comm.rank, comm.world_size, comm.rank, "127.0.0.1", 0, "test")
    return DistContext(launch, "gloo" if comm.world_size > 1 else None, comm.device, comm)


def train_in_process(comm, cfg: dict) -> dict:
    torch.set_num_threads(1)
    summary = train(from_dict(PretrainConfig, cfg), dist_context(comm))
    model = torch.load(
        Path(cfg["run_dir"])
        / "checkpoints"
        / sorted(os.listdir(Path(cfg["run_dir"]) / "checkpoints"))[-1]
        / "shared.pt",
        map_location="cpu",
        weights_only=False,
    )["model"]
    return {"summary": summary, "model": model}


def train_on_nodes(comm, cfg: dict, ranks_per_node: int) -> dict:
    """train_in_process with the launch of ``ranks_per_node`` ranks per node (node by node)."""
    torch.set_num_threads(1)
    launch = LaunchEnv(
        comm.rank,
        comm.world_size,
        comm.rank % ranks_per_node,
        "127.0.0.1",
        0,
        "test",
        ranks_per_node,
    )
    ctx = DistContext(launch, "gloo", comm.device, comm)
    return train(from_dict(PretrainConfig, cfg), ctx)


def mlm_losses(run_dir: Path) -> list[float]:
    return [r["mlm_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "mlm_loss" in r]


def torchrun(cfg_path: Path, nproc: int = 2, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "pretrain",
            "--config",
            str(cfg_path),
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )


def torchrun_workers(proc: subprocess.Popen) -> list[int]:
    """torchrun's worker processes (each in a session of its own)."""
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def kill_all(proc: subprocess.Popen) -> None:
    for pid in [*torchrun_workers(proc), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def write_cfg(cfg: dict, path: Path) -> Path:
    save_config(from_dict(PretrainConfig, cfg), path)
    return path


def torchrun_to_end(cfg_path, nproc: int = 2, timeout_s: float = 300) -> str:
    """Launch the run and wait for it to finish; its output, or a failure that shows it
    unless it exits 0."""
    proc = torchrun(cfg_path, nproc)
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return out


def launch_and_kill_at(cfg_path, run_dir, step: int, timeout_s: float = 240) -> None:
    """Launch the run and SIGKILL every process as soon as the checkpoint of ``step``
    exists (no chance to save anything more); fails if it never appears."""
    proc = torchrun(cfg_path)
    step_dir = run_dir / "checkpoints" / f"step_{step:08d}"
    deadline = time.time() + timeout_s
    try:
        while not step_dir.is_dir() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        kill_all(proc)
    assert step_dir.is_dir(), f"the run never reached step {step}"


def run_killing_after_checkpoints(cfg_path, run_dir, steps, max_steps):
    """Launch the run; SIGKILL every process as soon as the checkpoint of ``steps[0]``
    exists, launch again (it resumes) and kill after ``steps[1]``, ...; then let the last
    launch finish."""
    for step in steps:
        launch_and_kill_at(cfg_path, run_dir, step)
        logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
        assert max(logged) < max_steps, "the run was not cut short"
    torchrun_to_end(cfg_path)
