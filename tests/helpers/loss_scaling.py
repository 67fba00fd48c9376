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
