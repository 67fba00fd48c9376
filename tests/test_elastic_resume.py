"""Resuming on another number of processes: LAMB continues its trajectory; 1-bit LAMB
from two processes onto one is refused with a message that names the world sizes."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_ranks
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
def test_lamb_resumed_on_one_process_continues_the_two_process_trajectory(tiny_corpus, tmp_path):
    reference = tmp_path / "reference"
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, reference, 6))
    resumed = tmp_path / "resumed"
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, resumed, 6, stop_after=3))
    with pytest.warns(UserWarning, match="different world size"):
        run_ranks(train_in_process, 1, _cfg(tiny_corpus, resumed, 6))
    want, got = mlm_losses(reference), mlm_losses(resumed)
    assert len(want) == len(got) == 6
    assert got[:3] == want[:3]
    # the same global batches; only the order of the gradient sum differs
    torch.testing.assert_close(got[3:], want[3:], rtol=1e-4, atol=0)


def test_onebit_lamb_from_two_processes_onto_one_names_the_world_sizes(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    onebit = {"optimizer.name": "onebit_lamb"}
    run_ranks(train_in_process, 2, _cfg(tiny_corpus, run_dir, 6, stop_after=3, **onebit))
    with pytest.raises(ValueError, match="written on 2 processes.*on 1 process.*force_compression"):
        run_ranks(train_in_process, 1, _cfg(tiny_corpus, run_dir, 6, **onebit))
