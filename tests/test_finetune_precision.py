"""Fine-tuning in fp16 scales the loss: a step whose gradients overflow is skipped (the
weights stay finite) where an unscaled step would write NaN into them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from finetune.trainer import fit


class OverflowOnce(torch.nn.Module):
    """A linear classifier whose first loss is infinite."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, inputs, labels):
        self.calls += 1
        loss = torch.nn.functional.cross_entropy(self.linear(inputs).float(), labels)
        if self.calls == 1:
            loss = loss * float("inf")
        return SimpleNamespace(loss=loss)


def _fit(precision: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = OverflowOnce()
    features = {"inputs": torch.randn(64, 4), "labels": torch.randint(0, 2, (64,))}
    fit(
        model,
        features,
        lr=1e-2,
        epochs=1,
        batch_size=16,
        seed=0,
        device=torch.device("cpu"),
        precision=precision,
    )
    return model


def test_fp16_skips_the_overflowing_step_and_trains_on():
    model = _fit("fp16")
    assert model.calls == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_without_a_loss_scale_the_same_step_poisons_the_weights():
    model = _fit("fp32")
    assert not all(torch.isfinite(p).all() for p in model.parameters())
