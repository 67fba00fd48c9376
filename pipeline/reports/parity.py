"""The parity report: do pretraining recipes (e.g. LAMB vs 1-bit LAMB) give the same model?

Input: runs given as ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` (a pretraining run directory with
its ``metrics.jsonl`` and ``config.yaml``, and a fine-tuning output directory with its
``results.json``). Runs that share a NAME are the pretraining seeds of one *arm*. Output,
in one directory: ``report.md``, ``report.json`` and PNG plots (pretraining loss with the
freeze step marked, validation MLM accuracy against samples seen, the 1-bit switch
diagnostics, fine-tuning scores per task; drawn by :mod:`pipeline.reports.parity_plots`).

Statistics (see :data:`TEST`): pretraining metrics are mean ± std over an arm's
pretraining seeds; fine-tuning metrics are mean ± std over pretraining × fine-tuning seeds.
Each arm is compared with the first one by Welch's two-sided t-test on its
per-pretraining-seed values (for fine-tuning, each pretraining seed's mean over its
fine-tuning seeds), so the verdict rests on the spread between pretraining runs, not only
between fine-tuning seeds of one checkpoint. With a single pretraining seed in either arm
there is no verdict.
"""

from __future__ import annotations

import math
from pathlib import Path

from finetune import outputs as finetune_outputs
from onebit_bert.io import atomic_write_json, atomic_write_text
from pipeline.reports import cli
from pipeline.reports import gate as gating
from pipeline.reports.parity_markdown import render_markdown
from pipeline.reports.parity_plots import (
    plot_samples_to_target,
    plot_sensitivity,
    plot_val_loss_target,
    write_figures,
)
from pipeline.reports.runs import (
    NO_SIGNAL,
    PRETRAIN_METRICS,
    SIGNAL_FACTOR,
    TEST,
    check_pairing,
    final_metrics_table,
    finetune_summary,
    finetune_values,
    group_arms,
    load_runs,
    no_verdict,
    welch_verdict,
)
from pipeline.reports.stats import mean_std
from pipeline.target import parse_utc, read_target

SPREAD_LIMIT = 0.02
"""The regime is tight enough when the reference's final validation loss spreads by at
most this fraction of its mean over its seeds."""


def compare_pretraining(arms: list[dict]) -> dict:
    """Per final pretraining metric: each arm's mean ± std over pretraining seeds and the
    verdict against the first arm."""
    return final_metrics_table(arms, PRETRAIN_METRICS, welch_verdict)


def finetune_spread(arm: dict, task: str, metric: str) -> float | None:
    """The fine-tuning seed spread of one arm: the root mean square over its pretraining
    seeds of the std between fine-tuning seeds of one checkpoint (None with one
    fine-tuning seed)."""
    variances = []
    for run in arm["seeds"]:
        values = finetune_values(run, task, metric)
        if len(values) > 1:
            variances.append(mean_std(values)[1] ** 2)
    return math.sqrt(sum(variances) / len(variances)) if variances else None


def task_signal(reference: dict, baseline: dict, task: str, metric: str) -> dict:
    """Does pretraining beat random initialisation on ``task`` by ``SIGNAL_FACTOR``
    fine-tuning seed spreads (the larger of the two arms' spreads)?"""
    ref = [v for r in reference["seeds"] for v in finetune_values(r, task, metric)]
    base = [v for r in baseline["seeds"] for v in finetune_values(r, task, metric)]
    spreads = [s for s in (finetune_spread(reference, task, metric),
                           finetune_spread(baseline, task, metric)) if s is not None]  # fmt: skip
    gap = mean_std(ref)[0] - mean_std(base)[0]
    spread = max(spreads) if spreads else None
    if spread is None:
        signal, why = False, "one fine-tuning seed: the spread is unknown"
    else:
        signal = gap >= SIGNAL_FACTOR * spread and gap > 0
        why = f"gap {gap:+.4f} vs {SIGNAL_FACTOR:g} x spread {spread:.4f}"
    return {"metric": metric, "gap": gap, "spread": spread, "signal": signal, "why": why}


