"""A resume compares the recorded config with the new one: cadence may change, the
trajectory may not unless resume.allow_changes names the change (then it is recorded)."""

from __future__ import annotations

import pytest

from onebit_bert.metrics_log import read_metrics
from pretrain import outputs
from pretrain.checkpointing import check_resume_changes, resume_changes
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process

RECORDED = {
    "run_dir": "runs/a",
    "optimizer": {"lr": 0.02, "betas": [0.9, 0.999]},
    "batch": {"global_batch_size": 32},
    "logging": {"progress_every": 10},
    "data": {"path": "d", "validation_every": 50},
    "model": {"compile": "off"},
}


def _with(**changes):
    current = {k: dict(v) if isinstance(v, dict) else v for k, v in RECORDED.items()}
    for key, value in changes.items():
        section, field = key.split("__")
        current[section][field] = value
    return current


def test_cadence_changes_pass_and_trajectory_changes_are_listed():
    same = _with(logging__progress_every=1, data__validation_every=10)
    assert resume_changes(RECORDED, {**same, "run_dir": "runs/b"}) == ({}, {})
    assert resume_changes(RECORDED, _with(optimizer__betas=(0.9, 0.999))) == ({}, {})
    changed = _with(optimizer__lr=0.01, batch__global_batch_size=64, data__path="e")
    ok, refused = resume_changes(RECORDED, changed)
    assert ok == {}
    assert refused == {
        "optimizer.lr": [0.02, 0.01],
        "batch.global_batch_size": [32, 64],
        "data.path": ["d", "e"],
    }
    ok, refused = resume_changes(RECORDED, changed, ["optimizer", "batch.global_batch_size"])
    assert set(ok) == {"optimizer.lr", "batch.global_batch_size"} and set(refused) == {"data.path"}
    # compiling the model changes rounding and dropout's masks: a trajectory change
    assert resume_changes(RECORDED, _with(model__compile="default")) == (
        {},
        {"model.compile": ["off", "default"]},
    )
    # a field the recorded config predates is no change
    assert resume_changes(RECORDED, _with(optimizer__coeff_beta=0.9)) == ({}, {})
    with pytest.raises(
        ValueError, match=r"optimizer.lr: 0.02 -> 0.01.*allow_changes=\[optimizer.lr\]"
    ):
        check_resume_changes(RECORDED, _with(optimizer__lr=0.01))


def test_a_resume_with_another_lr_stops_unless_allowed_then_it_is_recorded(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    base = {"schedule.max_steps": 6, "checkpoint.every": 2}
    run_ranks(train_in_process, 1, tiny_config(tiny_corpus, run_dir, **base, stop_after=2))
    changed = tiny_config(tiny_corpus, run_dir, **base, **{"optimizer.lr": 0.01})
    with pytest.raises(ValueError, match=r"optimizer.lr: 0.02 -> 0.01"):
        run_ranks(train_in_process, 1, changed)
    assert outputs.read_status(run_dir)["state"] == "stopped"  # untouched by the refusal
    allowed = tiny_config(
        tiny_corpus,
        run_dir,
        **base,
        **{"optimizer.lr": 0.01, "resume.allow_changes": ["optimizer.lr"]},
    )
    run_ranks(train_in_process, 1, allowed)
    status = outputs.read_status(run_dir)
    assert status["state"] == "complete"
    assert any("optimizer.lr: 0.02 -> 0.01" in note for note in status["notes"])
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "resume_changes" in r]
    assert records == [{**records[0], "step": 2, "resume_changes": {"optimizer.lr": [0.02, 0.01]}}]


def test_a_null_outer_lr_reads_as_the_value_it_stands_for():
    """Configs recorded when strategy.outer_lr defaulted to 1.0 resume under its null
    default; DiLoCo's null is 0.7, so a recorded 1.0 is a change there."""
    lamb = {"strategy": {"name": "auto", "outer_lr": 1.0}}
    assert resume_changes(lamb, {"strategy": {"name": "auto", "outer_lr": None}}) == ({}, {})
    diloco_null = {"strategy": {"name": "diloco", "outer_lr": None}}
    assert resume_changes({"strategy": {"name": "diloco", "outer_lr": 0.7}}, diloco_null) == (
        {},
        {},
    )
    _, refused = resume_changes({"strategy": {"name": "diloco", "outer_lr": 1.0}}, diloco_null)
    assert refused == {"strategy.outer_lr": [1.0, 0.7]}
