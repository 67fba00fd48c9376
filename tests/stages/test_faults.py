"""Faults of a running job that must end it quickly and say why: a damaged shard on one
rank of two (every rank stops within seconds, status.json names the shard), a shard
changed after data_prep (refused before training by its sha256), a finite blow-up of
the loss (divergence, nothing saved after it, nothing exported), a 1-bit run that would
never compress, a full device while a checkpoint is written."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from onebit_bert.config import from_dict
from onebit_bert.distributed import Communicator
from onebit_bert.metrics_log import read_metrics
from onebit_bert.shards import ShardFormatError
from pretrain.config import PretrainConfig
from pretrain.data import BatchSchedule
from pretrain.train import TrainingDiverged, train
from tests.helpers.runs import dist_context, kill_all, tiny_config, torchrun, write_cfg


def _run(cfg: dict) -> dict:
    torch.set_num_threads(1)
    return train(from_dict(PretrainConfig, cfg), dist_context(Communicator(None)))


def _copy_corpus(tiny_corpus: Path, tmp_path: Path) -> Path:
    shutil.copytree(tiny_corpus.parent, tmp_path / "data")
    return tmp_path / "data" / tiny_corpus.name


def _train_shards(seq: Path) -> list[dict]:
    return json.loads((seq / "manifest.json").read_text())["splits"]["train"]["shards"]


def _row_of_rank(seq: Path, step: int, rank: int, cfg: dict) -> tuple[Path, int]:
    """A (shard, row) that ``rank`` of two reads at ``step`` (and the other rank does not)."""
    entries = _train_shards(seq)
    sizes = [e["sequences"] for e in entries]
    batch = cfg["batch"]
    accumulation = batch["global_batch_size"] // (batch["micro_batch_size"] * 2)
    schedule = BatchSchedule(
        sum(sizes),
        batch["global_batch_size"],
        batch["micro_batch_size"],
        accumulation,
        2,
        cfg["seed"],
    )
    row = int(schedule.micro_indices(step - 1, rank)[0][1][0])
    shard = int(np.searchsorted(np.cumsum(sizes), row, side="right"))
    return seq / entries[shard]["file"], row - sum(sizes[:shard])


def _wait(proc, limit: float) -> tuple[str, float]:
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=limit)
    except BaseException:
        kill_all(proc)
        raise
    return out, time.monotonic() - started


def test_a_damaged_row_on_one_rank_stops_every_rank_within_seconds(tiny_corpus, tmp_path):
    seq = _copy_corpus(tiny_corpus, tmp_path)
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        seq,
        run_dir,
        **{
            "optimizer.name": "onebit_lamb",
            "schedule.max_steps": 8,
            "data.verify_shards": False,  # the damage is found as its row is read
            "collective_timeout_s": 600.0,
        },
    )
    shard, row = _row_of_rank(seq, step=3, rank=1, cfg=cfg)
    rows = np.load(shard, mmap_mode="r+", allow_pickle=False)
    rows["input_ids"][row, 1] = 60000  # outside the vocabulary
    rows.flush()
    del rows
    proc = torchrun(write_cfg(cfg, tmp_path / "c.yaml"))
    out, _ = _wait(proc, 240)
    ended = time.time()
    assert proc.returncode != 0, out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and status["failed_rank"] == 1, status
    assert status["step"] == 3, status
    message = f"{shard.name} row {row} holds a token id"
    assert message in status["error"] and message in out
    # every rank (and torchrun) ended within seconds of the failure, not at the
    # collective timeout
    assert ended - status["finished"] < 60, out
    assert "pretrain/train.py" not in out, out  # one line per rank, no worker traceback


def _flip(path: Path, offset: int, length: int = 8) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + length] = bytes(b ^ 0xFF for b in data[offset : offset + length])
    path.write_bytes(bytes(data))


def test_a_damaged_shard_header_stops_both_ranks_before_training(tiny_corpus, tmp_path):
    seq = _copy_corpus(tiny_corpus, tmp_path)
    shard = seq / _train_shards(seq)[-1]["file"]
    _flip(shard, offset=20)  # the tester's damage: inside the .npy header
    run_dir = tmp_path / "run"
    cfg = tiny_config(seq, run_dir, **{"optimizer.name": "onebit_lamb"})
    proc = torchrun(write_cfg(cfg, tmp_path / "c.yaml"))
    out, _ = _wait(proc, 240)
    assert proc.returncode != 0, out
    assert out.count(f"error: {shard} does not match the sha256") == 2, out  # both ranks
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and str(shard) in status["error"]
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained


def test_a_changed_token_that_stays_in_the_vocabulary_is_refused_before_training(
    tiny_corpus, tmp_path
):
    seq = _copy_corpus(tiny_corpus, tmp_path)
    shard = seq / _train_shards(seq)[0]["file"]
    rows = np.load(shard, mmap_mode="r+", allow_pickle=False)
    rows["input_ids"][3, 2] = 6 if rows["input_ids"][3, 2] != 6 else 7  # another valid id
    rows.flush()
    del rows
    cfg = tiny_config(seq, tmp_path / "run")
    with pytest.raises(ShardFormatError, match=f"{shard} does not match the sha256"):
        _run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    _run({**cfg, "data": {**cfg["data"], "verify_shards": False}})  # trains: it is a valid id


def test_a_finite_blow_up_is_divergence(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        run_dir,
        **{
            "optimizer.lr": 1000.0,
            "schedule.name": "constant",
            "schedule.warmup_proportion": 0.0,
            "checkpoint.every": 1,
        },
    )
    with pytest.raises(TrainingDiverged, match=r"x the median .*\(divergence.loss_spike_factor\)"):
        _run(cfg)
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert all(math.isfinite(x) for x in losses) and max(losses) > 10 * min(losses), losses
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "diverged", status
    assert not (run_dir / "final").exists()  # nothing exported
    # step N's loss measures update N - 1: its checkpoint holds the blow-up, set aside
    spiked = len(losses)
    saved = [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*")]
    assert all(step < spiked - 1 for step in saved), (saved, spiked)
    assert (run_dir / "checkpoints" / f"diverged_step_{spiked - 1:08d}").is_dir()
    assert status["last_checkpoint"] == max(saved, default=None)


def test_a_compressing_run_that_never_compresses_is_refused(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "run",
        **{"optimizer.name": "onebit_lamb", "optimizer.freeze_step": 12},
    )
    with pytest.raises(ValueError, match="freeze_step 12 >= schedule.max_steps 12: this "):
        from_dict(PretrainConfig, cfg)
    cfg["optimizer"]["name"] = "onebit_adam"
    with pytest.raises(ValueError, match="onebit_adam run would never compress"):
        from_dict(PretrainConfig, cfg)
    cfg["model"]["init_optimizer"] = True  # a later phase: the step count continues
    assert from_dict(PretrainConfig, cfg).optimizer.freeze_step == 12
    del cfg["model"]["init_optimizer"]
    cfg["optimizer"]["freeze_step"] = 11
    assert from_dict(PretrainConfig, cfg).optimizer.freeze_step == 11


class _FillsUp:
    """A file that takes ``room`` bytes, then fails as a full device does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_device_during_a_checkpoint_is_named_with_its_free_space(
    tiny_corpus, tmp_path, monkeypatch, capsys
):
    from onebit_bert import checkpoint
    from pretrain.__main__ import main

    real = checkpoint.atomic_open

    @contextlib.contextmanager
    def filling(path, mode="wb"):
        with real(path, mode) as f:
            yield _FillsUp(f, 1000) if "step_00000008.tmp" in str(path) else f

    monkeypatch.setattr(checkpoint, "atomic_open", filling)
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_corpus, run_dir, **{"checkpoint.every": 4})
    assert main(["--config", str(write_cfg(cfg, tmp_path / "c.yaml"))]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no space left on device while writing "), err
    assert "step_00000008.tmp/rank00000.pt (" in err[0] and " MB free on /" in err[0]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and "no space left on device" in status["error"]
    assert " MB free on /" in status["error"]
    assert status["step"] == 8 and status["last_checkpoint"] == 4  # the last good save
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000004"]  # no step_00000008.tmp left behind
    assert not list(run_dir.rglob("*.tmp"))


def test_a_device_without_room_for_the_next_checkpoint_fails_before_writing(
    tiny_corpus, tmp_path, monkeypatch
):
    import shutil as shutil_module

    from onebit_bert.io import NoSpaceError

    run_dir = tmp_path / "run"
    _run(tiny_config(tiny_corpus, run_dir, **{"schedule.max_steps": 4}))
    usage = shutil_module.disk_usage(run_dir)
    monkeypatch.setattr(
        "onebit_bert.checkpoint.shutil.disk_usage", lambda p: usage._replace(free=1000)
    )
    longer = {"schedule.max_steps": 8, "resume.allow_changes": ["schedule.max_steps"]}
    with pytest.raises(NoSpaceError, match=r"checkpoint step 8 .* step_00000004 took"):
        _run(tiny_config(tiny_corpus, run_dir, **longer))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004"]


def test_a_resume_says_where_it_starts_and_replaces_the_replayed_rows(
    tiny_corpus, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    cfg = tiny_config(tiny_corpus, run_dir, **{"schedule.max_steps": 8})
    _run(cfg)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000008")  # as if killed after step 8's log
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "lo')  # and a torn last line
    capsys.readouterr()
    _run(cfg)
    assert f"resuming from step 4 ({run_dir / 'checkpoints' / 'step_00000004'})" in (
        capsys.readouterr().err
    )
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))  # steps 5-8 once each: the replayed ones replaced
