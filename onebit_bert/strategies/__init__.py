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
from onebit_bert.distributed.policy import CommConfig, CommPolicy
from onebit_bert.optim.build import COMPRESSED_OPTIMIZERS, OptimizerConfig, build_optimizer
from onebit_bert.strategies.base import GradientSync, Strategy, StrategyConfig
from onebit_bert.strategies.data_parallel import (
    DataParallel,
    OneBitAdamStrategy,
    OneBitLambStrategy,
)
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
from onebit_bert.strategies.zero_one_adam import ZeroOneAdamStrategy

log = logging.getLogger(__name__)

__all__ = [
    "DECENTRALIZED_STRATEGIES",
    "LOCAL_STEP_STRATEGIES",
    "DataParallel",
    "Decentralized",
    "GradientSync",
    "LocalSteps",
    "OneBitAdamStrategy",
    "OneBitLambStrategy",
    "Strategy",
    "StrategyConfig",
    "ZeroOneAdamStrategy",
    "build_strategy",
    "check_comm_config",
    "resolve_strategy_name",
]

GRADIENT_AVERAGING = ("data_parallel", "onebit_lamb", "onebit_adam", "zero_one_adam")
"""Strategies that average full-precision gradients on some steps (comm.compression.grad)."""
MOMENTUM_COMPRESSING = ("onebit_lamb", "onebit_adam")
"""Strategies whose optimizer all-reduces its momentum (comm.compression.momentum)."""

SELF_SYNCING = {
    "onebit_lamb": OneBitLambStrategy,
    "onebit_adam": OneBitAdamStrategy,
    "zero_one_adam": ZeroOneAdamStrategy,
}
"""Strategy of each optimizer that communicates by itself (same name as the optimizer)."""


def resolve_strategy_name(cfg: StrategyConfig, optimizer: OptimizerConfig) -> str:
    """The strategy ``cfg.name`` means with this optimizer; a clear error for a pair that
    cannot work."""
    name = cfg.name
    if name == "auto":
        name = optimizer.name if optimizer.name in COMPRESSED_OPTIMIZERS else "data_parallel"
    if name in DECENTRALIZED_STRATEGIES:
        check_decentralized_config(name, cfg, optimizer.name)
        return name
    check_not_decentralized(name, cfg)
    if name in LOCAL_STEP_STRATEGIES:
        check_local_step_config(name, cfg, optimizer.name)
        return name
    if name in SELF_SYNCING and optimizer.name != name:
        raise ValueError(
            f"strategy.name {name} needs optimizer.name {name}, got {optimizer.name!r}; "
            f"set optimizer.name={name} or strategy.name=auto"
        )
    if name == "data_parallel" and optimizer.name in COMPRESSED_OPTIMIZERS:
        raise ValueError(
            f"optimizer.name {optimizer.name} compresses its own communication on some steps; "
            f"use strategy.name={optimizer.name} (or auto), not data_parallel"
        )
    return name


def check_comm_config(comm: CommConfig, name: str) -> None:
    """A clear error for a ``comm`` setting that strategy ``name`` (resolved) would
    ignore."""
    c = comm.compression
    rules = (
        (
            c.grad != "none",
            GRADIENT_AVERAGING,
            "comm.compression.grad",
            "averages no full-precision gradients",
        ),
        (
            not c.is_default("momentum"),
            MOMENTUM_COMPRESSING,
            "comm.compression.momentum",
            "has no compressed momentum all-reduce",
        ),
        (
            c.outer != "none",
            LOCAL_STEP_STRATEGIES,
            "comm.compression.outer",
            "has no outer parameter average",
        ),
        (
            c.neighbour != "none",
            DECENTRALIZED_STRATEGIES,
            "comm.compression.neighbour",
            "exchanges nothing with neighbours",
        ),
        (
            comm.hierarchy == "node",
            ("data_parallel", *MOMENTUM_COMPRESSING, *LOCAL_STEP_STRATEGIES),
            "comm.hierarchy node",
            "runs no gradient or momentum all-reduce it applies to and has no local steps "
            "to take per node",
        ),
        (
            comm.overlap,
            MOMENTUM_COMPRESSING,
            "comm.overlap",
            "has no compressed momentum all-reduce to overlap",
        ),
    )
    for active, strategies, what, why in rules:
        if active and name not in strategies:
            raise ValueError(
                f"{what} does not apply to strategy {name}, which {why}; it applies to "
                f"{', '.join(strategies)}"
            )


def build_strategy(
    cfg: StrategyConfig,
    optimizer_cfg: OptimizerConfig,
    model: nn.Module,
    loss_module: nn.Module,
    ctx: DistContext,
    momentum_masks: dict[str, torch.Tensor] | None = None,
    total_steps: int | None = None,
    comm_cfg: CommConfig | None = None,
) -> Strategy:
    """The configured strategy over ``model`` (forward passes run through ``loss_module``,
    which holds it), with its optimizer built from ``optimizer_cfg``; ``total_steps`` (the
    run's length) bounds ``optimizer.freeze_step: auto``; ``comm_cfg`` chooses the codec
    of each kind of traffic and the hierarchy (default: today's behaviour).

    1-bit LAMB on a world of one runs as exact LAMB with the same hyperparameters (no bias
    correction, as 1-bit LAMB has none) unless ``cfg.force_compression``; 1-bit Adam and
    0/1 Adam skip their compression there unless ``cfg.force_compression``.
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
    optimizer = build_optimizer(
        optimizer_cfg,
        model,
        ctx.comm,
        momentum_masks,
        total_steps=total_steps,
        force_compression=cfg.force_compression,
    )
    comm_cfg = comm_cfg or CommConfig()
    check_comm_config(comm_cfg, name)
    policy = None
    if not comm_cfg.is_default and ctx.world_size > 1:
        launch = ctx.launch
        policy = CommPolicy(comm_cfg, ctx.comm, launch.local_rank, launch.local_world_size)
    if name in LOCAL_STEP_STRATEGIES:
        return LocalSteps(model, loss_module, optimizer, ctx, cfg, name, policy)
    if name in DECENTRALIZED_STRATEGIES:
        bounds = (optimizer_cfg.min_coeff, optimizer_cfg.max_coeff)
        neighbour = comm_cfg.compression.neighbour
        return Decentralized(model, loss_module, optimizer, ctx, cfg, name, bounds, neighbour)
    grad_codec = None
    hierarchical = comm_cfg.hierarchy == "node"
    if policy is not None and (comm_cfg.compression.grad != "none" or hierarchical):
        grad_codec = policy.codec("grad")
    if (
        policy is not None
        and name in MOMENTUM_COMPRESSING
        and (not comm_cfg.compression.is_default("momentum") or hierarchical)
    ):
        optimizer.set_codec(policy.codec("momentum"))
    cls = SELF_SYNCING.get(name, DataParallel)
    strategy = cls(model, loss_module, optimizer, ctx, use_ddp=use_ddp, grad_codec=grad_codec)
    if comm_cfg.overlap and name in MOMENTUM_COMPRESSING and ctx.world_size > 1:
        strategy.enable_overlap(comm_cfg.bucket_mb)
    return strategy
