"""python -m pipeline.tune: equal-budget successive halving as real pretraining runs, each
trial continued from its checkpoint to the next rung, resumable, and read by the
comparison."""

from __future__ import annotations

import json

import yaml

from onebit_bert.metrics_log import read_metrics
from pipeline import tune
from tests.helpers.runs import tiny_config


def test_a_recipe_is_tuned_by_halving_then_nothing_reruns(tiny_corpus, tmp_path):
    base = tmp_path / "base.yaml"
    cfg = tiny_config(tiny_corpus, tmp_path / "unused", **{"schedule.max_steps": 4,
                                                           "checkpoint.every": 100})  # fmt: skip
    base.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "tune"
    argv = ["--config", str(base), "--data", str(tiny_corpus), "--recipes", "lamb",
            "--budget", "2", "--first-rung", "2", "--out", str(out)]  # fmt: skip
    assert tune.main(argv) == 0
    records = {n: json.loads((out / n / "tuning.json").read_text()) for n in ("lamb",)}
    for name, record in records.items():
        assert record["budget"] == {"trials": 2, "rungs": [2, 4], "steps": 2 + 4}
        losses = {t["name"]: t["losses"] for t in record["trials"]}
        # both trials scored at step 2; the better one continued to step 4 and was chosen
        assert all("2" in v for v in losses.values())
        (winner,) = [n for n, v in losses.items() if "4" in v]
        assert winner == record["chosen"]
        best = min(losses, key=lambda n: (losses[n]["2"], n))
        assert winner == best
        run = out / name / winner
        steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
        assert steps == [1, 2, 3, 4]  # continued from its step-2 checkpoint, not restarted
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["recipe"] == name and saved["seed"] == 1
        assert f"optimizer.lr={saved['optimizer']['lr']}" in [
            o for t in record["trials"] if t["name"] == winner for o in
            (f"{k}={v}" for k, v in t["settings"].items())
        ]  # fmt: skip
    # a second invocation finds every rung's loss and launches nothing
    tuner = tune.Tuner(base, tiny_corpus, out, [])
    again = tuner.tune("lamb", 2, 2)
    assert tuner.launches == 0 and again["chosen"] == records["lamb"]["chosen"]
