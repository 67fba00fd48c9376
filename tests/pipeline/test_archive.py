"""The archived record of a pretraining run reads as the run itself, its bytes included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.reports.archive import archive, main
from pipeline.reports.runs import load_run
from pipeline.run_files import RunInputs

STEPS = 95


def _run(directory: Path, state: str = "complete") -> Path:
    """A 1-bit run of ``STEPS`` steps that stopped after step 42 and resumed from step 30
    (steps 31-42 logged twice, the second time with other values), sending 7 bytes of
    gradients per step before its freeze at step 20 and 3 of momentum after, and
    validating every 25 steps."""
    directory.mkdir(parents=True)
    config = {
        "seed": 1,
        "batch": {"global_batch_size": 8},
        "optimizer": {"name": "onebit_lamb", "freeze_step": 20},
        "schedule": {"max_steps": STEPS},
    }
    (directory / "config.yaml").write_text(yaml.safe_dump(config))
    (directory / "status.json").write_text(json.dumps({"state": state, "step": STEPS}))

    def record(step: int, again: bool = False) -> dict:
        kind = "gradients" if step <= 20 else "momentum"
        size = 7 if kind == "gradients" else 3
        return {"step": step, "time": 1_000 + step + (100 if again else 0),
                "loss": 5.0 - step / 100 - (0.5 if again else 0.0), "comm_bytes": size,
                f"comm_bytes_{kind}": size, f"comm_seconds_{kind}": 0.5,
                "trust_ratio_mean": 0.1}  # fmt: skip

    rows = [record(s) for s in range(1, 43)] + [record(s, True) for s in range(31, STEPS + 1)]
    rows += [{"step": s, "val_mlm_loss": 6.0 - s / 50, "val_mlm_accuracy": s / 200}
             for s in range(25, STEPS + 1, 25)]  # fmt: skip
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_the_record_reads_as_the_run_with_its_totals(tmp_path):
    run = _run(tmp_path / "run")
    done = archive(run, tmp_path / "kept")
    assert done["rows"] == STEPS and done["kept"] == 9 + 2 + 1  # every 10th, steps 25, 75, the last
    source = load_run(RunInputs("onebit", run, None))
    kept = load_run(RunInputs("onebit", tmp_path / "kept", None))
    assert source["comm_bytes_total"] == 20 * 7 + (STEPS - 20) * 3
    for key in ("comm_bytes_total", "comm_by_kind", "started", "val_mlm_loss", "final", "steps"):
        assert kept[key] == source[key], key
    # the resumed steps keep their second record
    losses = dict(kept["train_loss"])
    assert losses[40] == pytest.approx(5.0 - 0.4 - 0.5)
    assert set(losses) == {*range(10, STEPS, 10), 25, 75, STEPS}
    # what the thinned metrics alone would have summed to is much less
    thinned = [json.loads(line) for line in (tmp_path / "kept" / "metrics.jsonl").open()]
    assert sum(r.get("comm_bytes", 0) for r in thinned) < source["comm_bytes_total"] / 5
    totals = json.loads((tmp_path / "kept" / "totals.json").read_text())
    assert totals["every"] == 10 and totals["comm_by_kind"]["momentum"]["bytes"] == 75 * 3
    assert (tmp_path / "kept" / "config.yaml").read_text() == (run / "config.yaml").read_text()


def test_only_a_finished_run_is_archived(tmp_path, capsys):
    running = _run(tmp_path / "running", state="running")
    with pytest.raises(ValueError, match="not a complete pretraining run .*'running'"):
        archive(running, tmp_path / "kept")
    assert not (tmp_path / "kept").exists()
    assert main([str(running), str(tmp_path / "kept")]) == 2
    assert "archive it when it has finished" in capsys.readouterr().err
    finished = _run(tmp_path / "finished")
    assert main([str(finished), str(tmp_path / "kept"), "--every", "5"]) == 0
    assert "steps kept" in capsys.readouterr().out
    assert main([str(finished), str(tmp_path / "kept2"), "--every", "0"]) == 2


def test_the_comparison_refuses_a_thinned_record(tmp_path):
    """Bytes to the target and each stage's time need every step: a record that keeps every
    10th is refused by name, where summing its rows would give a tenth of the bytes."""
    from pipeline.reports.compare import load_timed_run

    run = _run(tmp_path / "run")
    assert load_timed_run(f"onebit={run}")["bytes_at"][STEPS] == 20 * 7 + (STEPS - 20) * 3
    archive(run, tmp_path / "kept")
    with pytest.raises(ValueError, match=r"onebit=.*kept: an archived record .* every 10th step"):
        load_timed_run(f"onebit={tmp_path / 'kept'}")
    # a record that keeps every step reads as the run
    archive(run, tmp_path / "whole", every=1)
    assert load_timed_run(f"onebit={tmp_path / 'whole'}")["bytes_at"][STEPS] == 20 * 7 + 75 * 3
