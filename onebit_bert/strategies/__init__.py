"""Sync strategies: how data-parallel ranks stay in agreement, behind one interface the
training loop calls (:class:`Strategy`; its module docstring lists the hooks).

Every strategy is an entry of the registry (:mod:`onebit_bert.strategies.registry`); the
built-in entries are below. :func:`build_strategy` turns the ``strategy`` and ``optimizer``
config sections into one.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

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
from onebit_bert.strategies.local_steps import LocalSteps, check_local_step_config
from onebit_bert.strategies.registry import (
    STRATEGIES,
    BuildArgs,
    StrategySpec,
    check_fields,
    family,
    names_with,
    register_strategy,
    strategy_spec,
)
from onebit_bert.strategies.streaming import StreamingDiLoCo, check_streaming_config
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


# ---------------------------------------------------------------------- builders
def _grad_codec(args: BuildArgs):
    """The codec of the gradient average (the plain fp32 all-reduce by default); None on
    a world of one."""
    return args.policy.codec("grad") if args.policy is not None else None


def _averaging(cls: type[DataParallel]):
    """Build function of a strategy that averages gradients (on every step, or on the
    steps its optimizer asks for) and, for 1-bit LAMB and 1-bit Adam, lets the optimizer
    all-reduce its momentum through the policy's codec."""

    def build(args: BuildArgs) -> Strategy:
        comm = args.comm
        spec = strategy_spec(args.name)
        if (
            args.policy is not None
            and "momentum" in spec.traffic
            and (not comm.compression.is_default("momentum") or comm.hierarchy == "node")
        ):
            args.optimizer.set_codec(args.policy.codec("momentum"))
        strategy = cls(
            args.model,
            args.loss_module,
            args.optimizer,
            args.ctx,
            use_ddp=args.use_ddp,
            grad_codec=_grad_codec(args),
        )
        if comm.overlap and spec.overlap and args.ctx.world_size > 1:
            strategy.enable_overlap(comm.bucket_mb, args.clip_grad_norm)
        return strategy

    return build


def _local_steps(args: BuildArgs) -> Strategy:
    return LocalSteps(
        args.model, args.loss_module, args.optimizer, args.ctx, args.cfg, args.name, args.policy
    )


def _streaming(args: BuildArgs) -> Strategy:
    return StreamingDiLoCo(
        args.model, args.loss_module, args.optimizer, args.ctx, args.cfg, args.policy
    )


def _check_streaming(name: str, cfg: StrategyConfig, optimizer_name: str) -> None:
    check_local_step_config(name, cfg, optimizer_name)
    check_streaming_config(cfg)


def _decentralized(args: BuildArgs) -> Strategy:
    bounds = (args.optimizer_cfg.min_coeff, args.optimizer_cfg.max_coeff)
    return Decentralized(
        args.model,
        args.loss_module,
        args.optimizer,
        args.ctx,
        args.cfg,
        args.name,
        bounds,
        args.comm.compression.neighbour,
    )


# ---------------------------------------------------------------------- built-in entries
_OUTER = ("outer_every", "outer_lr", "outer_momentum", "inner_state", "asynchronous")
_DECENTRALIZED = ("topology", "layerwise", "consensus_every")
_INNER_OPTIMIZERS = ("lamb", "adamw")
_INNER_HINT = "it steps each rank with its own inner optimizer"
_SGD_HINT = (
    "it builds its own momentum-SGD update (momentum optimizer.betas[0], optimizer.lr, "
    "optimizer.weight_decay); for LAMB-style per-layer scaling add strategy.layerwise=lamb"
)


_AUTO_HINT = "or strategy.name=auto"


# Keys a family's entries share; each entry adds its name, summary and what differs.
_self_syncing = partial(
    StrategySpec, family="data_parallel", optimizer_hint=_AUTO_HINT, hierarchy=True
)
_local = partial(
    StrategySpec,
    build=_local_steps,
    family="local_steps",
    optimizers=_INNER_OPTIMIZERS,
    optimizer_hint=_INNER_HINT,
    traffic=("outer",),
    hierarchy=True,
    check=check_local_step_config,
)
_gossip = partial(
    StrategySpec,
    build=_decentralized,
    family="decentralized",
    optimizers=("sgd",),
    optimizer_hint=_SGD_HINT,
    fields=_DECENTRALIZED,
    traffic=("neighbour",),
)

for _spec in (
    StrategySpec(
        "data_parallel",
        _averaging(DataParallel),
        "average full-precision gradients every step, then step the optimizer",
        family="data_parallel",
        traffic=("grad",),
        hierarchy=True,
    ),
    _self_syncing(
        name="onebit_lamb",
        build=_averaging(OneBitLambStrategy),
        summary="1-bit LAMB: averaged gradients in the warmup, then its compressed momentum",
        optimizers=("onebit_lamb",),
        traffic=("grad", "momentum"),
        overlap=True,
    ),
    _self_syncing(
        name="onebit_adam",
        build=_averaging(OneBitAdamStrategy),
        summary="1-bit Adam: averaged gradients in the warmup, then its compressed momentum",
        optimizers=("onebit_adam",),
        traffic=("grad", "momentum"),
        overlap=True,
    ),
    _self_syncing(
        name="zero_one_adam",
        build=_averaging(ZeroOneAdamStrategy),
        summary="0/1 Adam: averaged gradients on variance steps, 1-bit ones and local steps else",
        optimizers=("zero_one_adam",),
        traffic=("grad", "momentum"),
        hierarchy=False,
    ),
    _local(
        name="co2",
        summary="local steps; the round's average enters one round late (CO2)",
        fields=(*_OUTER, "gap_penalty", "clip_threshold", "clip_mode"),
    ),
    _local(
        name="slowmo",
        summary="local steps, a synchronous average and a slow momentum step (SlowMo)",
        fields=_OUTER,
    ),
    _local(
        name="local_sgd",
        summary="local steps and a synchronous parameter average (slowmo without momentum)",
        fields=_OUTER,
    ),
    _local(
        name="diloco",
        summary="local steps, then outer SGD with Nesterov momentum on the pseudo-gradient "
        "(DiLoCo)",
        fields=(*_OUTER, "nesterov", "outer_weight_decay"),
    ),
    _local(
        name="streaming_diloco",
        build=_streaming,
        summary="DiLoCo synchronised one parameter fragment at a time, each average "
        "overlapped with the next inner steps (Streaming DiLoCo)",
        fields=(
            *_OUTER,
            "nesterov",
            "outer_weight_decay",
            "fragments",
            "fragment_sync_delay",
            "fragment_mix",
        ),  # fmt: skip
        check=_check_streaming,
    ),
    _gossip(
        name="decentlam",
        summary="decentralised: momentum on the gossip-induced gradient (DecentLaM)",
    ),
    _gossip(
        name="dmsgd",
        summary="decentralised: own momentum step, then the neighbour average (DmSGD)",
    ),
):
    register_strategy(_spec)


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


_TRAFFIC_WHY = {
    "grad": "averages no full-precision gradients",
    "momentum": "has no compressed momentum all-reduce",
    "outer": "has no outer parameter average",
    "neighbour": "exchanges nothing with neighbours",
}


def check_comm_config(comm: CommConfig, name: str) -> None:
    """A clear error for a ``comm`` setting that strategy ``name`` (resolved) would
    ignore."""
    spec = strategy_spec(name)
    c = comm.compression
    for kind, why in _TRAFFIC_WHY.items():
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
