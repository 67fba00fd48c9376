"""Runs carried from earlier comparisons (``--prior``): an earlier ``report.json``'s runs
as it measured them, the names left out (``--drop``), the target and netem files they
share with the new report, and their times modelled again (``--retime``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from onebit_bert.recipes import RECIPES, get_recipe
from pipeline.reports.timing import (
    infer_stage_steps,
    inner_optimizer,
    load_netem,
    rounds_of,
    seconds_by_bandwidth,
    seconds_by_repeat,
    speeds,
    speeds_by_repeat,
)


def recipe_name(key: str | None) -> str:
    """The recipe of a :func:`pipeline.reports.compare.strategy_key` (``decentlam/ring`` ->
    ``decentlam``, ``hybrid_onebit_lamb:int8`` -> ``hybrid_onebit_lamb``); empty for None."""
    return (key or "").partition(":")[0].partition("/")[0]


def load_prior(path: str | Path) -> dict:
    """An earlier comparison's ``report.json`` as runs to carry: each run record as that
    report measured it (final metrics, bytes, time to its target, its curve where the
    record has one), without fine-tuning results; its target, netem files and tuning."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prior {path}: no such report.json")
    try:
        report = json.loads(path.read_text())
        runs, references = (
            [
                {
                    **record,
                    "final": {**record["final"], "final_train_loss": record["final_train_loss"]},
                    "val_loss": [tuple(point) for point in record["val_mlm_loss"]],
                    "finetune": {},
                    "carried_from": str(path),
                }
                for record in report.get(field) or []
            ]
            for field in ("runs", "data_references")
        )
        target = {"val_mlm_loss": float(report["target"]["val_mlm_loss"]),
                  "from": report["target"]["from"]}  # fmt: skip
        netem = list(report["time_model"].get("netem") or [])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"--prior {path}: not a pipeline.reports.compare report.json ({type(err).__name__}: "
            f"{err}); give the report.json that python -m pipeline.reports.compare wrote"
        ) from err
    return {
        "path": str(path),
        "runs": runs,
        "names": list(dict.fromkeys(r["name"] for r in runs)),
        "target": target,
        "netem": netem,
        "tuning": report.get("tuning") or {},
        "data_references": references,
    }


def drop_carried(prior: list[dict], names: list[str]) -> None:
    """Leave ``names`` out of the carried reports, in place: their runs and their tuning
    records (the carried reports' netem files are still needed for the others; a new
    measurement of a dropped recipe replaces the carried one: :func:`carried_netem_ignored`).
    Each name must be carried. The reference (the first carried name) may be dropped only
    where the carried reports hold its runs on other data (``data_references``): those runs
    take its place as the reference, and its tuning record stays."""
    if not names:
        return
    if not prior:
        raise ValueError("--drop leaves names out of earlier reports: give them (--prior)")
    carried = [n for p in prior for n in p["names"]]
    reference = carried[0]
    for name in names:
        if name not in carried:
            raise ValueError(
                f"--drop {name}: no carried report has runs of that name (carried: "
                f"{', '.join(carried)})"
            )
    promoted = [r for p in prior for r in p["data_references"] if r["name"] == reference]
    if reference in names and not promoted:
        raise ValueError(
            f"--drop {reference}: it is the reference of the carried reports, and they hold "
            "no runs of it on other data (data_references) to take its place"
        )
    recipes = set(names)  # a tuning record is keyed by the recipe its runs ran
    for p in prior:
        for run in p["runs"]:
            if run["name"] in names and run.get("strategy"):
                recipes.add(recipe_name(run["strategy"]))
    if reference in names:  # its runs on the other data keep its tuning
        recipes -= {reference, *(recipe_name(r.get("strategy")) for r in promoted)}
    for p in prior:
        p["dropped"] = [n for n in p["names"] if n in names]
        p["dropped_recipes"] = sorted(recipes)
        p["runs"] = [r for r in p["runs"] if r["name"] not in names]
        p["names"] = [n for n in p["names"] if n not in names]
        p["tuning"] = {k: v for k, v in p["tuning"].items() if k not in recipes}
    if reference in names:
        for p in prior:
            p["data_references"] = [r for r in p["data_references"] if r["name"] != reference]
        prior[0]["runs"] = [*promoted, *prior[0]["runs"]]
        prior[0]["names"] = [reference, *prior[0]["names"]]
        prior[0]["promoted"] = reference


def prior_target(prior: list[dict], target_loss: float | None) -> tuple[float, str]:
    """The target every carried report measured against (they must agree, and agree with
    ``--target-loss`` when given: their times to target cannot be recomputed)."""
    first = prior[0]["target"]
    for p in prior:
        value = p["target"]["val_mlm_loss"]
        if not math.isclose(value, first["val_mlm_loss"], rel_tol=0, abs_tol=1e-12):
            raise ValueError(
                f"--prior {p['path']} measured against target {value}, "
                f"{prior[0]['path']} against {first['val_mlm_loss']}: carry reports of one target"
            )
    if target_loss is not None and not math.isclose(
        target_loss, first["val_mlm_loss"], rel_tol=0, abs_tol=1e-12
    ):
        raise ValueError(
            f"--target-loss {target_loss} differs from the target {first['val_mlm_loss']} of "
            f"--prior {prior[0]['path']}: its runs' times to target were measured against "
            "that one; leave --target-loss out or give the same value"
        )
    return first["val_mlm_loss"], first["from"]


