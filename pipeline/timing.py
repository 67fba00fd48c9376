"""Modelled training time from measured speeds: a ``bench.netem`` JSON gives samples/s per
strategy, stage and bandwidth on emulated links; a run's time to a step is the sum of its
steps' global batch over the speed of each step's stage (:func:`modelled_seconds`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

NETEM_MUST_AGREE = (
    "model",
    "seq_length",
    "batch_per_rank",
    "micro_batch",
    "ranks_per_host",
    "hybrid_codec",
    "outer_every",
)
"""Settings of a bench.netem JSON that decide what its speeds mean: files merged into one
table must agree on them. The per-recipe rounds (``outer_every_by_recipe``) and inner
optimizers (``inner_by_recipe``) must agree for every recipe both files measured."""


def rounds_of(netem: dict, recipe: str) -> int | None:
    """The local steps per round the file measured ``recipe`` at."""
    return (netem.get("outer_every_by_recipe") or {}).get(recipe, netem.get("outer_every"))


def inner_optimizer(netem: dict, recipe: str) -> str | None:
    """The inner optimizer the file measured ``recipe`` with where ``--inner`` named one
    (None: the recipe's own)."""
    return (netem.get("inner_by_recipe") or {}).get(recipe)


def load_netem(paths: list[str]) -> dict | None:
    """One netem table from one or more ``bench.netem`` JSONs (None for none): the first
    file's settings, every file's result rows. Files must agree on :data:`NETEM_MUST_AGREE`.
    A (bandwidth, world size) point may appear in several files when they measured other
    recipes there (a recipe tuned later, measured alone): each recipe is measured once per
    point, and ``runs_from`` names the file each recipe's speeds come from."""
    merged = None
    rows: dict[tuple[float, int], dict] = {}
    measured: dict[tuple[float, int, str], str] = {}
    rounds: dict[str, tuple[int | None, str]] = {}
    inners: dict[str, tuple[str | None, str]] = {}
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--netem {path}: no such file (a bench.netem netem.json)")
        netem = json.loads(path.read_text())
        if not isinstance(netem, dict) or "results" not in netem:
            raise ValueError(f"--netem {path}: not a bench.netem JSON (no 'results')")
        if merged is None:
            merged = {**netem, "results": [], "strategies": []}
        for field in NETEM_MUST_AGREE:
            if netem.get(field) != merged.get(field):
                raise ValueError(
                    f"--netem {path}: {field} is {netem.get(field)!r} but {paths[0]} has "
                    f"{merged.get(field)!r}; merge only sweeps of the same settings (rerun "
                    f"bench.netem with those of {paths[0]})"
                )
        for row in netem["results"]:
            point = (float(row["bandwidth_mbit"]), int(row["world_size"]))
            for recipe in row.get("runs", {}):
                key = (*point, recipe)
                if key in measured:
                    raise ValueError(
                        f"--netem {path}: {recipe} at {point[0]:g} Mbit/s on {point[1]} ranks "
                        f"is measured in {measured[key]} as well; pass one measurement of each "
                        "recipe at each point"
                    )
                measured[key] = str(path)
                tau = rounds_of(netem, recipe)
                if recipe in rounds and rounds[recipe][0] != tau:
                    raise ValueError(
                        f"--netem {path}: {recipe} runs rounds of {tau} steps but "
                        f"{rounds[recipe][1]} measured it at {rounds[recipe][0]}; merge only "
                        "measurements of the same setting"
                    )
                rounds[recipe] = (tau, str(path))
                inner = inner_optimizer(netem, recipe)
                if recipe in inners and inners[recipe][0] != inner:
                    raise ValueError(
                        f"--netem {path}: {recipe} steps {inner or 'its own optimizer'} inside "
                        f"but {inners[recipe][1]} measured it with "
                        f"{inners[recipe][0] or 'its own'}; merge only measurements of the "
                        "same setting"
                    )
                inners[recipe] = (inner, str(path))
            if point in rows:
                rows[point]["runs"] = {**rows[point]["runs"], **row.get("runs", {})}
            else:
                rows[point] = {**row, "runs": dict(row.get("runs", {}))}
                merged["results"].append(rows[point])
        for strategy in netem.get("strategies", []):
            if strategy not in merged["strategies"]:
                merged["strategies"].append(strategy)
    if merged is not None:
        merged["outer_every_by_recipe"] = {
            r: tau for r, (tau, _) in rounds.items() if tau != merged.get("outer_every")
        }
        merged["inner_by_recipe"] = {r: o for r, (o, _) in inners.items() if o is not None}
        merged["runs_from"] = {}
        for (*_, recipe), source in measured.items():
            files = merged["runs_from"].setdefault(recipe, [])
            if source not in files:
                files.append(source)
    return merged


def speeds(netem: dict | None, key: str | None, world: int | None) -> dict[float, dict]:
    """bandwidth -> {"default": samples/s, stage: samples/s, ...} of recipe ``key`` on
    ``world`` ranks in a netem JSON (empty when it was not measured, or ``key`` is None: a
    run no recipe describes)."""
    if netem is None or key is None:
        return {}
    key, _, codec = key.partition(":")
    if codec and netem.get("hybrid_codec", "int8") != codec:
        return {}  # the benchmark's hybrid ran another codec
    out = {}
    for row in netem.get("results", []):
        if world is not None and row.get("world_size") != world:
            continue
        run = row.get("runs", {}).get(key)
        if run is None:
            continue
        entry = {"default": run["samples_per_s"]}
        if "warmup" in run:
            entry["warmup"] = run["warmup"]["samples_per_s"]
            entry["compression"] = run["samples_per_s"]
        for kind, summary in run.get("kinds", {}).items():
            entry[kind] = summary["samples_per_s"]
        out[float(row["bandwidth_mbit"])] = entry
    return out


def modelled_seconds(run: dict, upto_step: float, speed: dict) -> float:
    """Seconds to train ``upto_step`` steps (fractional last step) at the measured speed of
    each step's stage."""
    batch = run["global_batch_size"]
    total = 0.0
    whole = math.floor(upto_step)
    for step in range(1, whole + 1):
        total += batch / speed.get(run["stages"].get(step), speed["default"])
    if upto_step > whole:
        total += (
            (upto_step - whole) * batch / speed.get(run["stages"].get(whole + 1), speed["default"])
        )
    return total
