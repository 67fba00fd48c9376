"""Sync strategies: how data-parallel ranks stay in agreement, behind one interface the
training loop calls (:class:`Strategy`; its module docstring lists the hooks).

:func:`build_strategy` turns the ``strategy`` and ``optimizer`` config sections into one.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from onebit_bert.distributed.env import DistContext
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from onebit_bert.strategies.base import Strategy, StrategyConfig
from onebit_bert.strategies.data_parallel import DataParallel, OneBitLambStrategy
from onebit_bert.strategies.decentralized import (
    DECENTRALIZED_STRATEGIES,
    Decentralized,
    check_decentralized_config,
    check_not_decentralized,
)
from onebit_bert.strategies.local_steps import (
    LOCAL_STEP_STRATEGIES,
    LocalSteps,
    check_local_step_config,
)

log = logging.getLogger(__name__)

__all__ = [
    "DECENTRALIZED_STRATEGIES",
    "LOCAL_STEP_STRATEGIES",
    "DataParallel",
    "Decentralized",
    "LocalSteps",
    "OneBitLambStrategy",
    "Strategy",
    "StrategyConfig",
    "build_strategy",
    "resolve_strategy_name",
]


def resolve_strategy_name(cfg: StrategyConfig, optimizer: OptimizerConfig) -> str:
    """The strategy ``cfg.name`` means with this optimizer; a clear error for a pair that
    cannot work."""
    name = cfg.name
    if name == "auto":
        name = "onebit_lamb" if optimizer.name == "onebit_lamb" else "data_parallel"
    if name in DECENTRALIZED_STRATEGIES:
        check_decentralized_config(name, cfg, optimizer.name)
        return name
    check_not_decentralized(name, cfg)
    if name in LOCAL_STEP_STRATEGIES:
        check_local_step_config(name, cfg, optimizer.name)
        return name
    if name == "onebit_lamb" and optimizer.name != "onebit_lamb":
        raise ValueError(
            f"strategy.name onebit_lamb needs optimizer.name onebit_lamb, got "
            f"{optimizer.name!r}; set optimizer.name=onebit_lamb or strategy.name=auto"
        )
    if name == "data_parallel" and optimizer.name == "onebit_lamb":
        raise ValueError(
            "optimizer.name onebit_lamb compresses its own communication after freeze_step; "
            "use strategy.name=onebit_lamb (or auto), not data_parallel"
        )
    return name


def build_strategy(
    cfg: StrategyConfig,
    optimizer_cfg: OptimizerConfig,
    model: nn.Module,
    loss_module: nn.Module,
    ctx: DistContext,
    momentum_masks: dict[str, torch.Tensor] | None = None,
) -> Strategy:
    """The configured strategy over ``model`` (forward passes run through ``loss_module``,
    which holds it), with its optimizer built from ``optimizer_cfg``.

    1-bit LAMB on a world of one runs as exact LAMB with the same hyperparameters (no bias
    correction, as 1-bit LAMB has none) unless ``cfg.force_compression``.
    """
    name = resolve_strategy_name(cfg, optimizer_cfg)
    use_ddp = cfg.grad_sync == "ddp" or (cfg.grad_sync == "auto" and ctx.device.type == "cuda")
    if name == "onebit_lamb" and ctx.world_size == 1 and not cfg.force_compression:
        log.info(
            "1-bit LAMB on one process runs as exact LAMB (nothing to compress); "
            "strategy.force_compression=true compresses anyway"
        )
        optimizer_cfg = replace(optimizer_cfg, name="lamb", bias_correction=False)
        name = "data_parallel"
    optimizer = build_optimizer(optimizer_cfg, model, ctx.comm, momentum_masks)
    if name in LOCAL_STEP_STRATEGIES:
        return LocalSteps(model, loss_module, optimizer, ctx, cfg, name)
    if name in DECENTRALIZED_STRATEGIES:
        bounds = (optimizer_cfg.min_coeff, optimizer_cfg.max_coeff)
        return Decentralized(model, loss_module, optimizer, ctx, cfg, name, bounds)
    cls = OneBitLambStrategy if name == "onebit_lamb" else DataParallel
    return cls(model, loss_module, optimizer, ctx, use_ddp=use_ddp)