def fine_tuned(arms: list[dict]) -> list[dict]:
    """The arms that have fine-tuned pretraining seeds, each restricted to them (the table's
    ``n`` says how many scores each arm's row rests on); [] unless the reference arm (the
    first) and at least one other have one. An arm without any is left out of the table,
    and the report names it."""
    kept = [{**a, "seeds": [r for r in a["seeds"] if r["finetune"]]} for a in arms]
    kept = [a for i, a in enumerate(kept) if a["seeds"] or i == 0]
    return kept if kept[0]["seeds"] and len(kept) >= 2 else []


def compare_finetuning(arms: list[dict], baseline: dict | None = None) -> dict:
    """Per task and metric: each arm's mean ± std over pretraining × fine-tuning seeds, its
    per-pretraining-seed means, and the verdict against the first arm. With a randomly
    initialised ``baseline`` (an arm-shaped dict), each task also gets the baseline's score
    and whether it carries signal (:func:`task_signal`); tasks without signal get no
    verdict."""
    holders = [r for a in arms for r in a["seeds"]] + (baseline["seeds"] if baseline else [])
    tasks = sorted(set.intersection(*(set(r["finetune"]) for r in holders)))
    reference = arms[0]
    table = {}
    for task in tasks:
        first = reference["seeds"][0]["finetune"][task]
        metrics = sorted(
            k for k, v in first.items() if isinstance(v, int | float) and k not in ("lr", "epochs")
        )
        rows = {}
        for metric in metrics:
            per_arm = {arm["name"]: finetune_summary(arm, task, metric) for arm in arms}
            ref = per_arm[reference["name"]]
            for arm in arms[1:]:
                row = per_arm[arm["name"]]
                row["difference"] = row["mean"] - ref["mean"]
                row.update(welch_verdict(ref["pretrain_seed_means"], row["pretrain_seed_means"]))
                interval = gating.difference_interval(
                    ref["pretrain_seed_means"], row["pretrain_seed_means"]
                )
                row["interval"] = (
                    None if interval["low"] is None else [interval["low"], interval["high"]]
                )
            if baseline is not None:
                scores = finetune_summary(baseline, task, metric)
                per_arm[baseline["name"]] = {k: scores[k] for k in ("mean", "std", "n")}
            rows[metric] = per_arm
        entry = {"main_metric": first.get("main_metric"), "metrics": rows}
        if baseline is not None:
            main = first.get("main_metric") or next(iter(rows))
            entry["signal"] = task_signal(reference, baseline, task, main)
            if not entry["signal"]["signal"]:
                for per_arm in rows.values():
                    for arm in arms[1:]:
                        per_arm[arm["name"]].update(no_verdict(NO_SIGNAL))
        table[task] = entry
    return table


