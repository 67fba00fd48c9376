"""Equal-budget tuning: trials from each recipe's search space, successive halving, and the
budget check the comparison applies before it ranks recipes.

A comparison is fair only when every recipe had the same chance to be tuned (AlgoPerf's
model: a fixed search space and a fixed number of trials per method). Here:

- **Trials.** ``budget`` distinct settings of a recipe's ``search_space``
  (:mod:`onebit_bert.recipes`), taken from its grid in an order shuffled by ``seed``
  (:func:`trials`); a grid with fewer points than the budget is refused, since that recipe
  would get fewer trials than the others.
- **Successive halving** (:func:`successive_halving`). Every trial runs to the first rung
  (say 1/4 of the run's steps), the better half by validation loss goes on to the next rung
  (twice as many steps, continued from its checkpoint), and so on; the best trial at the
  last rung is the recipe's chosen setting. Ties go to the lower trial index, and a
  non-finite loss ranks last. Every trial's loss at every rung it reached is recorded.
- **Budget** (:func:`budget`). The trials and the rungs, and the steps they cost (each
  trial counts the steps of the last rung it reached: a continued run does not start over).
  :func:`check_equal_budgets` refuses recipes whose budgets differ, naming them.

The chosen setting is then evaluated on fresh seeds, not the tuning seed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onebit_bert.recipes import RECIPES, Recipe, search_point
from onebit_bert.shards import PretrainingShards


@dataclass(frozen=True)
class Trial:
    """One setting of a recipe's search space."""

    recipe: str
    index: int
    settings: Mapping[str, Any]
    """Dotted config field -> value."""

    @property
    def name(self) -> str:
        return f"{self.recipe}-t{self.index}"

    def overrides(self) -> list[str]:
        """The pretraining config overrides of this setting (after the recipe's own)."""
        return [f"{key}={value}" for key, value in self.settings.items()]


def grid(recipe: Recipe) -> list[dict[str, Any]]:
    """Every point of the recipe's search space, in the order its axes and values are
    declared, as ``{dotted field: value}`` (a joint axis gives one entry per field)."""
    keys = list(recipe.search_space)
    points = []
    for values in itertools.product(*(recipe.search_space[k] for k in keys)):
        point: dict[str, Any] = {}
        for key, value in zip(keys, values, strict=True):
            point.update(search_point(key, value))
        points.append(point)
    return points


def trials(recipe: Recipe, budget: int, seed: int = 0) -> list[Trial]:
    """``budget`` distinct points of the recipe's grid, in an order shuffled by ``seed``."""
    if budget < 1:
        raise ValueError(f"the tuning budget must be at least 1 trial, got {budget}")
    points = grid(recipe)
    if len(points) < budget:
        raise ValueError(
            f"recipe {recipe.name}'s search space has {len(points)} points, fewer than the "
            f"budget of {budget} trials; widen its search_space or lower the budget (every "
            "recipe gets the same number of trials)"
        )
    random.Random(f"{seed}/{recipe.name}").shuffle(points)
    return [Trial(recipe.name, i, p) for i, p in enumerate(points[:budget])]


def rungs(first: int, last: int, eta: int = 2) -> list[int]:
    """Step counts of the rungs: ``first``, ``eta`` times more each, ending at ``last``."""
    if not 1 <= first <= last or eta < 2:
        raise ValueError(f"rungs need 1 <= first <= last and eta >= 2 (got {first}, {last}, {eta})")
    out = [first]
    while out[-1] * eta < last:
        out.append(out[-1] * eta)
    if out[-1] != last:
        out.append(last)
    return out


@dataclass
class Halving:
    """What :func:`successive_halving` did: every trial's loss at each rung it reached."""

    rung_steps: list[int]
    losses: dict[str, dict[int, float]] = field(default_factory=dict)
    """Trial name -> {steps: validation loss}."""
    chosen: str | None = None

    def reached(self, name: str) -> int:
        """The last rung's steps the trial ran to."""
        return max(self.losses[name])


def _rank_key(loss: float, index: int) -> tuple[bool, float, int]:
    return (not math.isfinite(loss), loss if math.isfinite(loss) else 0.0, index)


