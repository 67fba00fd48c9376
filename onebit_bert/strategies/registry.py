"""The strategy registry: one :class:`StrategySpec` per ``strategy.name``.

An entry says everything the rest of the harness needs to know about a strategy without
importing its module: which optimizers it runs with, which ``strategy.*`` fields it reads,
which kinds of traffic it sends (the ``comm.compression.*`` keys that apply to it), whether
``comm.hierarchy: node`` and ``comm.overlap`` apply, and one ``build`` function that always
gets the same :class:`BuildArgs`. Config checks, :func:`~onebit_bert.strategies.build_strategy`,
the benchmarks and the reports read this table instead of keeping name lists of their own.

Adding a strategy: a module with a :class:`~onebit_bert.strategies.base.Strategy` subclass
that registers its entry with one :func:`register_strategy` call (each built-in module
registers its own); docs/guide/development.md has the checklist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onebit_bert.distributed.traffic import COMPRESSIBLE_KEYS
from onebit_bert.registry import Registry
from onebit_bert.strategies.base import Strategy, StrategyConfig

if TYPE_CHECKING:
    from torch import nn

    from onebit_bert.distributed.env import DistContext
    from onebit_bert.distributed.policy import CommConfig, CommPolicy
    from onebit_bert.optim.build import OptimizerConfig

_LACKS = {
    "grad": "averages no full-precision gradients",
    "momentum": "has no compressed momentum all-reduce",
    "outer": "has no outer parameter average",
    "neighbour": "exchanges nothing with neighbours",
}

TRAFFIC_KINDS = {key: _LACKS.get(key, f"sends no {key} traffic") for key in COMPRESSIBLE_KEYS}
"""The kinds of traffic a strategy may send, as named by ``comm.compression.*``
(:data:`~onebit_bert.distributed.traffic.COMPRESSIBLE_KEYS`), each with what a strategy
that does not send it lacks (for the error that refuses its codec)."""

COMMON_FIELDS = ("name", "grad_sync", "force_compression")
"""``strategy.*`` fields every strategy accepts."""


@dataclass(frozen=True)
class BuildArgs:
    """What every strategy's ``build`` gets."""

    name: str
    """The resolved strategy name (never ``auto``)."""
    cfg: StrategyConfig
    optimizer_cfg: OptimizerConfig
    model: nn.Module
    """The bare network."""
    loss_module: nn.Module
    """What forward passes run through (holds ``model``)."""
    optimizer: Any
    """The optimizer built from ``optimizer_cfg``."""
    ctx: DistContext
    comm: CommConfig
    policy: CommPolicy | None
    """The codec of each kind of traffic; None on a world of one (nothing is sent)."""
    use_ddp: bool
    """Gradients averaged by DistributedDataParallel's hooks (``strategy.grad_sync``)."""
    clip_grad_norm: float = 0.0
    """The loop's gradient clipping (0: none)."""


@dataclass(frozen=True)
class StrategySpec:
    """One registered strategy."""

    name: str
    build: Callable[[BuildArgs], Strategy]
    summary: str
    """One line for listings and error messages."""
    family: str
    """The guide page that describes it (data_parallel, local_steps, decentralized, ...)."""
    optimizers: tuple[str, ...] | None = None
    """The ``optimizer.name`` values it runs with; None: any optimizer that does not
    communicate by itself."""
    optimizer_hint: str = ""
    """Appended to the error for an optimizer it does not run with."""
    fields: tuple[str, ...] = ()
    """The ``strategy.*`` fields it reads besides :data:`COMMON_FIELDS`; any other field
    set away from its default is refused."""
    traffic: tuple[str, ...] = ()
    """The kinds of traffic (:data:`TRAFFIC_KINDS`) whose codec ``comm.compression`` sets."""
    hierarchy: bool = False
    """Whether ``comm.hierarchy: node`` applies."""
    overlap: bool = False
    """Whether ``comm.overlap`` applies."""
    check: Callable[[str, StrategyConfig, str], None] | None = None
    """Further checks of (name, strategy config, optimizer name): value rules the field
    list cannot say."""
    variant: Any = None
    """What the strategy's class makes of this entry, where one class serves several
    (the outer step of a local-step strategy, the update rule of a decentralised one);
    the class documents its type."""

    def __post_init__(self):
        unknown = sorted(set(self.traffic) - set(TRAFFIC_KINDS))
        if unknown:
            raise ValueError(
                f"strategy {self.name}: unknown traffic kind(s) {unknown}; "
                f"the kinds are {', '.join(TRAFFIC_KINDS)}"
            )
        known = {f.name for f in dataclasses.fields(StrategyConfig)}
        bad = sorted(set(self.fields) - known)
        if bad:
            raise ValueError(
                f"strategy {self.name}: {bad} are not fields of StrategyConfig; add them "
                f"there (with a docstring) before a strategy can read them"
            )


STRATEGIES: Registry[StrategySpec] = Registry(
    "strategy",
    reserved={"auto": "it picks a strategy by optimizer"},
    extra_choices=("auto",),
)
"""Every registered strategy by name, in registration order."""


def register_strategy(spec: StrategySpec, replace: bool = False) -> StrategySpec:
    """Add ``spec`` to :data:`STRATEGIES` (``replace``: over an entry of the same name)."""
    return STRATEGIES.register(spec, replace)


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (tests that register a toy one)."""
    STRATEGIES.unregister(name)


def strategy_spec(name: str) -> StrategySpec:
    """The entry for ``name``; a clear error naming the registered strategies."""
    return STRATEGIES.get(name)


def names_with(predicate: Callable[[StrategySpec], bool]) -> tuple[str, ...]:
    """The registered strategy names whose entry satisfies ``predicate``."""
    return STRATEGIES.names(predicate)


def family(name: str) -> tuple[str, ...]:
    """The registered strategies of family ``name``."""
    return names_with(lambda spec: spec.family == name)


def variant_of(name: str, kind: type) -> Any:
    """The ``variant`` of strategy ``name``, which must be a ``kind`` (the class that
    serves it checks it was registered for it)."""
    variant = strategy_spec(name).variant
    if not isinstance(variant, kind):
        raise ValueError(
            f"strategy {name} is not registered with a {kind.__name__} variant, so this "
            f"class cannot run it; register it with variant={kind.__name__}(...)"
        )
    return variant


def check_fields(spec: StrategySpec, cfg: StrategyConfig) -> None:
    """Refuse a ``strategy.*`` field set away from its default that ``spec`` does not read."""
    read = set(COMMON_FIELDS) | set(spec.fields)
    for field in dataclasses.fields(StrategyConfig):
        if field.name in read:
            continue
        if getattr(cfg, field.name) != field.default:
            users = names_with(lambda s, f=field.name: f in s.fields)
            where = f"; it applies to {', '.join(users)}" if users else ""
            raise ValueError(f"strategy.{field.name} does not apply to strategy {spec.name}{where}")