def gate_table(
    arms: list[dict],
    target: dict,
    margin: float = gating.MARGIN,
    alpha: float = gating.ALPHA,
    min_seeds: int = gating.MIN_SEEDS,
    test: str = "welch",
    preregistered: str | None = None,
    arms_fixed: dict[str, str] | None = None,
) -> dict:
    """Samples to ``target`` per seed, the gate for every arm against the first, the final
    validation loss difference with its 95 % interval, and the reference's seed spread.
    ``test``: the primary test, ``welch`` or ``paired`` (then
    :func:`pipeline.reports.gate.paired_gate` over seed-matched pairs, ``min_seeds`` the
    pre-registered pairs, with Welch's verdict and the olympic means as secondary lines);
    ``preregistered``: when the test was fixed; ``arms_fixed``: arm name -> when that
    candidate arm was added under the test, for an arm added after ``preregistered``
    (each is checked against its own runs' first steps)."""
    value = target["value"]
    names = {arm["name"] for arm in arms[1:]}
    if unknown := sorted(set(arms_fixed or {}) - names):
        raise ValueError(
            f"pre-registration of arm(s) {', '.join(unknown)}: no such candidate arm "
            f"(candidates: {', '.join(sorted(names))})"
        )
    per_seed = {
        arm["name"]: [
            {
                "seed": r["seed"],
                "samples_to_target": gating.samples_to_target(r["val_mlm_loss"], value),
                "max_samples": r["max_samples"],
                "final_val_mlm_loss": r["final"]["val_mlm_loss"],
            }
            for r in arm["seeds"]
        ]
        for arm in arms
    }
    reference = arms[0]["name"]
    ref_samples = [row["samples_to_target"] for row in per_seed[reference]]
    ref_final = [row["final_val_mlm_loss"] for row in per_seed[reference]]
    gates, losses, welch, olympic = {}, {}, {}, {}
    for arm in arms[1:]:
        rows = per_seed[arm["name"]]
        cand_samples = [r["samples_to_target"] for r in rows]
        try:
            welch[arm["name"]] = gating.gate(
                ref_samples, cand_samples, margin, alpha, min_seeds
            ).as_dict()
        except ValueError as err:
            welch[arm["name"]] = {"verdict": "no verdict", "reason": str(err)}
        if test == "paired":
            try:
                check_pairing(arms[0], arm)
                gates[arm["name"]] = gating.paired_gate(
                    {r["seed"]: r["samples_to_target"] for r in per_seed[reference]},
                    {r["seed"]: r["samples_to_target"] for r in rows},
                    margin,
                    alpha,
                    planned_pairs=min_seeds,
                ).as_dict()
            except ValueError as err:
                gates[arm["name"]] = {"verdict": "no verdict", "reason": str(err)}
        else:
            gates[arm["name"]] = welch[arm["name"]]
        reached = [v for v in cand_samples if v is not None]
        olympic[arm["name"]] = (
            gating.olympic_mean(reached) / gating.olympic_mean(ref_samples)
            if reached and len(reached) == len(cand_samples) and all(ref_samples)
            else None
        )
        losses[arm["name"]] = gating.difference_interval(
            ref_final, [r["final_val_mlm_loss"] for r in rows]
        )
    mean, std = mean_std(ref_final)
    return {
        "target": target,
        "fixed_before": fixed_before(arms[1:], target),
        "test": test,
        "test_text": gating.PAIRED_TEST if test == "paired" else gating.TEST,
        "preregistered": preregistered,
        "preregistered_before": None
        if preregistered is None
        else started_after(arms[1:], preregistered),
        "arms_fixed": {
            name: {
                "at": stamp,
                "before": started_after([a for a in arms if a["name"] == name], stamp),
            }
            for name, stamp in (arms_fixed or {}).items()
        },
        "welch": welch if test == "paired" else None,
        "olympic_ratio": olympic,
        "margin": margin,
        "alpha": alpha,
        "min_seeds": min_seeds,
        "per_seed": per_seed,
        "gates": gates,
        "final_loss_difference": losses,
        "reference_spread": {
            "arm": reference,
            "seeds": len(ref_final),
            "mean": mean,
            "std": std,
            "relative": std / mean,
            "limit": SPREAD_LIMIT,
            "within_limit": std / mean <= SPREAD_LIMIT,
        },
    }


def fixed_before(arms: list[dict], target: dict) -> str:
    """Whether the target was fixed before every run of ``arms`` logged its first step
    (the runs' own clocks: metrics records carry a Unix time)."""
    return started_after(arms, target.get("fixed_at"))


def started_after(arms: list[dict], stamp: str | None) -> str:
    """Whether the UTC time ``stamp`` lies before every run of ``arms`` logged its first
    step (the runs' own clocks: metrics records carry a Unix time)."""
    starts = {
        f"{a['name']} seed {r['seed']}": r["started"]
        for a in arms
        for r in a["seeds"]
        if r.get("started") is not None
    }
    if not stamp or not starts:
        return "not checked: no times recorded"
    fixed = parse_utc(stamp).timestamp()
    early = sorted(name for name, start in starts.items() if start < fixed)
    if early:
        return f"**after** {', '.join(early)} had started"
    return f"before any of the other arms' {len(starts)} runs started"


