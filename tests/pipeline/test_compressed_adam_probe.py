"""bench.compressed_adam_probe on the tiny corpus: both optimizers run through their
compressed steps on one process and report losses and the largest moves as JSON."""

from __future__ import annotations

import json
import math

import pytest

from bench import compressed_adam_probe
from tests.helpers.runs import tiny_config, write_cfg


@pytest.mark.parametrize("optimizer", ["zero_one_adam", "onebit_adam"])
def test_probe_reports_losses_and_moves(tiny_corpus, tmp_path, capsys, optimizer):
    cfg = tiny_config(tiny_corpus, tmp_path / "run")
    cfg["optimizer"].update(var_freeze_step=4, local_step_scaler=2)
    path = write_cfg(cfg, tmp_path / "cfg.yaml")
    args = ["--config", str(path), "--optimizer", optimizer, "--steps", "8", "--every", "4"]
    assert compressed_adam_probe.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["steps"] == 8 and result["mask_untrained"] is True
    assert math.isfinite(result["final_loss"]) and result["min_loss"] <= result["final_loss"]
    assert result["largest_step_move"] and all(v >= 0 for v in result["largest_step_move"].values())
    # printed: step 1 and every 4th step, each naming its kind
    assert [line.split()[1] for line in lines[:-1]] == ["1", "4", "8"]
    kinds = {line.split()[2] for line in lines[:-1]}
    assert kinds <= {"variance", "compressed", "local", "sync", "warmup", "compression"}