def carried_netem_ignored(prior: list[dict], netem_paths: list[str]) -> dict[str, set[str]]:
    """Per carried netem file (resolved path), the recipes whose measurements in it give way:
    those of the runs ``--drop`` replaced (:func:`drop_carried`) that a netem file of this
    report's own measures again (a recipe tuned again to another setting). A dropped recipe
    that nothing measures again keeps its carried measurement."""
    carried = {str(Path(n).resolve()) for p in prior for n in p["netem"]}
    again: set[str] = set()
    for name in netem_paths:
        path = Path(name)
        if str(path.resolve()) in carried or not path.is_file():
            continue
        for row in json.loads(path.read_text()).get("results", []):
            again.update(row.get("runs", {}))
    ignored: dict[str, set[str]] = {}
    for p in prior:
        recipes = set(p.get("dropped_recipes", ())) & again
        for name in p["netem"] if recipes else ():
            ignored.setdefault(str(Path(name).resolve()), set()).update(recipes)
    return ignored


def check_prior_netem(prior: list[dict], netem_paths: list[str]) -> None:
    """A carried report's times came from its netem files: the new report must use them
    too, so that its own runs' times are modelled from the same measurements."""
    given = {Path(p).resolve() for p in netem_paths}
    for p in prior:
        missing = [n for n in p["netem"] if Path(n).resolve() not in given]
        if missing:
            raise ValueError(
                f"--prior {p['path']} modelled its times with {', '.join(missing)}: "
                "pass the same file(s) with --netem"
            )


def retime(prior: list[dict], netem: dict | None) -> None:
    """Re-time the carried runs with this report's netem table (``--retime``: one sweep
    that measured every recipe together, say). A record's time is its steps per stage at
    the new speeds: the stage counts it stored, else those that reproduce its stored times
    from the carried report's own netem files (:func:`pipeline.reports.timing.infer_stage_steps`;
    a record whose times they do not reproduce is refused). Each run gets ``retimed``:
    true, or false where its stages cannot be recovered (0/1 Adam's kinds of step from an
    older record) and its times are dropped."""
    for p in prior:
        try:
            old = load_netem(p["netem"]) if p["netem"] else None
        except FileNotFoundError as err:
            raise FileNotFoundError(
                f"--prior {p['path']} modelled its times with {', '.join(p['netem'])}, and "
                f"re-timing needs them to recover each run's steps per stage ({err}); run "
                "from the directory those paths are relative to"
            ) from err
        for run in p["runs"]:
            _check_same_setting(p["path"], run, old, netem)
            old_speeds = speeds(old, run["strategy"], run["world_size"])
            new_speeds = speeds(netem, run["strategy"], run["world_size"])
            batch = run["global_batch_size"]
            retimed = True

            block = dict(run["time_to_target"])
            if block.get("reached"):
                split = _steps_per_stage(block, block["steps"], run, p, old_speeds)
                retimed = split is not None
                block["stage_steps"] = split
                block["seconds"] = seconds_by_bandwidth(split, batch, new_speeds)
                block.pop("seconds_by_repeat", None)
                repeated = seconds_by_repeat(
                    split, batch, speeds_by_repeat(netem, run["strategy"], run["world_size"])
                )
                if repeated:
                    block["seconds_by_repeat"] = repeated
            block["measured_bandwidths"] = sorted(new_speeds) if retimed else []
            run["time_to_target"] = block
            if run.get("curve"):
                points = []
                for point in run["curve"]:
                    split = _steps_per_stage(point, point["samples"] / batch, run, p, old_speeds)
                    retimed = retimed and split is not None
                    seconds = seconds_by_bandwidth(split, batch, new_speeds)
                    points.append({**point, "stage_steps": split, "seconds": seconds})
                run["curve"] = points
            run["retimed"] = retimed


def _steps_per_stage(block: dict, steps: float, run: dict, prior: dict,
                     old_speeds: dict) -> dict | None:  # fmt: skip
    """A carried time block's (``time_to_target`` or a curve point) steps per stage: stored,
    or recovered from its stored times at the carried report's speeds; None when they
    cannot be recovered."""
    if block.get("stage_steps"):
        return block["stage_steps"]
    single = _single_stage(run["strategy"])
    if not block.get("seconds"):  # the old table had no speed for it
        return {"default": steps} if single else None
    found = infer_stage_steps(steps, block["seconds"], old_speeds, run["global_batch_size"])
    if found is None and single:
        raise ValueError(
            f"--prior {prior['path']}: {run['name']} seed {run['seed']}'s stored times are "
            f"not {steps:g} steps at the speeds of {prior['netem']}: re-time only with the "
            "netem files that report was made with"
        )
    return found


def _single_stage(key: str | None) -> bool:
    """Every step of the recipe runs at one speed (no warmup or kinds of step)."""
    name = recipe_name(key)
    return name in RECIPES and get_recipe(name).measure not in ("onebit", "zero_one_adam")


def _check_same_setting(where: str, run: dict, old: dict | None, new: dict | None) -> None:
    """A local-step run re-timed at another round length or inner optimizer than it was
    measured at would take another recipe's time."""
    name = recipe_name(run["strategy"])
    if old is None or new is None or name not in RECIPES:
        return
    if get_recipe(name).measure != "local_steps" or not speeds(new, name, run["world_size"]):
        return
    was = (rounds_of(old, name), inner_optimizer(old, name))
    now = (rounds_of(new, name), inner_optimizer(new, name))
    if was != now:
        raise ValueError(
            f"--prior {where}: {name} was measured with rounds of {was[0]} steps and "
            f"{was[1] or 'its own'} inside, the new netem table has {now[0]} and "
            f"{now[1] or 'its own'}; measure it as before (bench.netem --outer-every "
            f"...,{name}={was[0]}{f' --inner {name}={was[1]}' if was[1] else ''})"
        )
