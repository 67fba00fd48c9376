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
