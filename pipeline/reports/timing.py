"""Modelled training time from measured speeds: a ``bench.netem`` JSON gives samples/s per
strategy, stage and bandwidth on emulated links; a run's time to a step is the sum of its
steps' global batch over the speed of each step's stage (:func:`stage_steps`,
:func:`seconds_for`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from onebit_bert.recipes import RECIPES, get_recipe

NETEM_MUST_AGREE = (
    "model",
    "seq_length",
    "batch_per_rank",
    "micro_batch",
    "ranks_per_host",
    "hybrid_codec",
)
"""Settings of a bench.netem JSON that decide what its speeds mean: files merged into one
table must agree on them. The round length (``outer_every``, ``outer_every_by_recipe``)
means something only for recipes that take local steps: for those, and the inner
optimizers (``inner_by_recipe``), every file that measured a recipe must agree."""


def takes_rounds(recipe: str) -> bool:
    """Whether ``recipe``'s speed depends on its round length (a registered recipe that
    takes local steps; a name the registry does not know is assumed to)."""
    return recipe not in RECIPES or get_recipe(recipe).measure == "local_steps"


def rounds_of(netem: dict, recipe: str) -> int | None:
    """The local steps per round the file measured ``recipe`` at."""
    return (netem.get("outer_every_by_recipe") or {}).get(recipe, netem.get("outer_every"))


def inner_optimizer(netem: dict, recipe: str) -> str | None:
    """The inner optimizer the file measured ``recipe`` with where ``--inner`` named one
    (None: the recipe's own)."""
    return (netem.get("inner_by_recipe") or {}).get(recipe)


# ----------------------------------------------------------------------------- repeats


def _combine(values: list, key: str = "") -> object:
    """One value from a point's repeats: dicts key by key (a dict with ``samples_per_s``
    keeps each repeat's as ``samples_per_s_repeats``); speeds (keys ending in
    ``samples_per_s``) by their harmonic mean, so that the time of a step is the mean of the
    repeats' times; other numbers by their mean; anything else as the first repeat has it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        out = {k: _combine([v[k] for v in present if k in v], k) for k in keys}
        speeds_ = [v.get("samples_per_s") for v in present]
        if all(isinstance(x, (int, float)) for x in speeds_):
            out["samples_per_s_repeats"] = speeds_
        return out
    numbers = [v for v in present if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) < len(present) or all(v == present[0] for v in present):
        return present[0]
    if key.endswith("samples_per_s") and all(v > 0 for v in numbers):
        return len(numbers) / sum(1 / v for v in numbers)
    return sum(numbers) / len(numbers)


def combine_repeats(rows: list[dict]) -> list[dict]:
    """One row per point (bandwidth, world size, ranks per host) from one sweep's rows:
    a point measured several times (``bench.netem --repeats``, rows numbered by ``repeat``)
    becomes one row of their combined values (:func:`_combine`) with ``repeats``, the
    number combined; each speed keeps its repeats (``samples_per_s_repeats``). Rows of a
    point that are not numbered repeats are refused: two measurements of one point in one
    file that no sweep marked as repeats."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        point = (float(row["bandwidth_mbit"]), int(row["world_size"]),
                 int(row.get("ranks_per_host", 1)))  # fmt: skip
        groups.setdefault(point, []).append(row)
    out = []
    for (bw, world, _), group in groups.items():
        if len(group) == 1:
            out.append({k: v for k, v in group[0].items() if k != "repeat"})
            continue
        numbers = [r.get("repeat") for r in group]
        if None in numbers or len(set(numbers)) < len(numbers):
            raise ValueError(
                f"{bw:g} Mbit/s on {world} ranks is measured {len(group)} times but not as "
                "numbered repeats of one sweep (bench.netem --repeats); keep one row per point"
            )
        group = sorted(group, key=lambda r: r["repeat"])
        combined = _combine([{k: v for k, v in r.items() if k != "repeat"} for r in group])
        combined["repeats"] = len(group)
        out.append(combined)
    return out