def successive_halving(
    candidates: list[Trial], run: Callable[[Trial, int], float], rung_steps: list[int],
    keep: float = 0.5,
) -> Halving:  # fmt: skip
    """Run ``candidates`` through ``rung_steps`` (``run(trial, steps)`` trains the trial to
    ``steps`` and returns its validation loss there), keeping ``ceil(keep * n)`` at each
    rung; the best at the last rung is chosen."""
    if not candidates:
        raise ValueError("successive halving needs at least one trial")
    if not 0 < keep < 1:
        raise ValueError(f"keep must be in (0, 1), got {keep}")
    record = Halving(list(rung_steps), {t.name: {} for t in candidates})
    alive = list(candidates)
    for r, steps in enumerate(rung_steps):
        scored = []
        for trial in alive:
            loss = float(run(trial, steps))
            record.losses[trial.name][steps] = loss
            scored.append((_rank_key(loss, trial.index), trial))
        scored.sort(key=lambda pair: pair[0])
        if r == len(rung_steps) - 1:
            record.chosen = scored[0][1].name
            break
        alive = [trial for _, trial in scored[: max(1, math.ceil(keep * len(scored)))]]
    return record


def budget(record: Halving) -> dict:
    """The trials, the rungs and the steps a recipe's tuning cost."""
    return {
        "trials": len(record.losses),
        "rungs": list(record.rung_steps),
        "steps": sum(record.reached(name) for name in record.losses),
    }


def tuning_record(recipe: Recipe, candidates: list[Trial], record: Halving) -> dict:
    """One recipe's tuning as the comparison reads it (``--tuning``): its search space,
    every trial's settings and losses by rung, the chosen trial and the budget."""
    by_name = {t.name: t for t in candidates}
    return {
        "recipe": recipe.name,
        "search_space": stored_space(recipe),
        "trials": [
            {
                "name": n,
                "settings": dict(by_name[n].settings),
                "losses": {str(s): loss for s, loss in record.losses[n].items()},
            }
            for n in record.losses
        ],  # fmt: skip
        "chosen": record.chosen,
        "chosen_settings": dict(by_name[record.chosen].settings) if record.chosen else None,
        "budget": budget(record),
    }


def load_tuning(
    paths: list[str], allow_unequal: bool = False, carried: list[dict] | None = None
) -> dict[str, dict]:
    """Recipe -> :func:`tuning_record` from ``carried`` records (an earlier report's) and
    JSON files (each one record or a list of them); the budgets checked
    (:func:`check_equal_budgets`)."""
    records: dict[str, dict] = {}
    for record in carried or []:
        if record["recipe"] in records:
            raise ValueError(f"recipe {record['recipe']} is tuned twice in the carried reports")
        records[record["recipe"]] = record
    for path in paths:
        loaded = json.loads(Path(path).read_text())
        for record in loaded if isinstance(loaded, list) else [loaded]:
            if record["recipe"] in records:
                raise ValueError(f"{path}: recipe {record['recipe']} is tuned twice")
            records[record["recipe"]] = record
    check_equal_budgets({n: r["budget"] for n, r in records.items()}, allow_unequal)
    return records


def tuning_lines(records: Mapping[str, dict]) -> list[str]:
    """The report's tuning section: per recipe its search space, budget and chosen setting,
    then every trial's loss at every rung it reached."""
    if not records:
        return []
    budgets = {(r["budget"]["trials"], tuple(r["budget"]["rungs"])) for r in records.values()}
    lines = ["## Tuning", ""]
    if len(budgets) > 1:
        lines += ["**The recipes were tuned with unequal budgets** (compared as asked).", ""]
    lines += [
        "| recipe | search space | trials | rungs (steps) | chosen |",
        "|---|---|---:|---|---|",
    ]
    for name, r in records.items():
        space = "; ".join(f"`{k}` {v}" for k, v in r["search_space"].items())
        chosen = ", ".join(f"`{k}={v}`" for k, v in (r["chosen_settings"] or {}).items())
        rungs_text = ", ".join(map(str, r["budget"]["rungs"]))
        lines.append(f"| {name} | {space} | {r['budget']['trials']} | {rungs_text} | {chosen} |")
    lines += coverage_lines(records)
    lines += data_lines(records)
    lines += ["", "| trial | settings | validation loss by rung |", "|---|---|---|"]
    for r in records.values():
        for t in r["trials"]:
            settings = ", ".join(f"`{k}={v}`" for k, v in t["settings"].items())
            losses = ", ".join(f"{s}: {loss:.4f}" for s, loss in t["losses"].items())
            mark = " (chosen)" if t["name"] == r["chosen"] else ""
            lines.append(f"| {t['name']}{mark} | {settings} | {losses} |")
    evaluated = {n: r["evaluation"] for n, r in records.items() if r.get("evaluation")}
    if evaluated:
        lines += [
            "",
            "The chosen settings on fresh seeds (not the tuning seed):",
            "",
            "| recipe | seeds | final validation loss | mean |",
            "|---|---|---|---:|",
        ]
        for name, runs in evaluated.items():
            finals = [run["final_val_loss"] for run in runs]
            seeds = ", ".join(str(run["seed"]) for run in runs)
            values = ", ".join(f"{v:.4f}" for v in finals)
            lines.append(f"| {name} | {seeds} | {values} | {sum(finals) / len(finals):.4f} |")
    return [*lines, ""]


