"""python -m pipeline.tune: equal-budget successive halving as real pretraining runs, each
trial continued from its checkpoint to the next rung, resumable, and read by the
comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from onebit_bert.metrics_log import read_metrics
from pipeline import tune, tuning
from tests.helpers.runs import tiny_config


def _launch_in_process(tuner, config, name, steps):
    """:meth:`tune.Tuner.launch` without a new process: the same run on one rank (the
    launch commands have their own test; the subprocess launch runs in the slow tier)."""
    from onebit_bert.config import load_config
    from onebit_bert.distributed import init_distributed
    from pretrain.config import PretrainConfig
    from pretrain.train import train

    train(load_config(PretrainConfig, config), init_distributed(backend="gloo", env={}))
    tuner.launches += 1


@pytest.mark.parametrize(
    "launch", ["in_process", pytest.param("subprocess", marks=pytest.mark.slow)]
)
def test_a_recipe_is_tuned_by_halving_then_nothing_reruns(
    tiny_corpus, tmp_path, monkeypatch, launch
):
    if launch == "in_process":
        monkeypatch.setattr(tune.Tuner, "launch", _launch_in_process)
    base = tmp_path / "base.yaml"
    cfg = tiny_config(tiny_corpus, tmp_path / "unused", **{"schedule.max_steps": 4,
                                                           "checkpoint.every": 100})  # fmt: skip
    base.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "tune"
    argv = ["--config", str(base), "--data", str(tiny_corpus), "--recipes", "lamb",
            "--budget", "2", "--first-rung", "2", "--eval-seeds", "7,8",
            "--out", str(out)]  # fmt: skip
    # the tuning seed is refused as an evaluation seed, before any run
    assert tune.main([*argv[:-3], "1,2", *argv[-2:]]) == 2 and not out.exists()
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
    # the chosen setting ran the whole run on each fresh seed
    record = records["lamb"]
    manifest = json.loads((tiny_corpus / "manifest.json").read_text())
    assert record["data"] == tuning.data_identity(tiny_corpus)
    assert record["data"]["tokenizer_sha256"] == manifest["tokenizer"]["sha256"]
    assert [run["seed"] for run in record["evaluation"]] == [7, 8]
    for run in record["evaluation"]:
        saved = yaml.safe_load((Path(run["run_dir"]) / "config.yaml").read_text())
        assert saved["seed"] == run["seed"]
        assert saved["optimizer"]["lr"] == record["chosen_settings"]["optimizer.lr"]
        logged = [
            (r["step"], r["val_mlm_loss"])
            for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl")
            if "val_mlm_loss" in r
        ]
        assert logged[-1] == (4, run["final_val_loss"])  # fmt: skip
    assert record["evaluation"][0]["final_val_loss"] != record["evaluation"][1]["final_val_loss"]
    # a second invocation finds every rung's loss and every finished run, and launches nothing
    tuner = tune.Tuner(base, tiny_corpus, out, [])
    again = tuner.tune("lamb", 2, 2, [7, 8])
    assert tuner.launches == 0 and again == record


def test_nodes_split_the_ranks_into_agents_meeting_at_one_rendezvous(tmp_path):
    config = tmp_path / "c.yaml"
    (single,) = tune.launch_commands(config, 1)
    assert single[1:] == ["-m", "pretrain", "--config", str(config)]
    (standalone,) = tune.launch_commands(config, 4)
    assert "--standalone" in standalone and "--nproc-per-node=4" in standalone
    agents = tune.launch_commands(config, 4, nodes=2)
    assert [a[a.index("-m", 2) - 1] for a in agents] == ["--nproc-per-node=2"] * 2
    assert [next(x for x in a if x.startswith("--node-rank=")) for a in agents] == [
        "--node-rank=0",
        "--node-rank=1",
    ]
    ports = {next(x for x in a if x.startswith("--master-port=")) for a in agents}
    assert len(ports) == 1
    try:
        tune.Tuner(config, tmp_path, tmp_path, [], nproc=3, nodes=2)
    except ValueError as err:
        assert "--nodes 2" in str(err)
    else:
        raise AssertionError("3 ranks on 2 nodes was accepted")


def test_a_failed_agent_stops_the_others():
    import subprocess
    import sys

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    bad = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert tune._wait_all([slow, bad], poll_s=0.05) == 3
    assert slow.returncode is not None  # stopped, not left waiting for 60 s
    ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert tune._wait_all(ok, poll_s=0.05) == 0


def test_a_recorded_setting_is_evaluated_again_on_other_data(
    tiny_corpus, tmp_path, capsys, monkeypatch
):
    """--evaluate runs a record's chosen setting on fresh seeds with the data given, tunes
    nothing, states both data identities, and refuses records it cannot honour."""
    monkeypatch.setattr(tune.Tuner, "launch", _launch_in_process)
    base = tmp_path / "base.yaml"
    cfg = tiny_config(tiny_corpus, tmp_path / "unused", **{"schedule.max_steps": 3,
                                                           "checkpoint.every": 100})  # fmt: skip
    base.write_text(yaml.safe_dump(cfg))
    record = {"recipe": "lamb", "chosen": "lamb-t1", "chosen_settings": {"optimizer.lr": 0.004},
              "seed": 3, "data": {"tokenizer_sha256": "old", "shards_sha256": "old"}}  # fmt: skip
    report = tmp_path / "report.json"  # a comparison report: its tuning section
    report.write_text(json.dumps({"runs": [], "tuning": {"lamb": record}}))
    out = tmp_path / "again"
    argv = ["--config", str(base), "--data", str(tiny_corpus), "--recipes", "lamb",
            "--evaluate", str(report), "--eval-seeds", "5", "--out", str(out)]  # fmt: skip
    assert tune.main(argv) == 0
    result = json.loads((out / "lamb" / "evaluation.json").read_text())
    assert result["chosen_settings"] == {"optimizer.lr": 0.004}
    assert result["tuned_on"] == record["data"]
    assert result["data"] == tuning.data_identity(tiny_corpus)
    assert result["from"] == str(report)
    (run,) = result["evaluation"]
    saved = yaml.safe_load((Path(run["run_dir"]) / "config.yaml").read_text())
    assert (saved["seed"], saved["optimizer"]["lr"]) == (5, 0.004)
    metrics = read_metrics(Path(run["run_dir"]) / "metrics.jsonl")
    logged = [(r["step"], r["val_mlm_loss"]) for r in metrics if "val_mlm_loss" in r]
    assert logged[-1] == (3, run["final_val_loss"])
    assert not any(p.name.startswith("lamb-t") for p in (out / "lamb").iterdir())  # no trials
    # a tuning.json holding the record reads the same; the finished run is not run again
    single = tmp_path / "tuning.json"
    single.write_text(json.dumps(record))
    tuner = tune.Tuner(base, tiny_corpus, out, [])
    assert tune.reevaluate(tuner, "lamb", single, [5])["evaluation"] == result["evaluation"]
    assert tuner.launches == 0
    # refused before any run: the tuning seed, a recipe the file does not hold, other nodes
    evaluate, nodes = argv[6:-2], ["--nodes", "2", "--nproc", "2"]
    refused = {
        "holds lamb's tuning seed 3": [*argv[:-3], "3", "--out", str(tmp_path / "a")],
        "no tuning record of adamw": [*argv[:5], "adamw", *evaluate, "--out", str(tmp_path / "b")],
        "tuned with --nodes 1": [*argv[:-2], *nodes, "--out", str(tmp_path / "c")],
        "--budget and --first-rung are needed": [*argv[:6], "--out", str(tmp_path / "d")],
    }
    capsys.readouterr()
    for message, bad in refused.items():
        assert tune.main(bad) == 2
        assert message in capsys.readouterr().err
    for name in "abcd":
        assert not (tmp_path / name).exists()
