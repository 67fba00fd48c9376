"""Resuming on another number of processes: LAMB continues its trajectory; 1-bit LAMB
from two processes onto one is refused with a message that names the world sizes, and
with compression forced on one process goes 2 -> 1 -> 4 keeping every state that does not
depend on the world size and resetting its error feedback."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import mlm_losses, tiny_config, train_in_process


def _cfg(corpus, run_dir, steps, **overrides):
    common = {
        "schedule.max_steps": steps,
        "model.dropout": 0.0,
        "checkpoint.every": 3,
        "strategy.grad_sync": "allreduce",
    }
    return tiny_config(corpus, run_dir, **{**common, **overrides})


@pytest.mark.slow
def test_lamb_goes_two_one_four_on_the_two_process_trajectory(tiny_corpus, tmp_path):
    reference = tmp_path / "reference"
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, reference, 9))
    resumed = tmp_path / "resumed"
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, resumed, 9, stop_after=3))
    with pytest.warns(UserWarning, match="different world size"):
        run_ranks(train_in_process, 1, _cfg(tiny_corpus, resumed, 9, stop_after=3))
    run_ranks(train_in_process, 4, _cfg(tiny_corpus, resumed, 9))
    want, got = mlm_losses(reference), mlm_losses(resumed)
    assert len(want) == len(got) == 9
    assert got[:3] == want[:3]
    # the same global batches; only the order of the gradient sum differs
    torch.testing.assert_close(got[3:], want[3:], rtol=1e-4, atol=0)


def test_onebit_lamb_from_two_processes_onto_one_names_the_world_sizes(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    onebit = {"optimizer.name": "onebit_lamb"}
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, run_dir, 6, stop_after=3, **onebit))
    with pytest.raises(ValueError, match="written on 2 processes.*on 1 process.*force_compression"):
        run_ranks(train_in_process, 1, _cfg(tiny_corpus, run_dir, 6, **onebit))


def _train_warned(comm, cfg: dict) -> list[str]:
    """train_in_process, returning the warnings this rank raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_in_process(comm, cfg)
    return [str(w.message) for w in caught]


def _checkpoint(run_dir: Path, step: int) -> tuple[dict, list[dict]]:
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    load = lambda path: torch.load(path, map_location="cpu", weights_only=False)  # noqa: E731
    ranks = [load(p) for p in sorted(folder.glob("rank*.pt"))]
    return load(folder / "shared.pt"), ranks


FROZEN = ("exp_avg_sq", "lamb_coeff", "scaling_coeff")
"""1-bit LAMB's per-parameter state that stays fixed once compression starts."""


@pytest.mark.slow
def test_onebit_lamb_goes_two_one_four_keeping_what_does_not_depend_on_the_world_size(
    tiny_corpus, tmp_path
):
    onebit = {"optimizer.name": "onebit_lamb", "optimizer.freeze_step": 4}
    reference = tmp_path / "reference"
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, reference, 9, **onebit))
    run_dir = tmp_path / "run"
    # 2 ranks, warmup steps 1-3
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, run_dir, 9, stop_after=3, **onebit))
    # 1 rank, compression forced: step 4 is the last warmup step, 5 and 6 compress
    one = {**onebit, "strategy.force_compression": True}
    with pytest.warns(UserWarning, match="different world size"):
        run_ranks(train_in_process, 1, _cfg(tiny_corpus, run_dir, 9, stop_after=3, **one))
    # 4 ranks, steps 7-9, from a checkpoint written while compressing
    said = run_ranks(_train_warned, 4, _cfg(tiny_corpus, run_dir, 9, **onebit))
    for rank_warnings in said:
        assert any("no compression errors for this rank" in w for w in rank_warnings)
    want, got = mlm_losses(reference), mlm_losses(run_dir)
    assert len(got) == 9 and all(torch.isfinite(torch.tensor(got)))
    assert got[:3] == want[:3]
    # step 4 is exact LAMB on both sides: the same global batch, summed in another order
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=0)
    at_6, _ = _checkpoint(run_dir, 6)
    at_9, ranks_9 = _checkpoint(run_dir, 9)
    assert at_9["optimizer"]["onebit"]["step"] == 9
    assert at_9["scheduler"]["last_epoch"] == 9
    for key, before in at_6["optimizer"]["state"].items():
        after = at_9["optimizer"]["state"][key]
        for name in FROZEN:
            assert torch.equal(before[name], after[name]), (key, name)
    assert len(ranks_9) == 4
    for rank, state in enumerate(ranks_9):
        feedback = state["optimizer"]["error_feedback"]
        assert (feedback["world_size"], feedback["rank"]) == (4, rank)
