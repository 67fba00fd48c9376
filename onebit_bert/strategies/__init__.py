"""Sync strategies: how data-parallel ranks stay in agreement, behind one interface the
training loop calls (:class:`Strategy`; its module docstring lists the hooks).

Every strategy is an entry of the registry (:mod:`onebit_bert.strategies.registry`),
registered by the module of its class (importing this package imports them all).
:func:`build_strategy` turns the ``strategy`` and ``optimizer`` config sections into one.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from onebit_bert.distributed.env import DistContext
from onebit_bert.distributed.policy import CommConfig, CommPolicy
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from onebit_bert.optim.registry import optimizer_spec
from onebit_bert.strategies.base import GradientSync, Strategy, StrategyConfig
from onebit_bert.strategies.data_parallel import (
    DataParallel,
    OneBitAdamStrategy,
    OneBitLambStrategy,
)
from onebit_bert.strategies.decentralized import Decentralized
from onebit_bert.strategies.local_steps import LocalSteps
from onebit_bert.strategies.registry import (
    STRATEGIES,
    TRAFFIC_KINDS,
    BuildArgs,
    StrategySpec,
    check_fields,
    family,
    names_with,
    register_strategy,
    strategy_spec,
)
from onebit_bert.strategies.streaming import StreamingDiLoCo
from onebit_bert.strategies.zero_one_adam import ZeroOneAdamStrategy

log = logging.getLogger(__name__)

__all__ = [
    "STRATEGIES",
    "BuildArgs",
    "DataParallel",
    "Decentralized",
    "GradientSync",
    "LocalSteps",
    "StreamingDiLoCo",
    "OneBitAdamStrategy",
    "OneBitLambStrategy",
    "Strategy",
    "StrategyConfig",
    "StrategySpec",
    "ZeroOneAdamStrategy",
    "build_strategy",
    "check_comm_config",
    "family",
    "register_strategy",
    "resolve_strategy_name",
    "strategy_spec",
]


# ---------------------------------------------------------------------- checks
def resolve_strategy_name(cfg: StrategyConfig, optimizer: OptimizerConfig) -> str:
    """The strategy ``cfg.name`` means with this optimizer; a clear error for a pair that
    cannot work or a ``strategy.*`` field the strategy would ignore."""
    name = cfg.name
    if name == "auto":
        name = optimizer_spec(optimizer.name).default_strategy
    spec = strategy_spec(name)
    if spec.optimizers is None:
        if optimizer_spec(optimizer.name).compressed:
            raise ValueError(
                f"optimizer.name {optimizer.name} compresses its own communication on some "
                f"steps; use strategy.name={optimizer.name} (or auto), not {name}"
            )
    elif optimizer.name not in spec.optimizers:
        alternatives = " or ".join(spec.optimizers)
        hint = f" ({spec.optimizer_hint})" if spec.optimizer_hint else ""
        raise ValueError(
            f"strategy.name {name} needs optimizer.name {alternatives} (got "
            f"{optimizer.name!r}): set optimizer.name to {alternatives}{hint}"
        )
    check_fields(spec, cfg)
    if spec.check is not None:
        spec.check(name, cfg, optimizer.name)
    return name


def check_comm_config(comm: CommConfig, name: str) -> None:
    """A clear error for a ``comm`` setting that strategy ``name`` (resolved) would
    ignore."""
    spec = strategy_spec(name)
    c = comm.compression
    for kind, why in TRAFFIC_KINDS.items():
        if not c.is_default(kind) and kind not in spec.traffic:
            users = names_with(lambda s, k=kind: k in s.traffic)
            raise ValueError(
                f"comm.compression.{kind} does not apply to strategy {name}, which {why}; "
                f"it applies to {', '.join(users)}"
            )
    if comm.hierarchy == "node" and not spec.hierarchy:
        raise ValueError(
            f"comm.hierarchy node does not apply to strategy {name}, which runs no gradient "
            f"or momentum all-reduce it applies to and has no local steps to take per node; "
            f"it applies to {', '.join(names_with(lambda s: s.hierarchy))}"
        )
    if comm.overlap and not spec.overlap:
        raise ValueError(
            f"comm.overlap does not apply to strategy {name}, which has no compressed "
            f"momentum all-reduce to overlap; it applies to "
            f"{', '.join(names_with(lambda s: s.overlap))}"
        )


# ---------------------------------------------------------------------- building
def build_strategy(
    cfg: StrategyConfig,
    optimizer_cfg: OptimizerConfig,
    model: nn.Module,
    loss_module: nn.Module,
    ctx: DistContext,
    momentum_masks: dict[str, torch.Tensor] | None = None,
    total_steps: int | None = None,
    comm_cfg: CommConfig | None = None,
    clip_grad_norm: float = 0.0,
) -> Strategy:
    """The configured strategy over ``model`` (forward passes run through ``loss_module``,
    which holds it), with its optimizer built from ``optimizer_cfg``; ``total_steps`` (the
    run's length) bounds ``optimizer.freeze_step: auto``; ``comm_cfg`` chooses the codec
    of each kind of traffic and the hierarchy (default: today's behaviour);
    ``clip_grad_norm`` is the loop's (steps whose gradients the optimizer folds during the
    backward pass clip them by it themselves).

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
    if ctx.world_size > 1:
        launch = ctx.launch
        policy = CommPolicy(comm_cfg, ctx.comm, launch.local_rank, launch.local_world_size)
    args = BuildArgs(
        name=name,
        cfg=cfg,
        optimizer_cfg=optimizer_cfg,
        model=model,
        loss_module=loss_module,
        optimizer=optimizer,
        ctx=ctx,
        comm=comm_cfg,
        policy=policy,
        use_ddp=use_ddp,
        clip_grad_norm=clip_grad_norm,
    )
    return strategy_spec(name).build(args)
