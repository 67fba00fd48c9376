"""The step model of :mod:`pipeline.reports.linkmodel` against every netem point in the
repository: each point (recipe, stage, link, sweep) predicted from the same recipe's other
points, never from itself (a point measured several times by one sweep is one point, its
repeats combined); the error of the modelled samples/s against the measured."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from pipeline.reports.linkmodel import REPO, _stages, profiles_of, step_seconds
from pipeline.reports.timing import combine_repeats


def check(profiles_from: list[str] | None = None) -> dict:
    """Every netem point of the repository predicted from the same recipe's other points;
    the error of the modelled samples/s against the measured, per point and summarised."""
    paths = profiles_from or sorted(
        str(Path(p).relative_to(REPO))
        for p in glob.glob(str(REPO / "docs/**/netem*.json"), recursive=True)
    )
    rows = []
    for path in paths:
        netem = json.loads((REPO / path).read_text())
        # a point's repeats are one measurement: never predicted from each other
        for row in combine_repeats(netem.get("results", [])):
            rows.append((path, row))
    points = []
    for path, row in rows:
        for key, run in row.get("runs", {}).items():
            for stage, measured in _stages(run):
                predicted, source = _predict(path, row, key, stage, rows)
                if predicted is None:
                    continue
                points.append({
                    "file": path, "bandwidth_mbit": row["bandwidth_mbit"],
                    "world_size": row["world_size"],
                    "ranks_per_host": row.get("ranks_per_host", 1), "recipe": key,
                    "stage": stage, "measured_samples_per_s": measured["samples_per_s"],
                    "modelled_samples_per_s": predicted, "from": source,
                    "error": predicted / measured["samples_per_s"] - 1,
                })  # fmt: skip
    return {"points": points, "summary": _summary(points)}


def _predict(path: str, row: dict, key: str, stage: str, rows: list) -> tuple:
    """Samples/s of (row, key, stage) from the same sweep's other bandwidth, else from other
    sweeps of the same layout (median; their compute rescaled by the rows' compute-only
    speeds, the machine's state); the row's own measurement is never used."""
    p, g = row["world_size"], row.get("ranks_per_host", 1)
    same = [(f, r) for f, r in rows if f == path and r is not row]
    other = [(f, r) for f, r in rows if f != path]
    for label, pool in (("same sweep", same), ("other sweeps", other)):
        guesses = []
        for f, r in pool:
            if (r["world_size"], r.get("ranks_per_host", 1)) != (p, g) or key not in r["runs"]:
                continue
            partner = [x for x in rows if x[0] == f and key in x[1]["runs"]
                       and x[1]["world_size"] == p and x[1] is not row]  # fmt: skip
            speed = row["compute_only_samples_per_s"] if label == "other sweeps" else None
            prof = profiles_of([x[1] for x in partner], f, key, speed)
            if stage in prof:
                step = step_seconds(prof[stage], row["bandwidth_mbit"] * 1e6, p, g)
                guesses.append(p * prof[stage].batch_per_rank / step)
        if guesses:
            guesses.sort()
            return guesses[len(guesses) // 2], label
    return None, None


def _summary(points: list[dict]) -> dict:
    def stats(sel: list[dict]) -> dict:
        errors = sorted(abs(p["error"]) for p in sel)
        if not errors:
            return {"points": 0}
        return {"points": len(errors), "median_abs_error": errors[len(errors) // 2],
                "p90_abs_error": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
                "max_abs_error": errors[-1],
                "mean_error": sum(p["error"] for p in sel) / len(sel)}  # fmt: skip

    out = {"all": stats(points)}
    for label in ("same sweep", "other sweeps"):
        out[label] = stats([p for p in points if p["from"] == label])
    for bw in sorted({p["bandwidth_mbit"] for p in points}):
        out[f"{bw:g} Mbit/s"] = stats([p for p in points if p["bandwidth_mbit"] == bw])
    return out