def load_netem(paths: list[str], ignore: dict[str, set[str]] | None = None) -> dict | None:
    """One netem table from one or more ``bench.netem`` JSONs (None for none): the first
    file's settings, every file's result rows. Files must agree on :data:`NETEM_MUST_AGREE`.
    A (bandwidth, world size) point may appear in several files when they measured other
    recipes there (a recipe tuned later, measured alone): each recipe is measured once per
    point, and ``runs_from`` names the file each recipe's speeds come from. ``ignore``: per
    file (resolved path), recipes whose measurements in it are left out (a recipe measured
    again at a new setting, in another file)."""
    merged = None
    rows: dict[tuple[float, int], dict] = {}
    measured: dict[tuple[float, int, str], str] = {}
    rounds: dict[str, tuple[int | None, str]] = {}
    inners: dict[str, tuple[str | None, str]] = {}
    ignored: dict[str, set[str]] = {}
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"--netem {path}: no such file (a bench.netem netem.json)")
        netem = json.loads(path.read_text())
        if not isinstance(netem, dict) or "results" not in netem:
            raise ValueError(f"--netem {path}: not a bench.netem JSON (no 'results')")
        try:
            netem = {**netem, "results": combine_repeats(netem["results"])}
        except ValueError as error:
            raise ValueError(f"--netem {path}: {error}") from None
        if merged is None:
            merged = {**netem, "results": [], "strategies": [], "sweeps": []}
        merged["sweeps"].append({"file": str(path), "sweep_id": netem.get("sweep_id"),
                                 "repeats": netem.get("repeats", 1)})  # fmt: skip
        for field in NETEM_MUST_AGREE:
            if netem.get(field) != merged.get(field):
                raise ValueError(
                    f"--netem {path}: {field} is {netem.get(field)!r} but {paths[0]} has "
                    f"{merged.get(field)!r}; merge only sweeps of the same settings (rerun "
                    f"bench.netem with those of {paths[0]})"
                )
        skip = (ignore or {}).get(str(path.resolve()), set())
        for row in netem["results"]:
            if skip & set(row.get("runs", {})):
                ignored.setdefault(str(path), set()).update(skip & set(row["runs"]))
            row = {**row, "runs": {k: v for k, v in row.get("runs", {}).items() if k not in skip}}
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
                tau = rounds_of(netem, recipe) if takes_rounds(recipe) else None
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
            if strategy not in merged["strategies"] and strategy not in skip:
                merged["strategies"].append(strategy)
    if merged is not None:
        merged["outer_every_by_recipe"] = {
            r: tau
            for r, (tau, _) in rounds.items()
            if tau is not None and tau != merged.get("outer_every")
        }
        merged["inner_by_recipe"] = {r: o for r, (o, _) in inners.items() if o is not None}
        merged["ignored"] = {path: sorted(recipes) for path, recipes in ignored.items()}
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
    return {bw: entries[0] for bw, entries in _speed_entries(netem, key, world, False).items()}


def speeds_by_repeat(netem: dict | None, key: str | None, world: int | None
                     ) -> dict[float, list[dict]]:  # fmt: skip
    """As :func:`speeds`, one entry per repeat of the sweep (a list of one where the point
    was measured once)."""
    return _speed_entries(netem, key, world, True)


def _speed_entries(netem, key, world, by_repeat: bool) -> dict[float, list[dict]]:
    if netem is None or key is None:
        return {}
    key, _, codec = key.partition(":")
    if codec and netem.get("hybrid_codec", "int8") != codec:
        return {}  # the benchmark's hybrid ran another codec

    def speed(summary: dict, r: int | None) -> float:
        if r is None or "samples_per_s_repeats" not in summary:
            return summary["samples_per_s"]
        return summary["samples_per_s_repeats"][r]

    out = {}
    for row in netem.get("results", []):
        if world is not None and row.get("world_size") != world:
            continue
        run = row.get("runs", {}).get(key)
        if run is None:
            continue
        count = len(run.get("samples_per_s_repeats") or []) if by_repeat else 0
        entries = []
        for r in range(count) if count > 1 else [None]:
            entry = {"default": speed(run, r)}
            if "warmup" in run:
                entry["warmup"] = speed(run["warmup"], r)
                entry["compression"] = speed(run, r)
            for kind, summary in run.get("kinds", {}).items():
                entry[kind] = speed(summary, r)
            entries.append(entry)
        out[float(row["bandwidth_mbit"])] = entries
    return out


