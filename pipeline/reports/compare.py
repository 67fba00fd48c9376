"""The comparison report: every strategy on the same model, data and schedule, as samples-,
bytes- and time-to-accuracy, and whether fine-tuning still comes out the same.

Input: runs as ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` (runs sharing a NAME are one strategy's
pretraining seeds; the first NAME is the reference, LAMB in ``make compare``; a run given as
``NAME=PRETRAIN_DIR`` has no fine-tuning, and the report then has no fine-tuning table), and
optionally ``bench.netem`` JSONs (``--netem``, once or more) with measured samples/s of
each strategy at each bandwidth and world size: several files (say, one sweep at 25 Mbit/s
and a later one at 10 Gbit/s) are one table when they measured the same model, batch and
settings (:func:`load_netem`). Output, in one directory: ``report.md``, ``report.json`` and
PNG plots (:mod:`pipeline.reports.compare_plots`).

**Target.** The reference's final validation MLM loss, mean over its seeds (or
``--target-loss``). For each run: the samples it had seen when its validation MLM loss
first reached the target (linear interpolation between the two validation points around
the crossing; "not reached" when it never did), and the bytes its rank 0 had sent by then
(the communicator's counts, interpolated the same way, per kind of traffic as well).

**Modelled time.** The runs here train a small model on CPU workers; the time a strategy
would take on a network comes from the netem benchmark, which measured each strategy's
samples/s on emulated links of several bandwidths. The modelled time to the target is
``sum over the steps up to the crossing of global batch / (samples/s of that strategy, in
the stage of that step, at that bandwidth, on the same number of ranks)``: a 1-bit
optimizer's warmup steps at its warmup speed and its compression steps at its compression
speed, 0/1 Adam's steps at the speed of their kind, every other strategy at its one
speed. The speeds are the benchmark's model (``model`` in the netem JSON), not this
report's: the model stands in for the cluster, and the samples come from this report's
runs. Where the netem JSON has no entry for a strategy, its time is left out and said so.

**Which recipes first.** Per bandwidth a group, not a winner (:mod:`pipeline.reports.ranking`):
the leaders Welch's test cannot tell from the first, with the difference the seeds could
have detected, and the recipes clearly behind; a seed that never reached the target counts
with its run's end as a lower bound (≥). Where the reference and 1-bit LAMB both reached
the target, the link below which 1-bit LAMB gets there first (:mod:`pipeline.reports.crossover`).
Runs of more than one data identity (tokenizer and shards) are refused unless
``--mixed-data``, and the report then flags them.

**Verdicts** (fine-tuning and final pretraining metrics, against the reference): a
strategy with two or more pretraining seeds by Welch's t-test over per-seed values, as the
parity report; a strategy with one seed by where its value falls against the reference's
seeds: outside the two-sided 95 % prediction interval for one more reference seed
(``mean ± t(0.975, n-1) · s · sqrt(1 + 1/n)``) is *differs*. Both rest on the spread
between pretraining seeds, not only between fine-tuning seeds of one checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from onebit_bert.io import atomic_write_json, atomic_write_text
from onebit_bert.recipes import RECIPES, field_value, get_recipe, identify
from onebit_bert.strategies.decentralized import DEFAULT_TOPOLOGY
from pipeline.reports import crossover, ranking
from pipeline.reports.gate import samples_to_target
from pipeline.reports.runs import (
    INTRA_NODE_BYTES,
    final_metrics_table,
    finetune_summary,
    finetune_values,
    group_arms,
    load_run,
    parse_run,
    read_run,
    verdict,
)
from pipeline.reports.same_data import (
    assign_data,
    data_identities,
    data_of_dir,
    mixed_data_lines,
    same_data_groups,
    same_data_lines,
)
from pipeline.reports.tables import mean_std_cell as _mean_std
from pipeline.reports.timing import (
    infer_stage_steps,
    inner_optimizer,
    load_netem,
    rounds_of,
    seconds_by_bandwidth,
    speeds,
    stage_steps,
)
from pipeline.tuning import load_tuning, tuning_lines
from pretrain import outputs as pretrain_outputs

ALPHA = 0.05
TEST = (
    f"two or more pretraining seeds: Welch's two-sided t-test on per-seed values, alpha = "
    f"{ALPHA}; one seed: *differs* when the value lies outside the reference's two-sided "
    f"95 % prediction interval for one more seed (mean ± t(0.975, n-1)·s·sqrt(1 + 1/n)); "
    f"the reference needs two or more seeds."
)
NO_RECIPE = "no registered recipe"
"""How tables name the recipe of a run whose settings no registered recipe describes."""
ONEBIT = "onebit_lamb"
"""The recipe whose crossover against the reference the report gives (where both reached the
target and were measured)."""
PLOT_BANDWIDTHS = (25.0, 10_000.0)
"""Mbit/s of the modelled-time plots (when the netem JSON measured them)."""


# ----------------------------------------------------------------------------- loading


def strategy_key(config: dict) -> str | None:
    """The netem benchmark's key for the recipe a pretraining run recorded
    (:mod:`onebit_bert.recipes`; runs from before the field existed: the recipe their
    fields match); None for a run no recipe describes. A decentralized recipe's key names
    its graph (``decentlam/ring``, the benchmark measures each graph), and a recipe whose
    warmup gradients are compressed names the codec (``hybrid_onebit_lamb:int8``: the
    benchmark's hybrid entry measured the codec its JSON names in ``hybrid_codec``)."""
    name = config["recipe"] if "recipe" in config else identify(config)
    if name is None:
        return None
    recipe = get_recipe(name)
    if recipe.measure == "decentralized":
        topology = config["strategy"].get("topology") or DEFAULT_TOPOLOGY[recipe.strategy]
        return f"{name}/{topology}"
    if recipe.measure == "onebit" and "comm.compression.grad" in recipe.settings:
        return f"{name}:{field_value(config, 'comm.compression.grad')}"
    return name


def load_timed_run(spec: str) -> dict:
    """One pretraining seed: :func:`pipeline.reports.runs.load_run`'s fields, plus its
    strategy, its validation loss against samples and cumulative bytes, and each step's
    stage."""
    inputs = parse_run(spec, finetune_optional=True)
    config, by_step = read_run(inputs)
    run = load_run(inputs, (config, by_step))
    batch = run["global_batch_size"]
    cumulative, by_kind, sent, kinds = {}, {}, 0, {}
    for step in sorted(by_step):
        record = by_step[step]
        sent += record.get("comm_bytes", 0)
        for key, value in record.items():
            if key.startswith("comm_bytes_") and key != INTRA_NODE_BYTES:
                kinds[key[len("comm_bytes_") :]] = kinds.get(key[len("comm_bytes_") :], 0) + value
        cumulative[step] = sent
        by_kind[step] = dict(kinds)
    run.update(
        strategy=strategy_key(config),
        world_size=_world_size(inputs.pretrain_dir),
        val_loss=[
            (s * batch, by_step[s]["val_mlm_loss"])
            for s in sorted(by_step)
            if "val_mlm_loss" in by_step[s]
        ],  # fmt: skip
        bytes_at=cumulative,
        bytes_by_kind_at=by_kind,
        stages={s: by_step[s]["stage"] for s in by_step if "stage" in by_step[s]},
        comm_bytes_by_kind=kinds,
        outer_every=(config.get("strategy") or {}).get("outer_every"),
        data_path=(config.get("data") or {}).get("path"),
        data=data_of_dir((config.get("data") or {}).get("path")),
    )
    return run


def recipe_name(key: str | None) -> str:
    """The recipe of a :func:`strategy_key` (``decentlam/ring`` -> ``decentlam``,
    ``hybrid_onebit_lamb:int8`` -> ``hybrid_onebit_lamb``); empty for None."""
    return (key or "").partition(":")[0].partition("/")[0]


def check_netem_setting(run: dict, netem: dict | None) -> None:
    """A local-step run's modelled time is only its own when the benchmark measured its
    recipe at the run's round length and with the run's inner optimizer."""
    key = run.get("strategy")
    if netem is None or key not in RECIPES:
        return
    recipe = get_recipe(key)
    if recipe.measure != "local_steps" or not speeds(netem, key, run["world_size"]):
        return
    where = run["pretrain_dir"]
    tau = rounds_of(netem, key)
    if run.get("outer_every") is not None and tau != run["outer_every"]:
        raise ValueError(
            f"{run['name']} ({where}) runs rounds of {run['outer_every']} steps but the netem "
            f"benchmark measured {key} at {tau}; rerun bench.netem with --outer-every "
            f"...,{key}={run['outer_every']}"
        )
    inner = inner_optimizer(netem, key) or recipe.optimizer
    if run["optimizer"] != inner:
        raise ValueError(
            f"{run['name']} ({where}) steps {run['optimizer']} inside but the netem benchmark "
            f"measured {key} with {inner}; rerun bench.netem with --inner "
            f"{key}={run['optimizer']}"
        )


def _world_size(run_dir: Path) -> int | None:
    """The number of ranks the run trained on (its status file)."""
    try:
        status = pretrain_outputs.read_status(run_dir)
    except pretrain_outputs.StatusUnreadable:
        return None
    return int(status["world_size"]) if status and status.get("world_size") else None


# ----------------------------------------------------------------------------- the target


def _value_at_step(series: dict[int, float], step: float) -> float:
    """Linear interpolation of a per-step cumulative series at a fractional step."""
    lo = math.floor(step)
    hi = math.ceil(step)
    a = series.get(lo, series.get(max((s for s in series if s <= lo), default=0), 0))
    b = series.get(hi, a)
    return a + (b - a) * (step - lo)


def time_to_target(run: dict, target: float, netem: dict | None) -> dict:
    """Samples, bytes (total and per kind) and modelled seconds per bandwidth to reach
    ``target`` (all None when the run never does)."""
    batch = run["global_batch_size"]
    samples = samples_to_target(run["val_loss"], target)
    out = {"target_loss": target, "reached": samples is not None, "samples": samples}
    measured = speeds(netem, run["strategy"], run["world_size"])
    if samples is None:
        out.update(bytes=None, bytes_by_kind=None, seconds={}, measured_bandwidths=sorted(measured))
        return out
    step = samples / batch
    out["steps"] = step
    out["bytes"] = _value_at_step(run["bytes_at"], step)
    kinds = {k for v in run["bytes_by_kind_at"].values() for k in v}
    out["bytes_by_kind"] = {
        k: _value_at_step({s: v.get(k, 0) for s, v in run["bytes_by_kind_at"].items()}, step)
        for k in sorted(kinds)
    }
    out["stage_steps"] = stage_steps(run, step)
    out["seconds"] = seconds_by_bandwidth(out["stage_steps"], batch, measured)
    out["measured_bandwidths"] = sorted(measured)
    return out


# ----------------------------------------------------------------------------- verdicts


def pretraining_table(arms: list[dict]) -> dict:
    """Final validation MLM loss and accuracy per strategy (mean ± std), with verdicts."""
    return final_metrics_table(arms, ("val_mlm_loss", "val_mlm_accuracy"), verdict)


def finetune_table(arms: list[dict]) -> dict:
    """Per task: the main metric per strategy (mean ± std over pretraining × fine-tuning
    seeds), each run's value, and the verdict against the reference."""
    tasks = sorted(set.intersection(*(set(r["finetune"]) for a in arms for r in a["seeds"])))
    table = {}
    for task in tasks:
        main = arms[0]["seeds"][0]["finetune"][task].get("main_metric")
        per_arm = {arm["name"]: finetune_summary(arm, task, main) for arm in arms}
        per_run = {}
        for arm in arms:
            for run in arm["seeds"]:
                values = finetune_values(run, task, main)
                per_run[f"{arm['name']}-seed{run['seed']}"] = {
                    "strategy": arm["name"],
                    "seed": run["seed"],
                    main: sum(values) / len(values),
                    "finetune_seeds": len(values),
                }
        ref = per_arm[arms[0]["name"]]
        for arm in arms[1:]:
            row = per_arm[arm["name"]]
            row["difference"] = row["mean"] - ref["mean"]
            row.update(verdict(ref["pretrain_seed_means"], row["pretrain_seed_means"]))
        table[task] = {"main_metric": main, "strategies": per_arm, "runs": per_run}
    return table


# ----------------------------------------------------------------------------- the report


def build(
    run_specs: list[str],
    netem: dict | None,
    target_loss: float | None,
    prior: list[dict] | None = None,
) -> dict:
    """Everything ``report.json`` holds (and the arms, for the figures and markdown).
    ``prior``: earlier reports (:func:`load_prior`) whose runs join ahead of ``run_specs``,
    as those reports measured them."""
    prior = list(prior or [])
    fresh = [load_timed_run(spec) for spec in run_specs]
    runs = [*(r for p in prior for r in p["runs"]), *fresh]
    seen: dict[tuple[str, str], str] = {}
    for run in runs:
        where = run.get("carried_from") or run["pretrain_dir"]
        key = (run["name"], str(run["seed"]))
        if key in seen:
            raise ValueError(
                f"{run['name']} seed {run['seed']} is given twice ({seen[key]} and {where}): "
                "give each run once (a report that carries another already holds its runs)"
            )
        seen[key] = where
    arms = group_arms(runs)
    if len(arms) < 2:
        raise ValueError("a comparison needs runs of at least two names (NAME=PRETRAIN:FINETUNE)")
    reference = arms[0]
    ref_final = [r["final"]["val_mlm_loss"] for r in reference["seeds"]]
    source = "given (--target-loss)"
    if prior:
        target_loss, source = _prior_target(prior, target_loss)
    elif target_loss is None:
        if any(v is None for v in ref_final):
            raise ValueError(f"reference {reference['name']!r} has no final validation loss")
        target_loss = sum(ref_final) / len(ref_final)
        source = (f"{reference['name']}'s final validation MLM loss, mean over "
                  f"{len(ref_final)} seed(s)")  # fmt: skip
    for run in fresh:
        check_netem_setting(run, netem)
    for run in fresh:
        run["time_to_target"] = time_to_target(run, target_loss, netem)
        run["curve"] = curve(run, netem)
    return {
        "arms": arms,
        "runs": runs,
        "prior": [
            {
                "path": p["path"],
                "names": p["names"],
                **({"dropped": p["dropped"]} if p.get("dropped") else {}),
            }
            for p in prior
        ],
        "target": {
            "val_mlm_loss": target_loss,
            "from": source,
        },
        "pretraining": pretraining_table(arms),
        "finetune": finetune_table(arms),
    }


def curve(run: dict, netem: dict | None) -> list[dict]:
    """Per validation point: samples seen, the loss, the bytes rank 0 had sent by then and
    the modelled seconds per measured bandwidth; what the figures plot, and what a later
    report that carries this run (``--prior``) plots without its run directory."""
    batch = run["global_batch_size"]
    measured = speeds(netem, run["strategy"], run["world_size"])
    points = []
    for samples, loss in run["val_loss"]:
        split = stage_steps(run, samples / batch)
        points.append({
            "samples": samples,
            "val_mlm_loss": loss,
            "bytes": run["bytes_at"].get(round(samples / batch), 0),
            "stage_steps": split,
            "seconds": seconds_by_bandwidth(split, batch, measured),
        })  # fmt: skip
    return points


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
    Each name must be carried and none may be the reference (the first carried name)."""
    if not names:
        return
    if not prior:
        raise ValueError("--drop leaves names out of earlier reports: give them (--prior)")
    carried = [n for p in prior for n in p["names"]]
    for name in names:
        if name not in carried:
            raise ValueError(
                f"--drop {name}: no carried report has runs of that name (carried: "
                f"{', '.join(carried)})"
            )
        if name == carried[0]:
            raise ValueError(f"--drop {name}: it is the reference of the carried reports")
    recipes = set(names)  # a tuning record is keyed by the recipe its runs ran
    for p in prior:
        for run in p["runs"]:
            if run["name"] in names and run.get("strategy"):
                recipes.add(run["strategy"].split(":")[0].split("/")[0])
    for p in prior:
        p["dropped"] = [n for n in p["names"] if n in names]
        p["dropped_recipes"] = sorted(recipes)
        p["runs"] = [r for r in p["runs"] if r["name"] not in names]
        p["names"] = [n for n in p["names"] if n not in names]
        p["tuning"] = {k: v for k, v in p["tuning"].items() if k not in recipes}


def _prior_target(prior: list[dict], target_loss: float | None) -> tuple[float, str]:
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


def _run_record(run: dict) -> dict:
    if "carried_from" in run:
        keep = {k: v for k, v in run.items() if k not in ("val_loss", "finetune")}
        keep["final"] = {k: v for k, v in run["final"].items() if k != "final_train_loss"}
        return keep
    return {
        "name": run["name"],
        "strategy": run["strategy"],
        "seed": run["seed"],
        "optimizer": run["optimizer"],
        "pretrain_dir": run["pretrain_dir"],
        "world_size": run["world_size"],
        "global_batch_size": run["global_batch_size"],
        "steps": run["steps"],
        "final": {
            "val_mlm_loss": run["final"]["val_mlm_loss"],
            "val_mlm_accuracy": run["final"]["val_mlm_accuracy"],
            "val_nsp_accuracy": run["final"].get("val_nsp_accuracy"),
        },
        "final_train_loss": run["final"]["final_train_loss"],
        "comm_bytes_total": run["comm_bytes_total"],
        "comm_bytes_by_kind": run["comm_bytes_by_kind"],
        "time_to_target": run["time_to_target"],
        "val_mlm_loss": run["val_loss"],
        "curve": run["curve"],
        "data": run.get("data"),
    }


def report_json(data: dict, netem_paths: list[str], netem: dict | None) -> dict:
    """``report.json``: the parity report's shape (``runs``, ``finetune``) plus the target,
    the time model and the comparison tables."""
    return {
        "test": TEST,
        "target": data["target"],
        "time_model": {
            "how": "sum over steps up to the crossing of global batch / measured samples/s of "
            "the strategy in that step's stage, at each bandwidth, on the run's number of ranks",
            "netem": netem_paths,
            "carried_runs_retimed": bool(data.get("retimed")),
            "netem_model": None if netem is None else netem.get("model"),
            "netem_seq_length": None if netem is None else netem.get("seq_length"),
        },
        "prior": data["prior"],
        "runs": [_run_record(r) for r in data["runs"]],
        "pretraining": data["pretraining"],
        "finetune": data["finetune"],
    }


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _human_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


def _mean_of(runs: list[dict], get) -> float | None:
    values = [get(r) for r in runs]
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def _with_censored(seeds: list[dict], get) -> tuple[float | None, bool]:
    """Mean over every seed of a to-target figure (``get(block)``), a seed that missed the
    target counting with its run's end (``run_end``); and whether that makes the mean a
    lower bound. None when a seed has no value."""
    values, censored = [], False
    for run in seeds:
        block = run["time_to_target"]
        if not block.get("reached"):
            censored = True
            block = block.get("run_end") or {}
        value = get(block)
        if value is None:
            return None, censored
        values.append(value)
    return (sum(values) / len(values) if values else None), censored


def strategy_rows(data: dict, bandwidths: list[float]) -> list[dict]:
    """One row per strategy for the markdown table: means over its seeds. Samples and
    times to the target are means over every seed, one that missed the target counting
    with its run's end (a lower bound: ``censored``); bytes to the target over the seeds
    that reached it (``reached`` says how many)."""
    rows = []
    for arm in data["arms"]:
        seeds = arm["seeds"]
        hit = [r for r in seeds if r["time_to_target"]["reached"]]
        kinds = sorted({k for r in seeds for k in r["comm_bytes_by_kind"]})
        rows.append(
            {
                "name": arm["name"],
                "strategy": seeds[0]["strategy"],
                "seeds": [r["seed"] for r in seeds],
                "loss": data["pretraining"]["val_mlm_loss"][arm["name"]],
                "accuracy": data["pretraining"]["val_mlm_accuracy"][arm["name"]],
                "bytes": _mean_of(seeds, lambda r: r["comm_bytes_total"]),
                "bytes_by_kind": {
                    k: _mean_of(seeds, lambda r, k=k: r["comm_bytes_by_kind"].get(k, 0))
                    for k in kinds
                },
                "reached": f"{len(hit)}/{len(seeds)}",
                "samples": _with_censored(seeds, lambda b: b.get("samples")),
                "bytes_to_target": _mean_of(hit, lambda r: r["time_to_target"]["bytes"]),
                "seconds": {
                    bw: _with_censored(
                        seeds, lambda b, bw=bw: (b.get("seconds") or {}).get(f"{bw:g}")
                    )
                    for bw in bandwidths
                },
            }
        )
    return rows


def _bounded(value: tuple[float | None, bool], text) -> str:
    mean, censored = value
    if mean is None:
        return "–"
    return ("≥ " if censored else "") + text(mean)


def winners(data: dict) -> list[dict]:
    """Per measured bandwidth, the recipes that reach the target first, as groups
    (:func:`pipeline.reports.ranking.groups`: the leaders the seeds cannot tell apart, the recipes
    clearly behind, seeds that missed the target counted with a lower bound)."""
    bandwidths = sorted(
        {bw for r in data["runs"] for bw in r["time_to_target"]["measured_bandwidths"]}
    )
    return ranking.groups(data["arms"], bandwidths)


def _bandwidth_label(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def strategy_table_lines(rows: list[dict], bandwidths: list[float]) -> list[str]:
    """The strategies table of ``report.md`` (:func:`strategy_rows`)."""
    head = ["strategy", "seeds", "val MLM loss", "val MLM accuracy", "bytes/rank",
            "seeds at target", "samples to target", "bytes to target"]  # fmt: skip
    head += [f"time to target @ {_bandwidth_label(bw)}" for bw in bandwidths]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in rows:
        loss, acc = row["loss"], row["accuracy"]
        loss_cell = _mean_std(loss["mean"], loss["std"], len(row["seeds"]))
        if "verdict" in loss:
            loss_cell += f" ({loss['verdict']})"
        cells = [
            f"{row['name']} (`{row['strategy'] or NO_RECIPE}`)",
            ", ".join(map(str, row["seeds"])),
            loss_cell,
            _mean_std(acc["mean"], acc["std"], len(row["seeds"])),
            _human_bytes(row["bytes"]),
            row["reached"],
            _bounded(row["samples"], lambda v: f"{v:,.0f}"),
            _human_bytes(row["bytes_to_target"]),
            *(_bounded(row["seconds"][bw], _human_seconds) for bw in bandwidths),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(data: dict, netem_paths: list[str], netem: dict | None) -> str:
    """``report.md``: the target, the strategy table, the plots, the fine-tuning table."""
    bandwidths = sorted(
        {bw for r in data["runs"] for bw in r["time_to_target"]["measured_bandwidths"]}
    )
    rows = strategy_rows(data, bandwidths)
    ref = data["arms"][0]["name"]
    target = data["target"]
    lines = [
        "# Comparison report",
        "",
        f"Reference: **{ref}**. Target validation MLM loss **{target['val_mlm_loss']:.4f}** "
        f"({target['from']}). Verdicts: {TEST}",
        "",
        "## Strategies",
        "",
    ]
    lines += strategy_table_lines(rows, bandwidths)
    kinds = sorted({k for row in rows for k in row["bytes_by_kind"]})
    lines += [
        "",
        "Samples and times to the target are means over every seed: a seed that never "
        "reached the target counts with its run's end, a lower bound, and the mean is then "
        "one too (≥). Bytes to the target are means over the seeds that reached it. Bytes "
        "are what rank 0's communicator counted.",
        "",
        *_prior_lines(data, netem),
        "Bytes sent per rank over the whole run, by kind of traffic:",
        "",
    ]
    lines += ["| strategy | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for row in rows:
        cells = [_human_bytes(row["bytes_by_kind"].get(k)) for k in kinds]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    lines += ["", "### How the time is modelled", ""]
    if netem is None:
        lines.append(
            "No netem benchmark JSON was given (`--netem`): no modelled times. Run "
            '`make bench-netem ARGS="--strategies ..."` and pass its netem.json.'
        )
    else:
        lines.append(
            f"Speeds: {' + '.join(f'`{p}`' for p in netem_paths)} ({netem.get('model')}, "
            f"sequence length "
            f"{netem.get('seq_length')}, {netem.get('batch_per_rank')} sequences per rank per "
            "step, measured on emulated links). Samples and stages: this report's runs. "
            "Time to target = sum over the steps up to the crossing of global batch / the "
            "strategy's measured samples/s in that step's stage at that bandwidth on the same "
            "number of ranks. A strategy the benchmark did not measure has no time."
        )
        by_file: dict[str, list[str]] = {}
        for recipe, files in (netem.get("runs_from") or {}).items():
            for path in files:
                by_file.setdefault(path, []).append(recipe)
        if len(by_file) > 1:
            lines += [
                "",
                "The speeds come from separate runs of the benchmark ("
                + "; ".join(f"`{p}`: {', '.join(rs)}" for p, rs in by_file.items())
                + "), so ratios between them also carry the machine's run-to-run variation.",
            ]
        missing = sorted(
            {
                r["strategy"] or NO_RECIPE
                for r in data["runs"]
                if not r["time_to_target"]["measured_bandwidths"]
            }  # fmt: skip
        )
        if missing:
            lines.append(f"Not in the netem JSON: {', '.join(missing)}.")
    lines += [
        "",
        "![validation loss against samples](val_loss_samples.png)",
        "![validation loss against bytes](val_loss_bytes.png)",
    ]
    for bw in PLOT_BANDWIDTHS:
        if bw in bandwidths:
            lines.append(f"![validation loss against modelled time at {_bandwidth_label(bw)}]"
                         f"(val_loss_time_{bw:g}mbit.png)")  # fmt: skip
    lines += ["", *_finetune_lines(data), ""]
    return "\n".join(lines)


def _prior_lines(data: dict, netem: dict | None) -> list[str]:
    """Which runs come from earlier reports rather than from run directories."""
    if not data["prior"]:
        return []
    carried = "; ".join(f"`{p['path']}`: {', '.join(p['names'])}" for p in data["prior"])
    same = (
        "against the same target, except their modelled times, which are re-timed with this "
        "report's netem files (each record's steps per stage, stored or recovered from the "
        "times it was given by its own netem files, at the new speeds)"
        if data.get("retimed")
        else "against the same target and netem files"
    )
    dropped = [n for p in data["prior"] for n in p.get("dropped", [])]
    left_out = ""
    if dropped:
        names = ", ".join(dropped)
        left_out = f" Left out of them, to be replaced by this report's runs and tuning: {names}."
        measured = [
            f"{', '.join(r)} in `{f}`" for f, r in ((netem or {}).get("ignored") or {}).items()
        ]
        if measured:
            left_out += f" Their netem measurements are left out too: {'; '.join(measured)}."
    lines = [
        f"Carried from earlier reports ({carried}): their figures are as those reports "
        f"measured them, {same}; their run directories were not read, and they carry no "
        f"fine-tuning.{left_out}"
    ]
    lost = sorted({r["name"] for r in data["runs"] if r.get("retimed") is False})
    if lost:
        lines[0] += (
            f" Records whose steps per stage could not be recovered ({', '.join(lost)}) "
            "have no modelled time."
        )
    flat = sorted({r["name"] for r in data["runs"] if "carried_from" in r and not r.get("curve")})
    if flat:
        lines[0] += (
            f" Records without a stored curve ({', '.join(flat)}) appear in the plot against "
            "samples only."
        )
    return [*lines, ""]


def _finetune_lines(data: dict) -> list[str]:
    names = [a["name"] for a in data["arms"]]
    if not data["finetune"]:
        return [
            "## Fine-tuning",
            "",
            "No task was fine-tuned from every run (runs given as NAME=PRETRAIN_DIR, and runs "
            "carried from an earlier report, have no fine-tuning results): no fine-tuning "
            "verdicts.",
        ]
    lines = [
        "## Fine-tuning",
        "",
        "Main metric per task, mean ± std over pretraining × fine-tuning seeds; verdict "
        f"against {names[0]}.",
        "",
        "| task | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for task, info in data["finetune"].items():
        cells = []
        for name in names:
            row = info["strategies"][name]
            cell = _mean_std(row["mean"], row["std"], row["n"])
            if "verdict" in row:
                mark = f"**{row['verdict']}**" if row["verdict"] == "differs" else row["verdict"]
                cell += f" ({mark})"
            cells.append(cell)
        lines.append(f"| {task} | {info['main_metric']} | " + " | ".join(cells) + " |")
    return lines


def data_references(prior: list[dict], specs: list[str], data: dict,
                    netem: dict | None) -> list[dict]:  # fmt: skip
    """The carried and the given ``--data-reference`` runs, timed to the report's target;
    each (name, seed, data) once."""
    fresh = [load_timed_run(spec) for spec in specs]
    target = data["target"]["val_mlm_loss"]
    for run in fresh:
        run["time_to_target"] = time_to_target(run, target, netem)
        run["curve"] = curve(run, netem)
    runs = [*(r for p in prior for r in p.get("data_references", [])), *fresh]
    reference = data["arms"][0]["name"]
    seen: dict[tuple, str] = {}
    for run in runs:
        where = run.get("carried_from") or run["pretrain_dir"]
        if run["name"] != reference:
            raise ValueError(
                f"--data-reference {run['name']}={where}: the runs on other data must be the "
                f"reference's ({reference}=RUN_DIR), the recipe every strategy is set against"
            )
        data_key = tuple(sorted((run.get("data") or {}).items()))
        key = (run["name"], str(run["seed"]), data_key)
        if key in seen:
            raise ValueError(
                f"--data-reference {run['name']} seed {run['seed']} on the same data is given "
                f"twice ({seen[key]} and {where}): give it once"
            )
        seen[key] = where
    return runs


def write_report(
    run_specs: list[str],
    out: str | Path,
    netem_paths: str | list[str] | None = None,
    target_loss: float | None = None,
    tuning_paths: list[str] | None = None,
    allow_unequal_budgets: bool = False,
    prior_paths: list[str] | None = None,
    retime_prior: bool = False,
    drop_prior: list[str] | None = None,
    data_reference_specs: list[str] | None = None,
    mixed_data: bool = False,
) -> dict:
    """Build the comparison and write ``report.md``, ``report.json`` and the figures into
    ``out``; returns what ``report.json`` holds. ``tuning_paths``: the recipes' tuning
    records (:mod:`pipeline.tuning`), refused when their budgets differ unless
    ``allow_unequal_budgets``. ``prior_paths``: earlier reports whose runs (and tuning
    records) join this one as measured (:func:`load_prior`), with their times as measured
    unless ``retime_prior`` (:func:`retime`: with this report's netem files instead of
    theirs). ``drop_prior``: names whose carried runs and tuning records are left out
    (:func:`drop_carried`: a recipe tuned again replaces its earlier record).
    ``data_reference_specs``: runs of the reference's recipe on other data, each strategy
    set against those on its own data (:mod:`pipeline.reports.same_data`). Runs of more than
    one data identity are refused unless ``mixed_data``
    (:func:`pipeline.reports.same_data.data_identities`)."""
    from pipeline.reports.compare_plots import write_figures

    if isinstance(netem_paths, str):
        netem_paths = [netem_paths]
    netem_paths = list(netem_paths or [])
    prior = [load_prior(path) for path in prior_paths or []]
    drop_carried(prior, list(drop_prior or []))
    if retime_prior and not prior:
        raise ValueError("re-timing (--retime) needs an earlier report to carry (--prior)")
    if not retime_prior:
        check_prior_netem(prior, netem_paths)
    netem = load_netem(netem_paths, ignore=carried_netem_ignored(prior, netem_paths))
    if retime_prior:
        retime(prior, netem)
    carried_tuning = [record for p in prior for record in p["tuning"].values()]
    tuning = load_tuning(list(tuning_paths or []), allow_unequal_budgets, carried_tuning)
    data = build(list(run_specs or []), netem, target_loss, prior)
    data["retimed"] = retime_prior
    references = data_references(prior, list(data_reference_specs or []), data, netem)
    assign_data(data["runs"], tuning)
    identity = data_identities(data["runs"], mixed_data)
    ranking.attach_run_ends(data["arms"], netem)
    groups = same_data_groups(data["arms"], references, verdict)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_figures(data, out, PLOT_BANDWIDTHS)
    markdown = render_markdown(data, netem_paths, netem)
    ranked = winners(data)
    extra = [
        *mixed_data_lines(identity),
        *ranking.group_lines(ranked),
        *same_data_lines(groups, data["arms"][0]["name"]),
        *tuning_lines(tuning),
    ]
    result = {**report_json(data, netem_paths, netem), "tuning": tuning, "data": identity,
              "groups": ranked}  # fmt: skip
    paying = crossover.report_crossovers(result, netem_paths, data["arms"][0]["name"],
                                         ONEBIT)  # fmt: skip
    if paying:
        result["crossover"] = paying
        at = len(mixed_data_lines(identity)) + len(ranking.group_lines(ranked))
        extra[at:at] = crossover.crossover_lines(paying)  # after the groups
    sections = [markdown.rstrip("\n"), "\n".join(extra).rstrip("\n")] if extra else [markdown]
    atomic_write_text(out / "report.md", "\n\n".join(sections).rstrip("\n") + "\n")
    if references:
        result["data_references"] = [_run_record(r) for r in references]
        result["same_data"] = groups
    atomic_write_json(out / "report.json", result)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.compare --run NAME=PRETRAIN[:FINETUNE] ... [--netem J]
    --out DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.reports.compare",
        description="Compare strategies by samples-, bytes- and modelled time-to-target, and "
        "their fine-tuning; runs that share a NAME are seeds of one strategy; the first NAME "
        "is the reference.",
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        help="NAME=PRETRAIN[:FINETUNE] (without FINETUNE: pretraining only, no fine-tuning table)",
    )
    parser.add_argument(
        "--prior",
        action="append",
        default=[],
        help="an earlier comparison's report.json: its runs and tuning records join this "
        "report as it measured them (its target; pass its netem files too); for runs whose "
        "directories are gone. Its runs come first: its first name is the reference",
    )
    parser.add_argument(
        "--retime",
        action="store_true",
        help="with --prior: model the carried runs' times with this report's --netem files "
        "instead of the earlier report's (say, one sweep that measured every recipe "
        "together); the earlier netem files must still be readable at their recorded paths",
    )
    parser.add_argument(
        "--netem",
        action="append",
        help="a bench.netem netem.json with measured speeds; repeat to merge sweeps of the "
        "same settings at other bandwidths or world sizes, or of other recipes",
    )
    parser.add_argument("--target-loss", type=float, help="default: the reference's final")
    parser.add_argument(
        "--tuning",
        action="append",
        help="a tuning record JSON (pipeline.tuning: search space, trials, chosen setting); "
        "repeat per file; recipes with unequal budgets are refused",
    )
    parser.add_argument(
        "--allow-unequal-budgets",
        action="store_true",
        help="compare recipes tuned with unequal budgets (the report says so)",
    )
    parser.add_argument(
        "--drop",
        action="append",
        default=[],
        help="with --prior: leave this name's carried runs and tuning record out (a recipe "
        "tuned again, whose new runs and record replace them); repeatable",
    )
    parser.add_argument(
        "--data-reference",
        action="append",
        default=[],
        help="NAME=PRETRAIN: a run of the reference's recipe on other data; each strategy "
        "whose seeds ran on that data is also set against these runs; repeatable",
    )
    parser.add_argument(
        "--mixed-data",
        action="store_true",
        help="rank runs pretrained on different data identities together (refused "
        "otherwise; the report then flags it)",
    )
    parser.add_argument("--out", required=True, help="report directory")
    args = parser.parse_args(argv)
    if not args.run and not args.prior:
        parser.error("give runs (--run NAME=PRETRAIN[:FINETUNE]) or an earlier report (--prior)")
    try:
        write_report(args.run, args.out, args.netem, args.target_loss, args.tuning,
                     args.allow_unequal_budgets, args.prior, args.retime,
                     args.drop, args.data_reference, args.mixed_data)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {args.out}/report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
