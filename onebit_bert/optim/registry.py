"""The optimizer registry: one :class:`OptimizerSpec` per ``optimizer.name``.

An entry says whether the optimizer communicates by itself (``compressed``: it averages
across ranks on some steps, so it needs the strategy of ``default_strategy``), whether it
has a full-precision warmup that ends at ``freeze_step`` (``freezes``), and how to build it.
The built-in entries are in :mod:`onebit_bert.optim.build`; the optional attributes the
strategies read are :class:`~onebit_bert.optim.surface.ReportingOptimizer` and
:class:`~onebit_bert.optim.surface.SelfSyncingOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onebit_bert.registry import Registry


@dataclass(frozen=True)
class OptimizerBuild:
    """What every optimizer's ``build`` gets."""

    cfg: Any
    """The :class:`~onebit_bert.optim.build.OptimizerConfig`."""
    groups: list[dict]
    """Parameter groups (weight decay on matrices and embeddings only)."""
    comm: Any
    """The communicator (compressed optimizers all-reduce through it)."""
    total_steps: int | None
    """The run's length (bounds ``freeze_step: auto``)."""
    force_compression: bool
    """Compress even on a world of one."""


@dataclass(frozen=True)
class OptimizerSpec:
    """One registered optimizer."""

    name: str
    build: Callable[[OptimizerBuild], Any]
    summary: str
    compressed: bool = False
    """Averages across ranks by itself on some steps (needs its own strategy)."""
    freezes: bool = False
    """Has a full-precision warmup that ends at ``freeze_step`` (or ``auto``)."""
    default_strategy: str = "data_parallel"
    """The strategy ``strategy.name: auto`` picks for it."""


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", key="optimizer.name")
"""Every registered optimizer by name, in registration order."""


def register_optimizer(spec: OptimizerSpec, replace: bool = False) -> OptimizerSpec:
    """Add ``spec`` to :data:`OPTIMIZERS` (``replace``: over an entry of the same name)."""
    return OPTIMIZERS.register(spec, replace)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The entry for ``name``; a clear error naming the registered optimizers."""
    return OPTIMIZERS.get(name)


def compressed_optimizers() -> tuple[str, ...]:
    """The optimizers that communicate by themselves."""
    return OPTIMIZERS.names(lambda spec: spec.compressed)


def freezing_optimizers() -> tuple[str, ...]:
    """The optimizers with a ``freeze_step``."""
    return OPTIMIZERS.names(lambda spec: spec.freezes)
