"""Faults that must stop a run or be refused, not pass silently: divergence, corrupt and
foreign checkpoints, code inside a checkpoint, a loss scale stuck at its floor, and
fine-tuning a model with non-finite weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onebit_bert.checkpoint import CheckpointManager, NoUsableCheckpoint
from onebit_bert.config import from_dict
from onebit_bert.distributed import Communicator
from onebit_bert.metrics_log import read_metrics
from onebit_bert.shards import ShardFormatError
from pretrain.config import PretrainConfig
from pretrain.train import TrainingDiverged, train
from tests.helpers.runs import REPO, dist_context, tiny_config, write_cfg


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def _run(cfg: dict) -> dict:
    torch.set_num_threads(1)
    return train(from_dict(PretrainConfig, cfg), dist_context(Communicator(None)))


def _checkpoint_models(run_dir: Path) -> dict[str, dict]:
    return {
        p.name: torch.load(p / "shared.pt", weights_only=True)["model"]
        for p in sorted((run_dir / "checkpoints").glob("step_*"))
    }


def test_a_diverging_run_stops_nonzero_and_keeps_only_finite_checkpoints(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        run_dir,
        # the spike check off: this is the non-finite path (test_faults has the finite one)
        **{
            "optimizer.lr": 1e6,
            "schedule.max_steps": 20,
            "checkpoint.every": 2,
            "divergence.loss_spike_factor": 0,
        },
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", str(write_cfg(cfg, tmp_path / "c.yaml"))],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "training diverged at step" in proc.stderr and "bad steps in a row" in proc.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "diverged" and status["step"] < 20
    assert not (run_dir / "final").exists()  # nothing exported
    models = _checkpoint_models(run_dir)
    for name, model in models.items():
        assert all(torch.isfinite(t).all() for t in model.values()), name
    if status["last_checkpoint"] is not None:
        assert f"step_{status['last_checkpoint']:08d}" in models


def test_an_overflow_at_the_smallest_loss_scale_stops_the_run(tiny_corpus, tmp_path, monkeypatch):
    from onebit_bert.precision import LossScaler

    # fp16 is GPU-only here: emulate a scaler whose every step overflows at scale 1
    monkeypatch.setattr(LossScaler, "unscale_and_check", lambda self, params: False)
    monkeypatch.setattr(LossScaler, "update", lambda self, ok: None)
    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 10})
    with pytest.raises(TrainingDiverged, match="fp16 overflow at loss scale 1"):
        _run(cfg)
    assert _steps(tmp_path / "run") == [1, 2, 3]


def _corrupt(path: Path, offset_fraction: float = 0.5, length: int = 16) -> None:
    data = bytearray(path.read_bytes())
    at = int(len(data) * offset_fraction)
    data[at : at + length] = bytes((b + 1) % 256 for b in data[at : at + length])
    path.write_bytes(bytes(data))


def test_a_corrupted_checkpoint_is_skipped_by_its_checksum(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    base = {"schedule.max_steps": 8, "checkpoint.every": 4, "checkpoint.keep_last": 3}
    _run(tiny_config(tiny_corpus, run_dir, **base))
    _corrupt(run_dir / "checkpoints" / "step_00000008" / "shared.pt")  # same size
    with pytest.warns(UserWarning, match=r"step_00000008.*sha256"):
        longer = {**base, "schedule.max_steps": 12, "resume.allow_changes": ["schedule.max_steps"]}
        summary = _run(tiny_config(tiny_corpus, run_dir, **longer))
    assert summary["state"] == "complete"
    assert _steps(run_dir)[-8:] == [5, 6, 7, 8, 9, 10, 11, 12]  # resumed at step 4


def test_no_usable_checkpoint_stops_unless_a_restart_is_allowed(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    base = {"schedule.max_steps": 8, "checkpoint.every": 4}
    _run(tiny_config(tiny_corpus, run_dir, **base))
    for shared in (run_dir / "checkpoints").glob("step_*/shared.pt"):
        shared.write_bytes(os.urandom(shared.stat().st_size))
    with pytest.raises(NoUsableCheckpoint, match="step_00000004, step_00000008"):
        _run(tiny_config(tiny_corpus, run_dir, **base))
    status = json.loads((run_dir / "status.json").read_text())  # not the last launch's word
    assert status["state"] == "failed" and "NoUsableCheckpoint" in status["error"], status
    assert "step_00000004, step_00000008" in status["error"]
    with pytest.warns(UserWarning):
        restart = {**base, "schedule.max_steps": 4, "checkpoint.allow_restart": True}
        _run(tiny_config(tiny_corpus, run_dir, **restart))
    # the restart's step-4 checkpoint replaced the corrupt one, and the later corrupt one
    # (an abandoned timeline) was removed instead of the new one
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000004"]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "complete" and status["last_checkpoint"] == 4


class _Payload:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_cannot_run_code_when_loaded(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", Communicator(None))
    marker = tmp_path / "ran"
    manager.save(1, {"model": {"w": torch.ones(2)}, "payload": _Payload(marker)}, {})
    with pytest.warns(UserWarning, match="unusable"), pytest.raises(NoUsableCheckpoint):
        manager.load_latest()
    assert not marker.exists()


def test_resuming_with_another_optimizer_is_refused(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    _run(tiny_config(tiny_corpus, run_dir, **{"schedule.max_steps": 4}))
    other = {"schedule.max_steps": 8, "optimizer.name": "adamw"}
    with pytest.raises(ValueError, match="optimizer.name: 'lamb' -> 'adamw'"):
        _run(tiny_config(tiny_corpus, run_dir, **other))
    # allowed as a config change, the checkpoint's own state still cannot be read by AdamW
    allowed = {**other, "resume.allow_changes": ["optimizer", "schedule.max_steps"]}
    with pytest.raises(ValueError, match="written by strategy data_parallel with optimizer Lamb"):
        _run(tiny_config(tiny_corpus, run_dir, **allowed))


def test_fine_tuning_refuses_non_finite_weights(tmp_path):
    from transformers import BertConfig, BertForPreTraining

    from finetune.run import check_checkpoint
    from tests.helpers.corpus import write_vocab

    model = BertForPreTraining(
        BertConfig(
            vocab_size=120,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[3, 0] = float("nan")
    model.save_pretrained(tmp_path / "model")
    write_vocab(tmp_path / "model" / "vocab.txt")
    with pytest.raises(ValueError, match="non-finite weights"):
        check_checkpoint(str(tmp_path / "model"))


def test_zeroed_shard_data_stops_the_run(tiny_corpus, tmp_path):
    import shutil

    import numpy as np

    data = tmp_path / "data"
    shutil.copytree(tiny_corpus.parent, data)
    for shard in (data / tiny_corpus.name).glob("train-*.npy"):
        rows = np.load(shard)
        np.save(shard, np.zeros_like(rows))  # same size: opening cannot tell
    cfg = tiny_config(data / tiny_corpus.name, tmp_path / "run", **{"schedule.max_steps": 10})
    with pytest.raises(ShardFormatError, match="does not match the sha256"):
        _run(cfg)  # refused before training
    cfg["data"]["verify_shards"] = False  # then the zeros train, and their loss is caught
    with pytest.raises(TrainingDiverged, match="non-finite loss"):
        _run(cfg)
    assert not (tmp_path / "run" / "final").exists()
