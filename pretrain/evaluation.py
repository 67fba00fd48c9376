"""What the pretraining loop measures of its model between steps: the validation metrics
(:func:`validate`) and whether the weights are still finite (:func:`weights_finite`), each
agreed by every rank in one all-reduce."""

from __future__ import annotations

import numpy as np
import torch

from onebit_bert.distributed.env import DistContext
from onebit_bert.precision import autocast
from onebit_bert.shards import PretrainingShards
from pretrain.config import PretrainConfig
from pretrain.data import TokenIds, make_batch, to_device
from pretrain.model import PretrainingLoss
from pretrain.records import STAT_KEYS


def validation_batch_count(cfg: PretrainConfig, n_rows: int, world_size: int) -> int:
    """How many validation micro-batches each of ``world_size`` ranks evaluates."""
    micro = cfg.batch.micro_batch_size
    return min(cfg.data.validation_batches, n_rows // (micro * world_size))


def validation_batch(
    rows: PretrainingShards,
    ids: TokenIds,
    cfg: PretrainConfig,
    index: int,
    rank: int,
    world_size: int,
) -> dict[str, np.ndarray]:
    """Rank ``rank``'s validation micro-batch ``index`` (of
    :func:`validation_batch_count`): the same rows and masks every time."""
    micro = cfg.batch.micro_batch_size
    k = index * world_size + rank
    indices = np.arange(k * micro, (k + 1) * micro)
    return make_batch(rows, indices, ids, cfg.data, seed=cfg.seed, step=-1, micro=k)


@torch.no_grad()
def validate(
    loss_module: PretrainingLoss,
    rows: PretrainingShards,
    ids: TokenIds,
    cfg: PretrainConfig,
    ctx: DistContext,
    precision: str,
) -> dict:
    """MLM and NSP accuracy of ``loss_module``'s model on a fixed slice of the validation
    split ``rows`` (the same masks every time), summed over ranks."""
    loss_module.eval()
    micro = cfg.batch.micro_batch_size
    totals = torch.zeros(len(STAT_KEYS), device=ctx.device, dtype=torch.float64)
    n_batches = validation_batch_count(cfg, len(rows), ctx.world_size)
    for b in range(n_batches):
        raw = validation_batch(rows, ids, cfg, b, ctx.rank, ctx.world_size)
        batch = to_device(raw, ctx.device)
        with autocast(precision, ctx.device):
            _, stats = loss_module(**batch)
        for i, key in enumerate(STAT_KEYS):
            if key in stats:
                totals[i] += stats[key].double()
    with ctx.comm.traffic("statistics"):
        ctx.comm.all_reduce(totals, op="sum")
    loss_module.train()
    s = dict(zip(STAT_KEYS, totals.tolist(), strict=True))
    out = {
        "val_mlm_loss": s["mlm_loss_sum"] / max(s["mlm_tokens"], 1),
        "val_mlm_accuracy": s["mlm_correct"] / max(s["mlm_tokens"], 1),
        "val_sequences": n_batches * micro * ctx.world_size,
    }
    if s["nsp_examples"]:
        out["val_nsp_accuracy"] = s["nsp_correct"] / s["nsp_examples"]
        out["val_nsp_loss"] = s["nsp_loss_sum"] / s["nsp_examples"]
    return out


def weights_finite(model: torch.nn.Module, ctx: DistContext) -> bool:
    """Whether ``model``'s weights are finite on every rank (collective)."""
    finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
    flag = finite.to(torch.float32).reshape(1).to(ctx.device)
    with ctx.comm.traffic("statistics"):
        ctx.comm.all_reduce(flag, op="min")
    return flag.item() == 1.0
