"""pipeline.reports.replay: how consecutive updates line up, on sequences of weights with
known answers and on a real 2-rank 1-bit LAMB run replayed from one of its checkpoints."""

import math

import pytest
import torch

from onebit_bert.checkpoint import load_file
from onebit_bert.metrics_log import read_metrics
from pipeline.reports.replay import (
    _distinct,
    analyse,
    main,
    replay,
    update_statistics,
    world_size_of,
)
from tests.helpers.runs import tiny_config, torchrun_to_end, write_cfg


def _sequence(delta) -> list[dict[str, torch.Tensor]]:
    """Weights of one 3-element layer (and a scalar) after the steps ``delta(t)``."""
    w = torch.zeros(3)
    out = [{"layer": w.clone(), "scale": torch.ones(1)}]
    for t in range(4):
        w = w + delta(t)
        out.append({"layer": w.clone(), "scale": torch.ones(1)})
    return out


def test_steps_that_take_the_last_one_back_have_cosine_minus_one_and_no_progress():
    b = torch.tensor([0.0, 1.0, 0.0])
    stats = update_statistics(_sequence(lambda t: 2 * b * (-1) ** t))
    assert stats["model"]["cos"] == pytest.approx(-1.0)
    assert stats["model"]["efficiency"] == pytest.approx(0.0)
    assert stats["model"]["step"] == pytest.approx(2.0)
    assert list(stats["layers"]) == ["layer"]  # a one-element tensor is left out


def test_a_drift_with_an_orthogonal_oscillation_gives_the_cosine_and_share_it_must():
    a, c = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    stats = update_statistics(_sequence(lambda t: a + c * (-1) ** t))
    # consecutive steps a ± c: (|a|² - |c|²) / (|a|² + |c|²) = -3/5; net 4a over 4·√5
    assert stats["model"]["cos"] == pytest.approx(-0.6)
    assert stats["model"]["efficiency"] == pytest.approx(1 / math.sqrt(5))
    assert stats["layers"]["layer"]["step"] == pytest.approx(math.sqrt(5))
    steady = update_statistics(_sequence(lambda t: a))
    assert steady["model"]["cos"] == pytest.approx(1.0)
    assert steady["model"]["efficiency"] == pytest.approx(1.0)


def test_a_tied_weight_counts_once():
    shared = torch.randn(4, 3)
    state = {
        "embeddings": shared,
        "decoder": shared,
        "bias": torch.zeros(4),
        "ids": torch.arange(3),
    }
    assert list(_distinct(state)) == ["embeddings", "bias"]


def test_too_few_steps_or_a_missing_checkpoint_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 3"):
        update_statistics(_sequence(lambda t: torch.ones(3))[:2])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="step_00000004"):
        replay(tmp_path / "run", 4, 4, tmp_path / "work")
    assert main(["--run", "no-equals-sign", "--at", "4", "--out", str(tmp_path / "out")]) == 2
    checkpoint = tmp_path / "step"
    checkpoint.mkdir()
    (checkpoint / "complete.json").write_text('{"step": 4}')
    with pytest.raises(ValueError, match="records no world_size"):
        world_size_of(checkpoint)
    (checkpoint / "complete.json").write_text("{torn")
    with pytest.raises(ValueError, match="complete.json unreadable"):
        world_size_of(checkpoint)
    (checkpoint / "complete.json").write_text('{"step": 4, "world_size": 2}')
    assert world_size_of(checkpoint) == 2


@pytest.mark.slow
def test_a_replay_takes_the_runs_own_steps_and_reads_its_own_validation_loss(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        tiny_corpus,
        run_dir,
        **{
            "optimizer.name": "onebit_lamb",
            "checkpoint.every": 4,
            "checkpoint.keep_last": 5,
            "data.validation_every": 4,
        },
    )
    torchrun_to_end(write_cfg(cfg, tmp_path / "run.yaml"), nproc=2)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))

    row = analyse(run_dir, 4, 4, tmp_path / "work", loss=True, keep=True)

    # exact resume: the replayed step 8 is the run's own checkpoint 8, bit for bit
    ours = load_file(tmp_path / "work" / "checkpoints" / "step_00000008" / "shared.pt")
    theirs = load_file(run_dir / "checkpoints" / "step_00000008" / "shared.pt")
    for name, tensor in theirs["model"].items():
        assert torch.equal(ours["model"][name], tensor), name
    logged = {r["step"]: r["val_mlm_loss"] for r in read_metrics(run_dir / "metrics.jsonl")
              if "val_mlm_loss" in r}  # fmt: skip
    assert row["loss"]["w0"] == pytest.approx(logged[4], rel=1e-6)
    assert set(row["loss"]) == {"w0", "w1", "mean"}
    assert -1.0 <= row["model"]["cos"] <= 1.0 and 0.0 <= row["model"]["efficiency"] <= 1.0
    assert "cls.predictions.decoder.weight" not in row["layers"]  # tied to the embeddings
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
