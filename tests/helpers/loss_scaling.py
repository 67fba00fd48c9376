"""fp16 loss scaling across ranks: an overflow on one rank only."""

from __future__ import annotations

import torch

from onebit_bert.precision import LossScaler


def overflow_on_rank_one(comm):
    scaler = LossScaler("fp16", comm, init_scale=1024.0)
    p = torch.nn.Parameter(torch.ones(4, device=comm.device))
    p.grad = torch.full((4,), 2048.0, device=comm.device)
    if comm.rank == 1:
        p.grad[2] = float("inf")
    ok = scaler.unscale_and_check([p])
    scaler.update(ok)
    return ok, scaler.scale, scaler.skipped_steps


class OverflowOnce(torch.nn.Module):
    """A linear classifier whose first loss is infinite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, inputs, labels):
        self.calls += 1
        loss = torch.nn.functional.cross_entropy(self.linear(inputs).float(), labels)
        if self.calls == 1:
            loss = loss * float("inf")
        return {"loss": loss}


def fit_overflow_once(model: OverflowOnce, precision: str, device: torch.device) -> list[float]:
    """One epoch of 64 rows in batches of 16 (4 steps) of the fine-tuning loop."""
    from finetune.trainer import fit

    gen = torch.Generator().manual_seed(0)
    features = {
        "inputs": torch.randn(64, 4, generator=gen),
        "labels": torch.randint(0, 2, (64,), generator=gen),
    }
    return fit(
        model.to(device),
        features,
        lr=1e-2,
        epochs=1,
        batch_size=16,
        seed=0,
        device=device,
        precision=precision,
    )
