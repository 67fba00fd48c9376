"""The recipe registry: the named ways to pretrain that the benchmark, the experiment configs
and the reports compare.

A recipe is an optimizer, a strategy and the communication settings that make it what it
is (``hybrid_onebit_lamb`` is 1-bit LAMB whose warmup gradients travel in int8). It is not
a tuning: learning rates, schedules and a strategy's knobs stay in the configs, and the
recipe's ``search_space`` says which of them the comparison may tune and over which values.

Who reads it:

- an experiment run names its recipe (``recipe: co2``); the orchestrator turns it into the
  pretraining overrides of :meth:`Recipe.overrides` and records the name in the config;
- the pretraining stage records the recipe of every run (``recipe`` in its saved config and
  in ``status.json``): the one named, checked against the config, or the registered recipe
  the config matches (:func:`identify`), or None for a setting no recipe describes;
- ``bench.netem`` measures recipes by name (its rows are keyed by them) with the labels
  and measurement kinds of this table;
- the comparison report looks a run's speeds up by its recorded recipe.

Adding a recipe: one :func:`register_recipe` call below (or in user code before the run
starts); docs/guide/development.md has the checklist.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from onebit_bert.registry import Registry

MEASURES = ("data_parallel", "onebit", "zero_one_adam", "local_steps", "decentralized")
"""How ``bench.netem`` measures a recipe: every step alike (``data_parallel``), a warmup
and a compression stage (``onebit``), 0/1 Adam's kinds of step, whole rounds of local
steps, or once per communication graph (``decentralized``)."""


@dataclass(frozen=True)
class Recipe:
    """One registered recipe."""

    name: str
    label: str
    """How tables and plots name it."""
    optimizer: str
    """``optimizer.name``."""
    strategy: str = "auto"
    """``strategy.name``."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Further config fields (dotted, e.g. ``comm.compression.grad``) and their values."""
    measure: str = "data_parallel"
    """One of :data:`MEASURES`."""
    search_space: Mapping[str, tuple] = field(default_factory=dict)
    """Config fields the comparison may tune and the values it tries. A key of several
    fields joined by commas is one axis whose values are tuples, one value per field:
    ``{"optimizer.name,optimizer.lr": (("lamb", 0.01), ("adamw", 0.002))}`` tries each
    optimizer at its own learning rates."""
    open_fields: tuple[str, ...] = ()
    """Fields a run may set to another non-default value and still be this recipe
    (``hybrid_onebit_lamb`` with bf16 warmup gradients). ``optimizer.name`` may be one of
    them when the search space tries other optimizers (the inner optimizer of local steps)."""
    summary: str = ""

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"recipe {self.name}: measure {self.measure!r} not in {MEASURES}")
        searched = [f for key in self.search_space for f in search_fields(key)]
        for key in (*self.settings, *searched, *self.open_fields):
            own = key == "strategy.name" or (
                key == "optimizer.name" and (key in self.settings or key not in self.open_fields)
            )
            if key.count(".") < 1 or own:
                raise ValueError(
                    f"recipe {self.name}: {key!r} must be a dotted config field other than "
                    "optimizer.name and strategy.name (those are the recipe's own fields; "
                    "optimizer.name may be searched when it is one of open_fields)"
                )
        for key, values in self.search_space.items():
            width = len(search_fields(key))
            if width > 1 and any(not isinstance(v, tuple) or len(v) != width for v in values):
                raise ValueError(
                    f"recipe {self.name}: every value of the search axis {key!r} must be a "
                    f"tuple of {width} values, one per field"
                )

    def fields(self) -> dict[str, Any]:
        """Every config field the recipe fixes, dotted."""
        return {"optimizer.name": self.optimizer, "strategy.name": self.strategy, **self.settings}

    def overrides(self) -> list[str]:
        """The pretraining config overrides (``section.field=value``) that select it."""
        return [f"{key}={_override_value(value)}" for key, value in self.fields().items()]

    def searched(self, key: str) -> list[Any]:
        """The values the recipe may run ``key`` at: its own (when it fixes one) first, then
        those its search space tries, each once."""
        own = self.fields().get(key)
        values = [] if own is None else [own]
        for axis, points in self.search_space.items():
            if key in search_fields(axis):
                for point in points:
                    value = search_point(axis, point)[key]
                    if value not in values:
                        values.append(value)
        return values

    @property
    def node_hierarchy(self) -> bool:
        """Runs with ``comm.hierarchy: node`` (needs more than one rank per node)."""
        return self.settings.get("comm.hierarchy") == "node"


def search_fields(key: str) -> tuple[str, ...]:
    """The config fields of one search-space axis (``"a.b,c.d"``: two fields)."""
    return tuple(part.strip() for part in key.split(","))


