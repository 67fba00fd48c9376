"""The fine-tuning loop (HF ``Trainer``): each step's loss as it was, precision checked
before training, and fp16's loss scale (on CUDA: tests/test_gpu.py)."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.trainer import fit
from tests.helpers.loss_scaling import OverflowOnce, fit_overflow_once


def test_fp16_and_bf16_are_refused_on_the_cpu_before_training():
    for precision in ("fp16", "bf16"):
        model = OverflowOnce()
        with pytest.raises(ValueError, match=f"precision {precision} needs a GPU"):
            fit_overflow_once(model, precision, torch.device("cpu"))
        assert model.calls == 0


def test_the_losses_are_every_steps_own_and_a_nan_stays_a_nan():
    """fp32 has no loss scale: the infinite first loss reaches the weights (what fp16's
    scale prevents), and the losses say so instead of being filtered."""
    model = OverflowOnce()
    losses = fit_overflow_once(model, "fp32", torch.device("cpu"))
    assert model.calls == len(losses) == 4  # 64 rows, batch 16, one epoch
    assert math.isinf(losses[0])
    assert all(math.isnan(x) for x in losses[1:])
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fractional_epoch_count_takes_its_steps_and_reshuffles():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    seen: list[torch.Tensor] = []

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = model

        def forward(self, inputs, labels):
            seen.append(inputs[:, 0].clone())
            return {"loss": torch.nn.functional.cross_entropy(self.linear(inputs), labels)}

    features = {"inputs": torch.randn(40, 4), "labels": torch.randint(0, 2, (40,))}
    losses = fit(
        Classifier(),
        features,
        lr=0.1,
        epochs=1.5,
        batch_size=8,
        seed=3,
        device=torch.device("cpu"),
        precision="fp32",
    )
    assert len(losses) == len(seen) == 8  # ceil(1.5 * 5)
    assert all(math.isfinite(x) for x in losses)
    first_epoch = torch.cat(seen[:5])
    assert sorted(first_epoch.tolist()) == sorted(features["inputs"][:, 0].tolist())
    assert not torch.equal(first_epoch, features["inputs"][:, 0])  # shuffled
