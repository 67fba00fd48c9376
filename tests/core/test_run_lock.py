"""One writer per run directory: the lock's rules, and two real launches on one run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from onebit_bert.run_lock import (
    LOCK_FILE,
    RunLock,
    RunLocked,
    holder_gone,
    read_lock,
)
from pretrain import outputs
from tests.helpers.runs import REPO, kill_all, tiny_config, torchrun, write_cfg


def _write_lock(run_dir, **record):
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pids": [], "heartbeat": time.time(), "token": "x"}
    (run_dir / LOCK_FILE).write_text(json.dumps({**base, **record}))


@pytest.fixture
def live_pid():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_lock_is_taken_held_and_released(tmp_path):
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    record = read_lock(tmp_path / "run")
    assert record["pids"] == [os.getpid()] and record["token"] == lock.token
    assert lock.took_over is None
    lock.release()
    assert read_lock(tmp_path / "run") is None


def test_folders_removed_by_a_releasing_launch_before_the_open_are_made_again(
    tmp_path, monkeypatch
):
    # Another launch releasing its lock removes the empty run folder and its empty parent
    # (fine-tuning's locks/) between this launch's mkdir and its open.
    from onebit_bert import run_lock

    run_dir = tmp_path / "locks" / "run"
    real_open, calls = os.open, []

    def open_after_removal(path, *args):
        calls.append(path)
        if len(calls) == 1:
            run_dir.rmdir()
            run_dir.parent.rmdir()
        return real_open(path, *args)

    monkeypatch.setattr(run_lock.os, "open", open_after_removal)
    lock = RunLock(run_dir)
    lock.acquire()
    assert len(calls) == 2 and lock.held
    assert read_lock(run_dir)["token"] == lock.token


def test_a_live_holder_on_this_host_is_named_and_refused(tmp_path, live_pid):
    _write_lock(tmp_path, pids=[live_pid], job_id="12")
    with pytest.raises(
        RunLocked, match=rf"being written by another launch \(host .*pid {live_pid}, SLURM job 12"
    ):
        RunLock(tmp_path).acquire()
    assert read_lock(tmp_path)["pids"] == [live_pid]  # untouched


def test_a_holder_whose_processes_are_gone_is_taken_over(tmp_path, dead_pid):
    _write_lock(tmp_path, pids=[dead_pid])
    lock = RunLock(tmp_path)
    lock.acquire()
    assert f"process(es) {dead_pid} ended" in lock.took_over
    assert read_lock(tmp_path)["token"] == lock.token


def test_other_hosts_by_heartbeat_same_job_after_requeue_and_damaged_files():
    now = 10_000.0
    fresh = {"host": "node7", "pids": [1], "heartbeat": now - 5, "job_id": "77"}
    assert holder_gone(fresh, 600, now=now, host="node1", job_id="") is None
    old = {**fresh, "heartbeat": now - 601}
    assert "older than 600 s" in holder_gone(old, 600, now=now, host="node1", job_id="")
    assert "this SLURM job (77)" in holder_gone(fresh, 600, now=now, host="node1", job_id="77")
    assert holder_gone(fresh, 600, now=now, host="node1", job_id="78") is None
    assert holder_gone({}, 600, now=now) == "the lock file is damaged"


def test_release_leaves_a_lock_taken_over_by_another_launch_and_heartbeat_stops(tmp_path):
    lock = RunLock(tmp_path, interval=0.0)
    lock.acquire()
    assert lock.heartbeat()
    _write_lock(tmp_path, host="node9", pids=[1], token="theirs")
    with pytest.raises(RunLocked, match="taken over by another launch"):
        lock.heartbeat()
    lock.release()
    assert read_lock(tmp_path)["token"] == "theirs"


# ----------------------------------------------------------------------------- two launches
def _pretrain(cfg_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", str(cfg_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _wait_for(predicate, proc, what, seconds=240):
    deadline = time.time() + seconds
    while not predicate():
        assert proc.poll() is None, f"the launch ended before {what}: {proc.stdout.read()}"
        assert time.time() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.1)


def test_second_launch_on_a_run_is_refused_and_a_killed_ones_lock_is_taken_over(
    tiny_corpus, tmp_path
):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus, run_dir, **{"schedule.max_steps": 100_000, "checkpoint.every": 5}
    )
    cfg_path = write_cfg(cfg, tmp_path / "run.yaml")
    first = torchrun(cfg_path, 1)
    try:
        _wait_for(lambda: (run_dir / "checkpoints").is_dir(), first, "checkpoint")
        holder = read_lock(run_dir)
        assert holder is not None and holder["pids"][0] != first.pid  # torchrun's worker
        status_before = outputs.read_status(run_dir)
        second = _pretrain(cfg_path)
        assert second.returncode == 4, second.stderr
        assert "being written by another launch" in second.stderr
        assert f"pid {holder['pids'][0]}" in second.stderr
        assert first.poll() is None, "the first launch goes on"
        assert outputs.read_status(run_dir)["pids"] == status_before["pids"]
    finally:
        kill_all(first)  # leaves its lock behind
    third = torchrun(cfg_path, 1)
    try:
        _wait_for(
            lambda: any(
                "took over the run lock" in note
                for note in (outputs.read_status(run_dir) or {}).get("notes", [])
            ),
            third,
            "takeover note",
        )
        assert read_lock(run_dir)["pids"] != holder["pids"]
        os.killpg(third.pid, signal.SIGTERM)  # a preemption: checkpoint, release, exit
        third.communicate(timeout=120)
    finally:
        kill_all(third)
    assert outputs.read_status(run_dir)["state"] == "preempted"
    assert read_lock(run_dir) is None


def test_data_prep_takes_its_outputs_lock(tmp_path, live_pid, capsys):
    from data_prep.__main__ import main as data_prep_main
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare
    from onebit_bert.config import from_dict, save_config
    from tests.helpers.corpus import write_corpus

    corpus = write_corpus(tmp_path / "corpus", n_docs=40)
    out = tmp_path / "prepared"
    cfg = from_dict(
        DataPrepConfig,
        {
            "output": str(out),
            "sources": [{"name": "text", "kind": "text", "paths": [str(corpus["text"])]}],
            "tokenizer": {"vocab_file": str(corpus["vocab"])},
            "instances": {"seq_lengths": [32]},
            "sequences_per_shard": 16,
            "workers": 1,
            "progress": False,
        },
    )
    _write_lock(out, pids=[live_pid])  # another launch preparing this output
    with pytest.raises(RunLocked, match=rf"{out} is being written by another launch"):
        prepare(cfg)
    assert not (out / "tokenizer").exists()  # refused before any work
    save_config(cfg, tmp_path / "data.yaml")
    assert data_prep_main(["--config", str(tmp_path / "data.yaml")]) == 4
    assert f"pid {live_pid}" in capsys.readouterr().err
    (out / LOCK_FILE).unlink()
    prepare(cfg)
    assert (out / "seq32" / "manifest.json").is_file()
    assert not (out / LOCK_FILE).exists()  # released


def test_the_lock_heartbeat_thread_refreshes_and_releases(tmp_path):
    from onebit_bert.run_lock import holding_lock

    with holding_lock(tmp_path / "run", interval=0.2) as lock:
        first = read_lock(tmp_path / "run")["heartbeat"]
        time.sleep(0.8)
        assert read_lock(tmp_path / "run")["heartbeat"] > first
        assert lock.held
    assert read_lock(tmp_path / "run") is None