def search_point(key: str, value: Any) -> dict[str, Any]:
    """One axis value as ``{field: value}``."""
    fields = search_fields(key)
    return dict(zip(fields, value if len(fields) > 1 else (value,), strict=True))


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


RECIPES: Registry[Recipe] = Registry(
    "recipe", key="recipe", hint="or register it with onebit_bert.recipes.register_recipe"
)
"""Every registered recipe by name, in registration order."""


def register_recipe(recipe: Recipe, replace: bool = False) -> Recipe:
    """Add ``recipe`` to :data:`RECIPES` (``replace``: over an entry of the same name)."""
    return RECIPES.register(recipe, replace)


def get_recipe(name: str) -> Recipe:
    """The entry for ``name``; a clear error naming the registered recipes."""
    return RECIPES.get(name)


@functools.cache
def _defaults() -> dict[str, Any]:
    """The default of every dotted field of the optimizer, strategy and comm sections (read,
    never changed, by the callers)."""
    from onebit_bert.distributed.policy import CommConfig
    from onebit_bert.optim.build import OptimizerConfig
    from onebit_bert.strategies.base import StrategyConfig

    flat: dict[str, Any] = {}
    for section, cls in (("optimizer", OptimizerConfig), ("strategy", StrategyConfig),
                         ("comm", CommConfig)):  # fmt: skip
        _flatten(dataclasses.asdict(cls()), section, flat)
    return flat