def sensitivity_rows(runs: list[dict], target: dict | None) -> list[dict]:
    """One row per sensitivity run: its freeze step (and share of the run), final
    validation loss and samples to target."""
    rows = []
    for run in runs:
        steps = run["max_samples"] // run["global_batch_size"]
        freeze = run["freeze_step"]
        rows.append(
            {
                "name": run["name"],
                "seed": run["seed"],
                "freeze_step": freeze,
                "freeze_rule": "auto" if run.get("freeze_auto") else "fixed",
                "freeze_fraction": freeze / steps if isinstance(freeze, int) else None,
                "final_val_mlm_loss": run["final"]["val_mlm_loss"],
                "samples_to_target": None
                if target is None
                else gating.samples_to_target(run["val_mlm_loss"], target["value"]),
                "max_samples": run["max_samples"],
            }
        )
    return rows


def load_arms(run_specs: list[str]) -> list[dict]:
    """Load every ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` run and group them into arms (two or
    more)."""
    arms = group_arms(load_runs(run_specs))
    if len(arms) < 2:
        raise ValueError(
            "a parity report needs at least two runs with different names "
            "(NAME=PRETRAIN:FINETUNE; a repeated NAME adds a pretraining seed)"
        )
    return arms


def report_data(
    arms: list[dict],
    pretraining: dict,
    finetuning: dict,
    gate: dict | None = None,
    sensitivity: list[dict] | None = None,
) -> dict:
    """``report.json``: the test, each arm's seeds (without curves and fine-tuning results)
    and both comparison tables."""
    return {
        "test": TEST,
        "arms": [
            {
                "name": a["name"],
                "optimizer": a["optimizer"],
                "seeds": [
                    {k: v for k, v in r.items() if k not in ("train_loss", "finetune", "switch")}
                    for r in a["seeds"]
                ],
            }
            for a in arms
        ],
        "pretraining": pretraining,
        "finetune": finetuning,
        "gate": gate,
        "sensitivity": sensitivity or [],
    }


def load_baseline(spec: str) -> dict:
    """``NAME=FINETUNE_DIR`` of the randomly initialised baseline, as an arm-shaped dict."""
    name, sep, directory = spec.partition("=")
    if not (sep and name and directory):
        raise ValueError(f"baseline {spec!r} is not of the form NAME=FINETUNE_DIR")
    path = finetune_outputs.results_path(Path(directory))
    if not path.is_file():
        raise FileNotFoundError(f"baseline {name!r}: {path} is missing")
    return {"name": name, "seeds": [{"finetune": finetune_outputs.read_results(directory)}]}


