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
    "outer_every_by_recipe",
)
"""Settings of a bench.netem JSON that decide what its speeds mean: files merged into one
table must agree on them."""


def load_netem(paths: list[str]) -> dict | None:
    """One netem table from one or more ``bench.netem`` JSONs (None for none): the first
    file's settings, every file's result rows. Files must agree on :data:`NETEM_MUST_AGREE`
    and measure each (bandwidth, world size) point once."""
    merged = None
    points: dict[tuple[float, int], str] = {}
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
            if point in points:
                raise ValueError(
                    f"--netem {path}: {point[0]:g} Mbit/s on {point[1]} ranks is measured in "
                    f"{points[point]} as well; pass one measurement of each point"
                )
            points[point] = str(path)
            merged["results"].append(row)
        for strategy in netem.get("strategies", []):
            if strategy not in merged["strategies"]:
                merged["strategies"].append(strategy)
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