def _flatten(tree: Mapping, prefix: str, out: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _flatten(value, f"{prefix}.{key}", out)
        else:
            out[f"{prefix}.{key}"] = value


def _lookup(config: Mapping, key: str, defaults: Mapping[str, Any]) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return defaults.get(key)
        node = node[part]
    return node


def mismatches(recipe: Recipe, config: Mapping) -> dict[str, tuple[Any, Any]]:
    """The fields where a pretraining config (as a nested dict) differs from ``recipe``:
    ``{field: (recipe's value, config's value)}``, empty when it runs the recipe. Every
    field any registered recipe sets counts (a recipe that does not set it expects its
    default), and ``strategy.name: auto`` counts as the strategy it resolves to."""
    from onebit_bert.optim.build import OptimizerConfig
    from onebit_bert.strategies import StrategyConfig, resolve_strategy_name

    defaults = _defaults()
    keys = dict.fromkeys(("optimizer.name", "strategy.name"))
    for other in RECIPES.values():
        keys.update(dict.fromkeys(other.settings))
    keys.update(dict.fromkeys(recipe.settings))
    wanted = {key: recipe.fields().get(key, defaults.get(key)) for key in keys}
    found = {key: _lookup(config, key, defaults) for key in keys}
    for values in (wanted, found):
        if values["strategy.name"] == "auto":
            values["strategy.name"] = resolve_strategy_name(
                StrategyConfig(name="auto"), OptimizerConfig(name=values["optimizer.name"])
            )
    return {
        k: (wanted[k], found[k])
        for k in keys
        if wanted[k] != found[k] and not (k in recipe.open_fields and found[k] != defaults.get(k))
    }


def field_value(config: Mapping, key: str) -> Any:
    """A dotted field of a pretraining config (as a nested dict), its default when unset."""
    return _lookup(config, key, _defaults())


def identify(config: Mapping) -> str | None:
    """The registered recipe a pretraining config (as a nested dict) runs, or None."""
    for name, recipe in RECIPES.items():
        if not mismatches(recipe, config):
            return name
    return None


def check_recipe(name: str, config: Mapping) -> None:
    """Refuse a config that names recipe ``name`` but does not run it (one clear error)."""
    differ = mismatches(get_recipe(name), config)
    if differ:
        detail = "; ".join(f"{k}: recipe {a!r}, config {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"recipe {name!r} does not match the config ({detail}); set those fields as the "
            f"recipe does (its overrides: {' '.join(get_recipe(name).overrides())}) or drop "
            "`recipe` to record the run under the recipe its fields match"
        )


LR = "optimizer.lr"
"""Every recipe searches its learning rate. The 1-bit family (1-bit LAMB, 1-bit Adam, 0/1
Adam and their variants) does not search its freeze step: the parity protocol fixes it by
a rule before any run (the recipe's fraction of the run, ``optimizer.freeze_step`` in the
base config), and its sensitivity is reported apart (docs/guide/parity.md), so that no
headline result depends on a freeze step picked from results."""
_LAMB_LRS = (0.005, 0.01, 0.02)
_ADAM_LRS = (0.001, 0.002, 0.003)
_SGD_LRS = (0.1, 0.3, 1.0)
_TAUS = (4, 8, 16)
_INNER = "optimizer.name,optimizer.lr"
_LAMB_OR_ADAMW = (*(("lamb", lr) for lr in _LAMB_LRS), *(("adamw", lr) for lr in _ADAM_LRS))
"""The inner optimizer of local steps, each at its own learning rates: the papers of
SlowMo, CO2 and DiLoCo run AdamW (or Adam) inside, the flat recipes here LAMB."""
_SLOWMO_BETAS = (0.0, 0.2, 0.5)
"""SlowMo's slow momentum: fairseq's rule for up to 16 workers (0), fairscale's suggestion
at 4 nodes (0.2) and the earlier hand-picked comparison's 0.5; alpha stays at the paper's
1 ("consistently best"), so the effective outer step alpha / (1 - beta) runs from 1 to 2."""
_CO2_PENALTIES = (0.0, 1.0)
"""CO2's staleness-gap penalty lambda: off, or the default (a stale update scaled by 1/2 at
the anchor's typical move)."""
_GRAPHS = ("ring", "exponential")
"""DmSGD's communication graph (DecentLaM runs the ring only: its momentum diverges on the
directed exponential graph at beta 0.9, which the strategy refuses)."""
_DILOCO_OUTER_LRS = (0.1, 0.3, 0.7)
"""The paper's 0.7 and below: at rounds of 8 steps, 0.7 with Nesterov momentum 0.9 kept
DiLoCo on the unigram plateau where 0.1 trained
(docs/results/2026-11-26-diloco-parity-regime.md)."""
_DILOCO_SPACE = {LR: _ADAM_LRS, "strategy.outer_lr": _DILOCO_OUTER_LRS,
                 "strategy.outer_every": _TAUS}  # fmt: skip
"""What every DiLoCo recipe searches."""
_STREAMING_SPACE = {LR: _ADAM_LRS, "strategy.outer_lr": _DILOCO_OUTER_LRS,
                    "strategy.fragment_mix": (0.0, 0.5)}  # fmt: skip
"""What every Streaming DiLoCo recipe searches (its rounds are fixed by its fragments)."""


def _nodes_as_workers(strategy: str, label: str, axis: str, values: tuple) -> Recipe:
    """Local-step ``strategy`` with each node a worker, LAMB or AdamW inside (the inner
    optimizer is open and searched with its learning rate), its rounds and ``axis``
    searched too."""
    return Recipe(
        f"{strategy}_node",
        f"{label}, nodes as workers",
        "lamb",
        strategy,
        measure="local_steps",
        settings={"comm.hierarchy": "node"},
        open_fields=("optimizer.name",),
        search_space={_INNER: _LAMB_OR_ADAMW, "strategy.outer_every": _TAUS, axis: values},
        summary=f"{label} with each node a worker (data-parallel inside the node), LAMB or "
        "AdamW inside",
    )


for _recipe in (
    Recipe("lamb", "LAMB", "lamb", search_space={LR: _LAMB_LRS},
           summary="LAMB, gradients all-reduced in fp32 every step"),
    Recipe("onebit_lamb", "1-bit LAMB", "onebit_lamb", measure="onebit",
           search_space={LR: _LAMB_LRS},
           summary="LAMB warmup, then 1-bit momentum with error feedback (frozen ratios)"),
    Recipe("adamw", "AdamW", "adamw", search_space={LR: _ADAM_LRS},
           summary="AdamW, gradients all-reduced in fp32 every step"),
    Recipe("onebit_adam", "1-bit Adam", "onebit_adam", measure="onebit",
           search_space={LR: _ADAM_LRS},
           summary="Adam warmup, then 1-bit momentum with a frozen second moment"),
    Recipe("zero_one_adam", "0/1 Adam", "zero_one_adam", measure="zero_one_adam",
           settings={"comm.compression.momentum": "onebit_tensor"},
           search_space={LR: _ADAM_LRS},
           summary="0/1 Adam: variance freezing, 1-bit syncs and local steps, each tensor "
                   "compressed with its own scales (DeepSpeed's)"),
    Recipe("co2", "CO2", "lamb", "co2", measure="local_steps",
           search_space={LR: _LAMB_LRS, "strategy.outer_every": _TAUS,
                         "strategy.gap_penalty": _CO2_PENALTIES},
           summary="local LAMB steps, a one-round-stale outer average overlapped"),
    Recipe("slowmo", "SlowMo", "lamb", "slowmo", measure="local_steps",
           search_space={LR: _LAMB_LRS, "strategy.outer_every": _TAUS,
                         "strategy.outer_momentum": _SLOWMO_BETAS},
           summary="local LAMB steps, an exact average and a slow momentum step"),
    Recipe("local_sgd", "local SGD", "lamb", "local_sgd", measure="local_steps",
           search_space={LR: _LAMB_LRS, "strategy.outer_every": _TAUS},
           summary="local LAMB steps and a parameter average every round"),
    Recipe("diloco", "DiLoCo", "adamw", "diloco", measure="local_steps",
           search_space=_DILOCO_SPACE,
           summary="local AdamW steps, outer SGD with Nesterov momentum (DiLoCo)"),
    Recipe("streaming_diloco", "Streaming DiLoCo", "adamw", "streaming_diloco",
           measure="local_steps",
           search_space=_STREAMING_SPACE,
           summary="DiLoCo synchronised one fragment at a time, overlapped with inner steps"),
    Recipe("diloco_int4", "DiLoCo, int4 outer", "adamw", "diloco", measure="local_steps",
           settings={"comm.compression.outer": "int4"},
           search_space=_DILOCO_SPACE,
           summary="DiLoCo sending 4-bit pseudo-gradients with error feedback"),
    Recipe("streaming_diloco_int4", "Streaming DiLoCo, int4 outer", "adamw",
           "streaming_diloco", measure="local_steps",
           settings={"comm.compression.outer": "int4"},
           search_space=_STREAMING_SPACE,
           summary="Streaming DiLoCo sending 4-bit fragment pseudo-gradients"),
    Recipe("diloco_node", "DiLoCo, nodes as workers", "adamw", "diloco", measure="local_steps",
           settings={"comm.hierarchy": "node"},
           search_space=_DILOCO_SPACE,
           summary="DiLoCo as its paper runs it: each node a worker whose ranks average "
                   "gradients every step"),
    Recipe("streaming_diloco_node", "Streaming DiLoCo, nodes as workers", "adamw",
           "streaming_diloco", measure="local_steps", settings={"comm.hierarchy": "node"},
           search_space=_STREAMING_SPACE,
           summary="Streaming DiLoCo with each node a worker (data-parallel inside the node)"),
    _nodes_as_workers("co2", "CO2", "strategy.gap_penalty", _CO2_PENALTIES),
    _nodes_as_workers("slowmo", "SlowMo", "strategy.outer_momentum", _SLOWMO_BETAS),
    Recipe("decentlam", "DecentLaM", "sgd", "decentlam", measure="decentralized",
           search_space={LR: _SGD_LRS},
           summary="momentum SGD with gossip over a graph, DecentLaM's correction"),
    Recipe("dmsgd", "DmSGD", "sgd", "dmsgd", measure="decentralized",
           search_space={LR: _SGD_LRS, "strategy.topology": _GRAPHS},
           summary="decentralised momentum SGD with gossip over a graph"),
    Recipe("hybrid_onebit_lamb", "hybrid 1-bit LAMB", "onebit_lamb", measure="onebit",
           settings={"comm.compression.grad": "int8"}, search_space={LR: _LAMB_LRS},
           open_fields=("comm.compression.grad",),
           summary="1-bit LAMB whose warmup gradients travel in int8 with error feedback"),
    Recipe("onebit_lamb_overlap", "1-bit LAMB overlapped", "onebit_lamb", measure="onebit",
           settings={"comm.overlap": True}, search_space={LR: _LAMB_LRS},
           summary="1-bit LAMB, the momentum all-reduce in buckets overlapped with compute"),
    Recipe("powersgd", "PowerSGD (LAMB)", "lamb",
           settings={"comm.compression.grad": "powersgd"}, search_space={LR: _LAMB_LRS},
           summary="LAMB on gradients averaged by PowerSGD"),
    Recipe("lamb_node", "LAMB, node hierarchy", "lamb",
           settings={"comm.hierarchy": "node"}, search_space={LR: _LAMB_LRS},
           summary="LAMB; gradients reduced inside each node, then across nodes"),
    Recipe("onebit_lamb_node", "1-bit LAMB, node hierarchy", "onebit_lamb", measure="onebit",
           settings={"comm.hierarchy": "node"}, search_space={LR: _LAMB_LRS},
           summary="1-bit LAMB; momentum reduced inside each node, 1-bit across nodes"),
    Recipe("hybrid_onebit_lamb_node", "hybrid 1-bit LAMB, node hierarchy", "onebit_lamb",
           measure="onebit", settings={"comm.compression.grad": "int8", "comm.hierarchy": "node"},
           search_space={LR: _LAMB_LRS}, open_fields=("comm.compression.grad",),
           summary="hybrid 1-bit LAMB with the node hierarchy"),
):  # fmt: skip
    register_recipe(_recipe)