def write_report(
    run_specs: list[str],
    out: str | Path,
    target: dict | None = None,
    sensitivity_specs: list[str] = (),
    baseline_spec: str | None = None,
    **gate_settings,
) -> dict:
    """Compare the runs and write ``report.md``, ``report.json`` and the figures into
    ``out``; returns what ``report.json`` holds. With a ``target`` (:mod:`pipeline.target`)
    the report opens with the gate (``gate_settings``: :func:`gate_table`'s test and its
    settings); ``sensitivity_specs`` (``NAME=PRETRAIN_DIR``) are shown apart;
    ``baseline_spec`` (``NAME=FINETUNE_DIR``) is the randomly initialised fine-tuning
    baseline that decides which tasks carry signal."""
    arms = load_arms(run_specs)
    baseline = load_baseline(baseline_spec) if baseline_spec else None
    sensitivity_runs = load_runs(sensitivity_specs)
    pretraining = compare_pretraining(arms)
    finetuning = compare_finetuning(finetuned, baseline) if (finetuned := fine_tuned(arms)) else {}
    gate = gate_table(arms, target, **gate_settings) if target else None
    sensitivity = sensitivity_rows(sensitivity_runs, target) if sensitivity_runs else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    has_switch = write_figures(arms, finetuning, out)
    if gate:
        plot_val_loss_target(arms, target["value"], out / "val_loss_target.png")
        plot_samples_to_target(gate, out / "samples_to_target.png")
    if sensitivity_runs:
        value = target["value"] if target else arms[0]["seeds"][0]["final"]["val_mlm_loss"]
        per_seed = gate["per_seed"] if gate else {}
        gated = [
            {**arm, "samples_to_target": [r["samples_to_target"] for r in per_seed[arm["name"]]]}
            if arm["name"] in per_seed
            else arm
            for arm in arms
        ]
        plot_sensitivity(sensitivity, sensitivity_runs, gated, value, out / "sensitivity.png")
    markdown = render_markdown(
        arms,
        pretraining,
        finetuning,
        has_switch,
        gate,
        sensitivity,
        baseline["name"] if baseline else None,
    )
    atomic_write_text(out / "report.md", markdown)
    report = report_data(arms, pretraining, finetuning, gate, sensitivity)
    atomic_write_json(out / "report.json", report)
    return report


def arms_fixed(specs: list[str]) -> dict[str, str]:
    """``NAME=UTC`` pairs (``--arm-fixed``) as a dict, each time checked."""
    out = {}
    for spec in specs:
        name, sep, stamp = spec.partition("=")
        if not (sep and name and stamp):
            raise ValueError(f"--arm-fixed {spec!r} is not of the form NAME=UTC")
        parse_utc(stamp, f"--arm-fixed {name}")
        out[name] = stamp
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.parity --run NAME=PRETRAIN_DIR:FINETUNE_DIR ... --out DIR``."""
    parser = cli.report_parser(
        "pipeline.reports.parity",
        "Compare pretraining runs (and their fine-tuning) and write report.md with figures; "
        "runs that share a NAME are seeds of one arm.",
        "NAME=PRETRAIN_RUN_DIR:FINETUNE_OUTPUT_DIR (two or more)",
    )
    parser.add_argument("--target", help="target.json (python -m pipeline.target): the gate")
    parser.add_argument("--margin", type=float, default=gating.MARGIN)
    parser.add_argument("--alpha", type=float, default=gating.ALPHA)
    parser.add_argument(
        "--min-seeds",
        type=int,
        default=gating.MIN_SEEDS,
        help="Welch: fewer seeds per arm give no pass or fail; paired: the pre-registered "
        "number of seed pairs",
    )
    parser.add_argument(
        "--test",
        choices=("welch", "paired"),
        default="welch",
        help="the primary test (paired: per-seed log ratios over seed-matched pairs)",
    )
    parser.add_argument(
        "--preregistered", help="UTC time the test was fixed (e.g. 2026-11-28T21:41:00Z)"
    )
    parser.add_argument(
        "--arm-fixed",
        action="append",
        default=[],
        metavar="NAME=UTC",
        help="when candidate arm NAME was added under the pre-registered test, if later",
    )
    parser.add_argument(
        "--sensitivity", action="append", default=[], help="NAME=PRETRAIN_RUN_DIR (not gated)"
    )
    parser.add_argument("--baseline", help="NAME=FINETUNE_DIR of a randomly initialised model")

    def write(args) -> str:
        target = None
        if args.target:
            target = read_target(args.target)
            if target is None:
                raise ValueError(f"{args.target} is missing or unreadable: fix the target first")
        write_report(args.run, args.out, target, args.sensitivity, args.baseline,
                     margin=args.margin, alpha=args.alpha, min_seeds=args.min_seeds,
                     test=args.test, preregistered=args.preregistered,
                     arms_fixed=arms_fixed(args.arm_fixed))  # fmt: skip
        return f"report: {args.out}/report.md"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