def stage_steps(run: dict, upto_step: float) -> dict[str, float]:
    """Steps per stage up to ``upto_step`` (a fractional last step counts its fraction);
    steps that log no stage count under ``default``."""
    counts: dict[str, float] = {}
    whole = math.floor(upto_step)
    for step in range(1, whole + 1):
        stage = run["stages"].get(step) or "default"
        counts[stage] = counts.get(stage, 0) + 1
    if upto_step > whole:
        stage = run["stages"].get(whole + 1) or "default"
        counts[stage] = counts.get(stage, 0) + (upto_step - whole)
    return counts


def seconds_for(steps_by_stage: dict[str, float], batch: int, speed: dict) -> float:
    """Seconds to train ``steps_by_stage`` (:func:`stage_steps`) at ``speed`` (one
    bandwidth's entry of :func:`speeds`): a stage the benchmark did not measure runs at its
    ``default`` speed."""
    return sum(
        n * batch / speed.get(stage, speed["default"])
        for stage, n in sorted(steps_by_stage.items())
    )


def seconds_by_bandwidth(
    steps_by_stage: dict[str, float] | None, batch: int, measured: dict[float, dict]
) -> dict[str, float]:
    """:func:`seconds_for` at every bandwidth of ``measured`` (:func:`speeds`), keyed as
    reports key them (``"25"``, ``"10000"``); empty when the stages are unknown (None)."""
    if steps_by_stage is None:
        return {}
    return {f"{bw:g}": seconds_for(steps_by_stage, batch, sp) for bw, sp in measured.items()}


def seconds_by_repeat(
    steps_by_stage: dict[str, float] | None, batch: int, measured: dict[float, list[dict]]
) -> dict[str, list[float]]:
    """:func:`seconds_for` at every bandwidth of ``measured`` (:func:`speeds_by_repeat`), one
    time per repeat of the sweep; only the bandwidths measured more than once."""
    if steps_by_stage is None:
        return {}
    return {
        f"{bw:g}": [seconds_for(steps_by_stage, batch, sp) for sp in entries]
        for bw, entries in measured.items()
        if len(entries) > 1
    }


def infer_stage_steps(
    steps: float, seconds: dict[str, float], measured: dict[float, dict], batch: int
) -> dict[str, float] | None:
    """The steps per stage that reproduce modelled ``seconds`` (bandwidth as text -> s) from
    the speeds that produced them (``measured``: :func:`speeds` of the same netem files), for
    a record that kept its times but not its stages: every step at the default speed, or a
    warmup and a compression stage (the 1-bit recipes) whose split is solved at one
    bandwidth and checked at every other (two or more needed). None when neither
    reproduces every stored time to a relative 1e-6."""
    points = [(float(bw), value) for bw, value in seconds.items()]
    if not points or any(bw not in measured for bw, _ in points):
        return None

    def fits(split: dict[str, float]) -> bool:
        return all(
            math.isclose(seconds_for(split, batch, measured[bw]), value, rel_tol=1e-6)
            for bw, value in points
        )

    if fits({"default": steps}):
        return {"default": steps}
    if len(points) < 2 or any("warmup" not in measured[bw] for bw, _ in points):
        return None

    def gap(bw: float) -> float:
        return 1 / measured[bw]["warmup"] - 1 / measured[bw]["compression"]

    bw, value = max(points, key=lambda point: abs(gap(point[0])))
    if gap(bw) == 0:
        return None
    warmup = (value / batch - steps / measured[bw]["compression"]) / gap(bw)
    if not -1e-6 <= warmup <= steps + 1e-6:
        return None
    warmup = min(max(warmup, 0.0), steps)
    if abs(warmup - round(warmup)) < 1e-6:
        warmup = float(round(warmup))
    split = {"warmup": warmup, "compression": steps - warmup}
    return split if fits(split) else None