def stored_space(recipe: Recipe) -> dict[str, list]:
    """The recipe's search space as a tuning record stores it: plain JSON, so a joint
    axis's tuples are lists, equal to the same space read back from ``tuning.json``."""
    return json.loads(json.dumps({k: list(v) for k, v in recipe.search_space.items()}))


def stale_search_spaces(records: Mapping[str, dict]) -> dict[str, dict]:
    """Recipe -> its registry search space today, for the recipes tuned in another one (the
    registry widened or changed since), so a report cannot pass an old tuning for the
    protocol's current one."""
    stale = {}
    for name, record in records.items():
        if name not in RECIPES:
            continue
        now = stored_space(RECIPES[name])
        if json.loads(json.dumps(record["search_space"])) != now:
            stale[name] = now
    return stale


def data_identity(data_dir: Path) -> dict:
    """What a tuning is pretrained on, from the prepared data's manifest: the tokenizer's
    sha256 and one sha256 over the training shards' (in order). Two records with different
    identities were pretrained on different token streams. A directory that is not a
    prepared corpus raises :class:`onebit_bert.shards.ShardFormatError` naming the fix."""
    manifest = PretrainingShards(data_dir).manifest
    shards = [s["sha256"] for s in manifest["splits"]["train"]["shards"]]
    return {
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "shards_sha256": hashlib.sha256("\n".join(shards).encode()).hexdigest(),
    }


def data_label(data: dict) -> str:
    """A :func:`data_identity` as the reports print it (the hashes' first 12 digits)."""
    return f"tokenizer `{data['tokenizer_sha256'][:12]}…`, shards `{data['shards_sha256'][:12]}…`"


def data_lines(records: Mapping[str, dict]) -> list[str]:
    """Under the tuning table: which data each record was pretrained on, when the records
    do not all carry one and the same :func:`data_identity`."""
    groups: dict[str, list[str]] = {}
    for name, record in records.items():
        data = record.get("data")
        key = data_label(data) if data else "not recorded"
        groups.setdefault(key, []).append(name)
    if len(groups) <= 1 and "not recorded" not in groups:
        return []
    listed = "; ".join(f"{key}: {', '.join(names)}" for key, names in groups.items())
    return [
        "",
        f"**The records do not all carry the same recorded data** ({len(groups)} group(s) by "
        f"the sha256 of the tokenizer and of the training shards): {listed}. Across groups "
        "the token streams may differ, and with them the losses.",
    ]


def coverage_lines(records: Mapping[str, dict]) -> list[str]:
    """Under the tuning table: recipes tuned in a search space other than the registry's
    today, and registry recipes with a search space that this comparison did not tune."""
    lines = []
    for name, now in stale_search_spaces(records).items():
        space = "; ".join(f"`{k}` {v}" for k, v in now.items())
        lines += [
            "",
            f"**{name} was tuned in another search space than its recipe's today** "
            f"({space}): tune it again to compare it under the current protocol.",
        ]
    untuned = [n for n in RECIPES if n not in records]
    if untuned:
        lines += [
            "",
            "Recipes of the registry not tuned in this comparison (so not in it): "
            + ", ".join(untuned)
            + ".",
        ]
    return lines


def check_equal_budgets(budgets: Mapping[str, Mapping], allow_unequal: bool = False) -> None:
    """Refuse recipes whose tuning budgets (:func:`budget`) differ in trials or rungs."""
    shapes = {name: (b["trials"], tuple(b["rungs"])) for name, b in budgets.items()}
    if len(set(shapes.values())) <= 1 or allow_unequal:
        return
    listed = "; ".join(f"{n}: {t} trials, rungs {list(r)}" for n, (t, r) in shapes.items())
    raise ValueError(
        f"the recipes were tuned with unequal budgets ({listed}); tune them alike, or pass "
        "--allow-unequal-budgets to compare anyway (the report then says so)"
    )
