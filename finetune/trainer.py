"""The fine-tuning loop shared by every task: AdamW, linear warmup and decay, clipping,
mixed precision on GPUs (bf16, or fp16 with a dynamic loss scale that skips steps whose
gradients overflow); and batched prediction."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from onebit_bert.distributed import Communicator
from onebit_bert.optim.build import weight_decay_groups
from onebit_bert.precision import LossScaler, autocast


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batches(features: dict[str, torch.Tensor], batch_size: int, order: np.ndarray):
    for start in range(0, len(order), batch_size):
        index = torch.from_numpy(order[start : start + batch_size])
        yield {k: v[index] for k, v in features.items()}


def fit(
    model: torch.nn.Module,
    features: dict[str, torch.Tensor],
    *,
    lr: float,
    epochs: float,
    batch_size: int,
    seed: int,
    device: torch.device,
    precision: str,
    weight_decay: float = 0.01,
    warmup_proportion: float = 0.1,
    max_grad_norm: float = 1.0,
) -> list[float]:
    """Train ``model`` (its forward returns ``.loss`` given the features' label keys);
    returns the loss of every step. With fp16 the loss is scaled; a step whose gradients
    are not finite is skipped and the scale halved (the schedule still advances)."""
    n = len(next(iter(features.values())))
    steps_per_epoch = math.ceil(n / batch_size)
    total = max(1, math.ceil(steps_per_epoch * epochs))
    warmup = int(warmup_proportion * total)
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model.named_parameters(), weight_decay),
        lr=lr,
        betas=(0.9, 0.999),
        eps=1e-6,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
        ),
    )
    scaler = LossScaler(precision, Communicator(None, device=device))
    params = [p for p in model.parameters() if p.requires_grad]
    rng = np.random.default_rng(seed)
    model.train()
    losses: list[float] = []
    step = 0
    while step < total:
        for batch in _batches(features, batch_size, rng.permutation(n)):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(precision, device):
                loss = model(**batch).loss
            scaler.scaled(loss).backward()
            ok = scaler.unscale_and_check(params)
            if ok:
                if max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
            scaler.update(ok)
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
            if step >= total:
                break
    return losses


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    features: dict[str, torch.Tensor],
    batch_size: int,
    device: torch.device,
    precision: str,
    outputs: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The named model outputs (e.g. ``logits``) for every feature row, in order."""
    model.eval()
    n = len(next(iter(features.values())))
    collected: dict[str, list[np.ndarray]] = {name: [] for name in outputs}
    for batch in _batches(features, batch_size, np.arange(n)):
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(precision, device):
            result = model(**batch)
        for name in outputs:
            collected[name].append(getattr(result, name).float().cpu().numpy())
    return {name: np.concatenate(parts) for name, parts in collected.items()}
