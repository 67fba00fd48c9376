"""A pretraining run's checkpoint as saved (shared and per-rank state) and a comparison of
two states that must agree to the bit."""

from __future__ import annotations

import math

import torch


def load_checkpoint(run_dir, step: int) -> tuple[dict, list[dict]]:
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    ranks = sorted(folder.glob("rank*.pt"))
    return torch.load(folder / "shared.pt", weights_only=False), [
        torch.load(r, weights_only=False) for r in ranks
    ]


def assert_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def assert_same_checkpoints(
    run_a, run_b, steps, shared_keys, rank_keys, optional_rank_keys=()
) -> None:
    """The checkpoints of two runs at ``steps`` agree to the bit: ``shared_keys`` of the
    shared state and ``rank_keys`` of every rank's; ``optional_rank_keys`` may be missing
    from a rank's state, where they must be missing from the other run's too."""
    for step in steps:
        (shared_a, ranks_a), (shared_b, ranks_b) = (
            load_checkpoint(run_a, step),
            load_checkpoint(run_b, step),
        )
        for key in shared_keys:
            assert_equal(shared_a[key], shared_b[key], f"step {step}: {key}")
        for rank, (ra, rb) in enumerate(zip(ranks_a, ranks_b, strict=True)):
            for key in rank_keys:
                assert_equal(ra[key], rb[key], f"step {step}, rank {rank}: {key}")
            for key in optional_rank_keys:
                assert_equal(ra.get(key), rb.get(key), f"step {step}, rank {rank}: {key}")


def assert_same_local_step_runs(
    run_a,
    run_b,
    steps,
    shared_keys=("model", "local_steps"),
    logged=("loss", "val_mlm_loss", "outer_momentum_norm"),
) -> None:
    """Two runs of a local-step strategy agree to the bit: the ``shared_keys`` of their
    checkpoints at ``steps``, every rank's parameters and inner optimizer state, the steps
    they logged and the ``logged`` figures at each."""
    from onebit_bert.metrics_log import read_metrics

    assert_same_checkpoints(run_a, run_b, steps, shared_keys, ("params", "optimizer"))
    logs_a, logs_b = ({r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
                      for run in (run_a, run_b))  # fmt: skip
    assert sorted(logs_a) == sorted(logs_b)
    for step, record in logs_a.items():
        for key in logged:
            assert record.get(key) == logs_b[step].get(key), (step, key)
