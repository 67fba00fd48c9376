"""A small data-parallel problem on which LAMB and 1-bit LAMB are compared.

``train_toy`` runs inside each rank (see tests/helpers/distributed_harness.py). The problem:
regress a fixed random two-layer "teacher" network plus noise (so the loss has a floor of
noise variance and the optimizers can be compared by their final loss); each rank draws
its own batches, seeded by (rank, step), as data-parallel shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from onebit_bert.distributed import Communicator
from onebit_bert.optim import Lamb, OneBitLamb

NOISE_STD = 0.1


@dataclass
class ToyConfig:
    """Size of the smoke problem and the optimizers' settings."""

    steps: int = 1000
    freeze_step: int = 200  # 20 % warmup, as in the 1-bit LAMB recipes
    batch_per_rank: int = 32
    lr: float = 2e-2
    width: int = 64
    inputs: int = 16
    seed: int = 0


def _teacher(cfg: ToyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + cfg.seed)
    return torch.randn(cfg.inputs, 32, generator=g), torch.randn(32, 1, generator=g) / 4


def _batch(cfg: ToyConfig, teacher, rank: int, step: int, size: int):
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + (rank + 1) * 100_003 + step) % 2**31)
    x = torch.randn(size, cfg.inputs, generator=g)
    y = torch.tanh(x @ teacher[0] / cfg.inputs**0.5) @ teacher[1]
    return x, y + NOISE_STD * torch.randn(y.shape, generator=g)


def build_model(cfg: ToyConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(cfg.inputs, cfg.width), nn.Tanh(), nn.Linear(cfg.width, 1))


STRATEGY_TOY = ToyConfig(width=16, inputs=8, batch_per_rank=8)
"""The sync strategies' problem: small, so that a test runs dozens of local steps on 4 ranks."""


def toy_loss(model: nn.Module, rank: int, step: int, cfg: ToyConfig = STRATEGY_TOY):
    """The mean squared error of ``model`` on rank ``rank``'s batch of step ``step``."""
    x, y = _batch(cfg, _teacher(cfg), rank, step, cfg.batch_per_rank)
    return nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    """``model``'s parameters, detached, as one flat vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def diloco_inner(model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer the (Streaming) DiLoCo tests run: AdamW."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_toy(comm: Communicator, optimizer: str, cfg: ToyConfig) -> dict:
    """Train with ``optimizer`` ("lamb" or "onebit_lamb"); returns losses and traffic."""
    model = build_model(cfg)
    if optimizer == "lamb":
        opt = Lamb(model.parameters(), lr=cfg.lr)
    elif optimizer == "onebit_lamb":
        opt = OneBitLamb(model.parameters(), lr=cfg.lr, freeze_step=cfg.freeze_step, comm=comm)
    else:
        raise ValueError(f"optimizer must be 'lamb' or 'onebit_lamb', got {optimizer!r}")
    teacher = _teacher(cfg)
    bytes_by_stage: dict[str, list[int]] = {"warmup": [], "compression": []}
    for step in range(cfg.steps):
        x, y = _batch(cfg, teacher, comm.rank, step, cfg.batch_per_rank)
        for group in opt.param_groups:  # linear decay to zero, as BERT schedules end
            group["lr"] = cfg.lr * (1.0 - step / cfg.steps)
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        before = comm.snapshot()
        if not opt.syncs_internally:
            comm.all_reduce_coalesced([p.grad for p in model.parameters()], op="avg")
        opt.step()
        stage = getattr(opt, "stage", "warmup")
        bytes_by_stage[stage].append((comm.snapshot() - before).bytes_sent)
    x, y = _batch(cfg, teacher, rank=-1, step=-1, size=4096)
    with torch.no_grad():
        val_loss = nn.functional.mse_loss(model(x), y).item()
    return {
        "val_loss": val_loss,
        "bytes_per_step": {k: (sum(v) / len(v) if v else 0.0) for k, v in bytes_by_stage.items()},
        "params": [p.detach().clone() for p in model.parameters()],
    }
