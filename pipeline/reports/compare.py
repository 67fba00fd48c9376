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

import math
from pathlib import Path

from onebit_bert.io import atomic_write_json, atomic_write_text
from onebit_bert.recipes import RECIPES, field_value, get_recipe, identify
from onebit_bert.strategies.decentralized import DEFAULT_TOPOLOGY
from pipeline.reports import cli, crossover, ranking
from pipeline.reports.compare_markdown import PLOT_BANDWIDTHS, render_markdown, winners
from pipeline.reports.compare_prior import (
    carried_netem_ignored,
    check_prior_netem,
    drop_carried,
    load_prior,
    prior_target,
    retime,
)
from pipeline.reports.gate import samples_to_target
from pipeline.reports.runs import (
    INTRA_NODE_BYTES,
    VERDICT_TEST,
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
from pipeline.reports.timing import (
    inner_optimizer,
    load_netem,
    rounds_of,
    seconds_by_bandwidth,
    seconds_by_repeat,
    speeds,
    speeds_by_repeat,
    stage_steps,
)
from pipeline.run_files import read_totals
from pipeline.tuning import load_tuning, tuning_lines
from pretrain import outputs as pretrain_outputs

ONEBIT = "onebit_lamb"
"""The recipe whose crossover against the reference the report gives (where both reached the
target and were measured)."""
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
    kept = read_totals(inputs.pretrain_dir)
    if kept and kept.get("every", 1) != 1:
        raise ValueError(
            f"{inputs.name}={inputs.pretrain_dir}: an archived record that keeps every "
            f"{kept['every']}th step (python -m pipeline.reports.archive); the comparison sums "
            "bytes to the target and times each stage over every step: give the run "
            "directory, or carry a report that read it (--prior)"
        )
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
    repeated = seconds_by_repeat(
        out["stage_steps"], batch, speeds_by_repeat(netem, run["strategy"], run["world_size"])
    )
    if repeated:
        out["seconds_by_repeat"] = repeated
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
        target_loss, source = prior_target(prior, target_loss)
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
                **({"promoted": p["promoted"]} if p.get("promoted") else {}),
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
        "test": VERDICT_TEST,
        "target": data["target"],
        "time_model": {
            "how": "sum over steps up to the crossing of global batch / measured samples/s of "
            "the strategy in that step's stage, at each bandwidth, on the run's number of ranks",
            "netem": netem_paths,
            "carried_runs_retimed": bool(data.get("retimed")),
            "netem_model": None if netem is None else netem.get("model"),
            "netem_seq_length": None if netem is None else netem.get("seq_length"),
            "sweeps": None if netem is None else netem.get("sweeps"),
        },
        "prior": data["prior"],
        "runs": [_run_record(r) for r in data["runs"]],
        "pretraining": data["pretraining"],
        "finetune": data["finetune"],
    }


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
    groups_config: str | None = None,
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
    (:func:`pipeline.reports.same_data.data_identities`). ``groups_config``: the groups'
    pre-registered margin and seed count (:func:`pipeline.reports.ranking.load_preregistration`),
    stated under the groups with the seeds still owed."""
    from pipeline.reports.compare_plots import write_figures

    plan = ranking.load_preregistration(groups_config) if groups_config else None
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
    result = {**report_json(data, netem_paths, netem), "tuning": tuning, "data": identity,
              "groups": ranked}  # fmt: skip
    if plan:
        result["groups_preregistration"] = plan.as_dict()
    paying = crossover.report_crossovers(result, netem_paths, data["arms"][0]["name"],
                                         ONEBIT, figure=out / "crossover.png")  # fmt: skip
    if paying:
        result["crossover"] = paying
    extra = [
        *mixed_data_lines(identity),
        *ranking.group_lines(ranked),
        *(ranking.preregistration_lines(plan, result) if plan else []),
        *crossover.crossover_lines(paying),
        *same_data_lines(groups, data["arms"][0]["name"]),
        *tuning_lines(tuning),
    ]
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
    parser = cli.report_parser(
        "pipeline.reports.compare",
        "Compare strategies by samples-, bytes- and modelled time-to-target, and their "
        "fine-tuning; runs that share a NAME are seeds of one strategy; the first NAME is the "
        "reference.",
        "NAME=PRETRAIN[:FINETUNE] (without FINETUNE: pretraining only, no fine-tuning table)",
        runs_required=False,
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
    parser.add_argument(
        "--preregistered",
        help="the groups' pre-registered test, margin and seed count (say "
        f"{ranking.PREREGISTERED}): stated under the groups with the seeds still owed",
    )

    def write(args) -> str:
        if not args.run and not args.prior:
            parser.error(
                "give runs (--run NAME=PRETRAIN[:FINETUNE]) or an earlier report (--prior)"
            )
        write_report(args.run, args.out, args.netem, args.target_loss, args.tuning,
                     args.allow_unequal_budgets, args.prior, args.retime,
                     args.drop, args.data_reference, args.mixed_data,
                     args.preregistered)  # fmt: skip
        return f"report: {args.out}/report.md"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
