"""The stage-outputs contract: each stage's ``outputs`` module writes and reads its outputs
and completion markers; ``pretrain.outputs`` also tells running, stopped and stale runs
apart; ``pipeline status`` reads them and writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from data_prep import outputs as data_outputs
from finetune import outputs as finetune_outputs
from pipeline.__main__ import main as pipeline_main
from pretrain.outputs import RunStatus, describe, pid_alive, read_status, status_path
from tests.helpers.paths import REPO

SMOKE = REPO / "configs" / "experiments" / "smoke.yaml"


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- pretrain


def test_run_status_round_trip(tmp_path):
    status = RunStatus(tmp_path, interval=3600)
    status.start(0, world_size=4)
    first = read_status(tmp_path)
    assert first["state"] == "running" and first["step"] == 0
    assert first["last_checkpoint"] is None and first["world_size"] == 4
    assert first["pids"] == [os.getpid()] and first["host"]
    assert abs(first["heartbeat"] - time.time()) < 60

    status.heartbeat(10, last_checkpoint=10)  # a new checkpoint is always written
    assert read_status(tmp_path)["last_checkpoint"] == 10
    assert describe(tmp_path).word == "running"

    status.finish("complete", {"step": 20, "last_checkpoint": 20, "precision": "fp32"})
    final = read_status(tmp_path)
    assert list(final)[:3] == ["state", "step", "last_checkpoint"]
    assert final["state"] == "complete" and final["step"] == 20 and final["precision"] == "fp32"
    assert final["world_size"] == 4 and final["finished"] >= first["started"]
    # complete needs the exported model as well
    assert describe(tmp_path).word == "stopped"
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    state = describe(tmp_path)
    assert state.word == "done" and state.step == 20 and str(state) == "done at step 20"


def test_dead_process_on_this_host_is_stopped_with_its_last_checkpoint(tmp_path):
    pid = dead_pid()
    assert not pid_alive(pid) and pid_alive(os.getpid())
    status = RunStatus(tmp_path)
    status.start(0, pids=[pid])
    status.heartbeat(37, last_checkpoint=30)
    state = describe(tmp_path)
    assert state.word == "stopped"
    assert (state.step, state.last_checkpoint) == (37, 30)
    assert state.text.startswith("stopped at step 37 (last checkpoint 30)")
    assert str(pid) in state.text


def test_live_process_on_this_host_is_running(tmp_path):
    RunStatus(tmp_path).start(5)  # this process
    state = describe(tmp_path)
    assert state.word == "running" and state.text == "running at step 5"


def test_other_host_without_recent_heartbeat_is_stale(tmp_path):
    status = RunStatus(tmp_path)
    status.start(0, host="node-elsewhere", pids=[1])
    status.heartbeat(12, last_checkpoint=10)
    beat = read_status(tmp_path)["heartbeat"]
    fresh = describe(tmp_path, now=beat + 60)
    assert fresh.word == "running" and "node-elsewhere" in fresh.text
    stale = describe(tmp_path, now=beat + 15 * 60, stale_after=600)
    assert stale.word == "stale"
    assert stale.text == "stale: no heartbeat for 15 min (last checkpoint 10; on node-elsewhere)"
    assert describe(tmp_path, now=beat + 15 * 60, stale_after=3600).word == "running"


def test_final_states_are_reported_with_the_last_checkpoint(tmp_path):
    status = RunStatus(tmp_path)
    status.start(0, pids=[dead_pid()])
    status.finish("preempted", {"step": 44, "last_checkpoint": 44})
    state = describe(tmp_path)  # a final state does not depend on the processes
    assert state.word == "preempted" and state.text == "preempted at step 44 (last checkpoint 44)"
    assert describe(tmp_path / "nothing").word == "pending"


def test_heartbeats_are_throttled_but_start_and_finish_always_write(tmp_path):
    status = RunStatus(tmp_path, interval=3600)
    status.start(0, last_checkpoint=None)
    written = status_path(tmp_path).stat().st_mtime_ns
    assert not any(status.heartbeat(step) for step in range(1, 50))
    assert read_status(tmp_path)["step"] == 0
    assert status_path(tmp_path).stat().st_mtime_ns == written
    assert status.heartbeat(50, last_checkpoint=50)  # a new checkpoint is worth a write
    assert not status.heartbeat(51, last_checkpoint=50)
    assert read_status(tmp_path)["step"] == 50
    status.finish("stopped", {"step": 60})
    assert read_status(tmp_path)["step"] == 60 and read_status(tmp_path)["state"] == "stopped"

    every = RunStatus(tmp_path / "every", interval=0.0)
    every.start(0)
    assert every.heartbeat(1) and read_status(tmp_path / "every")["step"] == 1


def test_other_ranks_write_nothing(tmp_path):
    status = RunStatus(tmp_path / "run", is_writer=False)
    status.start(0)
    assert not status.heartbeat(1, last_checkpoint=1)
    status.finish("complete", {"step": 1})
    assert not (tmp_path / "run").exists()


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pretrain.outputs", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_state_cli(tmp_path):
    assert _cli("state", str(tmp_path / "run")) == "pending"
    status = RunStatus(tmp_path / "run")
    status.start(0, pids=[dead_pid()])
    status.heartbeat(8, last_checkpoint=8)
    assert _cli("state", str(tmp_path / "run")) == "stopped"
    status.finish("preempted", {"step": 8})
    assert _cli("state", str(tmp_path / "run")) == "preempted"
    assert _cli("describe", str(tmp_path / "run")) == "preempted at step 8 (last checkpoint 8)"


# ----------------------------------------------------------------------------- pipeline


def test_pipeline_status_on_a_missing_workdir_writes_nothing(tmp_path, capsys):
    workdir = tmp_path / "work"
    assert pipeline_main(["status", "--config", str(SMOKE), f"workdir={workdir}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 7 and all(line.split()[-1] == "pending" for line in lines)
    assert not workdir.exists()


def test_pipeline_status_describes_pretraining_runs(tmp_path, capsys):
    workdir = tmp_path / "work"
    status = RunStatus(workdir / "pretrain" / "lamb" / "phase1")
    status.start(0, pids=[dead_pid()])
    status.heartbeat(25, last_checkpoint=20)
    RunStatus(workdir / "pretrain" / "onebit" / "phase1").start(3)  # this process: alive
    assert pipeline_main(["status", "--config", str(SMOKE), f"workdir={workdir}"]) == 0
    rows = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["pretrain/lamb/phase1"].startswith("stopped at step 25 (last checkpoint 20)")
    assert rows["pretrain/onebit/phase1"].strip() == "running at step 3"
    assert rows["data"].strip() == "pending"
    assert not (workdir / "configs").exists() and not (workdir / "experiment.yaml").exists()


# ----------------------------------------------------------------------------- data, finetune


def test_data_prep_outputs(tmp_path):
    out = tmp_path / "data"
    assert data_outputs.seq_dir(out, 128) == out / "seq128"
    assert not data_outputs.is_complete(out, [128, 512])
    with pytest.raises(FileNotFoundError, match="seq 128"):
        data_outputs.read_manifest(out, 128)
    data_outputs.seq_dir(out, 512).mkdir(parents=True)  # unfinished: no manifest yet
    data_outputs.write_manifest(out, 128, {"seq_length": 128})
    assert data_outputs.seq_lengths_present(out) == [128, 512]
    assert data_outputs.is_complete(out, [128]) and not data_outputs.is_complete(out, [128, 512])
    data_outputs.write_manifest(out, 512, {"seq_length": 512})
    assert data_outputs.is_complete(out, [128, 512])
    assert data_outputs.read_manifest(out, 512) == {"seq_length": 512}
    assert data_outputs.manifest_path(out, 512) == out / "seq512" / "manifest.json"


def test_finetune_outputs(tmp_path):
    out = tmp_path / "ft"
    assert not finetune_outputs.is_complete(out, ["sst2"])
    with pytest.raises(FileNotFoundError, match="results.json"):
        finetune_outputs.read_results(out)
    finetune_outputs.write_results(out, {"sst2": {"accuracy": 0.8, "seeds": [1, 2]}})
    assert finetune_outputs.read_results(out)["sst2"]["accuracy"] == 0.8
    assert finetune_outputs.is_complete(out, ["sst2"])
    assert finetune_outputs.is_complete(out, ["sst2"], seeds=[2, 1])
    assert not finetune_outputs.is_complete(out, ["sst2"], seeds=[1, 2, 3])  # one array task
    assert not finetune_outputs.is_complete(out, ["sst2", "mrpc"])
    finetune_outputs.write_task_results(out, "sst2", {"accuracy": 0.8})
    assert json.loads((out / "sst2" / "results.json").read_text()) == {"accuracy": 0.8}
    run = finetune_outputs.run_path(out, "sst2", 2e-5, 3.0, 1)
    assert run == out / "sst2" / "runs" / "lr2e-05_ep3_seed1.json"


# ----------------------------------------------------------------------------- damaged files


def test_a_damaged_status_is_one_line_never_a_traceback(tmp_path, capsys):
    run = tmp_path / "work" / "pretrain" / "lamb" / "phase1"
    RunStatus(run).start(3)
    text = status_path(run).read_text()
    status_path(run).write_text(text[: len(text) // 2])  # truncated mid-write by a crash
    state = describe(run)
    assert state.word == "unreadable" and state.text.startswith(f"{status_path(run)} unreadable")
    assert "\n" not in state.text
    assert _cli("state", str(run)) == "unreadable"
    assert _cli("describe", str(run)).startswith(str(status_path(run)))
    assert pipeline_main(["status", "--config", str(SMOKE), f"workdir={tmp_path / 'work'}"]) == 0
    rows = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert "unreadable" in rows["pretrain/lamb/phase1"]
    status_path(run).write_text("[1, 2]")
    assert describe(run).word == "unreadable"
    with pytest.raises(ValueError, match="unreadable"):
        read_status(run)


def test_damaged_stage_outputs_are_not_complete_and_say_so(tmp_path):
    out = tmp_path / "ft"
    finetune_outputs.write_results(out, {"sst2": {"accuracy": 0.8, "seeds": [1]}})
    path = finetune_outputs.results_path(out)
    path.write_text(path.read_text()[:10])
    assert not finetune_outputs.is_complete(out, ["sst2"])
    with pytest.raises(ValueError, match="unreadable.*run the fine-tuning stage again"):
        finetune_outputs.read_results(out)
    data = tmp_path / "data"
    data_outputs.write_manifest(data, 64, {"seq_length": 64})
    data_outputs.manifest_path(data, 64).write_text("{")
    with pytest.raises(ValueError, match="unreadable.*prepare seq 64 again"):
        data_outputs.read_manifest(data, 64)
    data_outputs.manifest_path(data, 64).write_text("[64]")
    with pytest.raises(ValueError, match="holds a list, not an object; prepare seq 64 again"):
        data_outputs.read_manifest(data, 64)
