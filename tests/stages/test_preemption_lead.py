"""The preemption lead against the run's own save time: the rule's arithmetic, a warning
after a save that a short lead cannot cover, and the same warning at the start of a resume
(from the save time the last launch recorded)."""

from __future__ import annotations

import json
import warnings

import pytest

from pretrain.config import CheckpointConfig
from pretrain.train import lead_shortfall
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process


def test_the_rule_is_twice_the_save_plus_one_step():
    assert lead_shortfall(70.0, save_s=30.0, step_s=10.0) is None
    message = lead_shortfall(69.0, save_s=30.0, step_s=10.0)
    assert message is not None
    assert "a save took 30.0 s" in message and "at least 70 s" in message
    assert "slurm.signal_lead" in message


def test_a_lead_must_be_positive():
    with pytest.raises(ValueError, match="preemption_lead_s must be > 0"):
        CheckpointConfig(preemption_lead_s=0)


def _status(run_dir):
    return json.loads((run_dir / "status.json").read_text())


def test_a_short_lead_warns_after_a_save_and_at_the_next_start(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus, run_dir, **{"schedule.max_steps": 4, "checkpoint.preemption_lead_s": 1e-6}
    )
    with pytest.warns(UserWarning, match="preemption may kill the run") as caught:
        run_ranks(train_in_process, 1, {**cfg, "stop_after": 2})
    assert sum("preemption_lead_s" in str(w.message) for w in caught) == 1  # once per launch
    first = _status(run_dir)
    assert first["state"] == "stopped"
    assert first["save_seconds"] > 0 and first["step_seconds"] > 0
    assert "preemption may kill" in first["lead_warning"]
    # the resume warns before its first step, from the time recorded above
    with pytest.warns(UserWarning, match="preemption may kill the run"):
        run_ranks(train_in_process, 1, cfg)
    assert any("preemption may kill" in n for n in _status(run_dir)["notes"])


def test_a_long_lead_records_the_save_time_without_a_warning(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus, run_dir, **{"schedule.max_steps": 2, "checkpoint.preemption_lead_s": 1e6}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ranks(train_in_process, 1, cfg)
    assert not [w for w in caught if "preemption_lead_s" in str(w.message)]
    status = _status(run_dir)
    assert status["save_seconds"] > 0 and "lead_warning" not in status
