"""The parity report: do pretraining recipes (e.g. LAMB vs 1-bit LAMB) give the same model?

Input: runs given as ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` (a pretraining run directory with
its ``metrics.jsonl`` and ``config.yaml``, and a fine-tuning output directory with its
``results.json``). Runs that share a NAME are the pretraining seeds of one *arm*. Output,
in one directory: ``report.md``, ``report.json`` and PNG plots (pretraining loss with the
freeze step marked, validation MLM accuracy against samples seen, the 1-bit switch
diagnostics, fine-tuning scores per task; drawn by :mod:`pipeline.report_plots`).

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
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune import outputs as finetune_outputs
from onebit_bert.io import atomic_write_json, atomic_write_text
from onebit_bert.metrics_log import read_metrics
from pipeline.report_plots import write_figures
from pipeline.stats import mean_std, welch_t_test
from pretrain import outputs as pretrain_outputs

ALPHA = 0.05
TEST = (
    "Welch's two-sided t-test on per-pretraining-seed values (fine-tuning: each pretraining "
    f"seed's mean over its fine-tuning seeds), alpha = {ALPHA}: *differs* when p < {ALPHA}, "
    "otherwise *no significant difference*; an arm with a single pretraining seed gets "
    "*1 seed: no verdict*."
)
NO_VERDICT = "1 seed: no verdict"
PRETRAIN_METRICS = ("val_mlm_accuracy", "val_mlm_loss", "val_nsp_accuracy", "final_train_loss")
SWITCH_KEYS = (
    "trust_ratio_min",
    "trust_ratio_mean",
    "trust_ratio_max",
    "factor_min",
    "factor_mean",
    "factor_max",
    "compression_error",
)


@dataclass
class RunInputs:
    """One ``--run`` argument: the arm name, the pretraining run directory and the
    fine-tuning output directory."""

    name: str
    pretrain_dir: Path
    finetune_dir: Path | None


def parse_run(spec: str, finetune_optional: bool = False) -> RunInputs:
    """``NAME=PRETRAIN_DIR:FINETUNE_DIR`` (or ``NAME=PRETRAIN_DIR`` where fine-tuning is
    optional: the run then has no fine-tuning results)."""
    name, sep, dirs = spec.partition("=")
    pretrain, sep2, finetune = dirs.partition(":")
    if finetune_optional and sep and name and pretrain and not sep2:
        return RunInputs(name, Path(pretrain), None)
    if not (sep and sep2 and name and pretrain and finetune):
        form = "NAME=PRETRAIN_DIR" + ("[:FINETUNE_DIR]" if finetune_optional else ":FINETUNE_DIR")
        raise ValueError(f"run {spec!r} is not of the form {form}")
    return RunInputs(name, Path(pretrain), Path(finetune))


INTRA_NODE_BYTES = "comm_bytes_intra_node"
"""Not a kind of traffic: what a node hierarchy's phases kept inside a node (counted apart
from ``comm_bytes`` and from every kind)."""


def read_run(run: RunInputs) -> tuple[dict, dict[int, dict]]:
    """A run's pretraining config and its metrics merged per step (a resumed run logs some
    steps twice); a missing input file is one error naming it."""
    metrics_path = pretrain_outputs.metrics_path(run.pretrain_dir)
    config_path = pretrain_outputs.config_path(run.pretrain_dir)
    paths = [metrics_path, config_path]
    if run.finetune_dir is not None:
        paths.append(finetune_outputs.results_path(run.finetune_dir))
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"run {run.name!r}: {path} is missing")
    by_step: dict[int, dict] = {}
    for record in read_metrics(metrics_path):
        by_step.setdefault(record["step"], {}).update(record)
    return yaml.safe_load(config_path.read_text()), by_step


def load_run(run: RunInputs, records: tuple[dict, dict[int, dict]] | None = None) -> dict:
    """One pretraining seed: its curves, final metrics and fine-tuning results (``records``:
    what :func:`read_run` returned, when the caller has read it already)."""
    config, by_step = records or read_run(run)
    batch = config["batch"]["global_batch_size"]
    optimizer = config["optimizer"]["name"]
    steps = sorted(by_step)
    train = [(s, by_step[s]["loss"]) for s in steps if "loss" in by_step[s]]
    val = [
        (s * batch, by_step[s]["val_mlm_accuracy"])
        for s in steps
        if "val_mlm_accuracy" in by_step[s]
    ]
    final_val = next((by_step[s] for s in reversed(steps) if "val_mlm_accuracy" in by_step[s]), {})
    comm = [by_step[s]["comm_bytes"] for s in steps if "comm_bytes" in by_step[s]]
    by_kind: dict[str, list[float]] = {}  # kind -> [bytes, seconds] over the run
    for s in steps:
        for key, value in by_step[s].items():
            for prefix, slot in (("comm_bytes_", 0), ("comm_seconds_", 1)):
                if (
                    key.startswith(prefix)
                    and key != INTRA_NODE_BYTES
                    and isinstance(value, int | float)
                ):
                    by_kind.setdefault(key[len(prefix) :], [0, 0.0])[slot] += value
    switch = {
        key: [(s, by_step[s][key]) for s in steps if key in by_step[s]] for key in SWITCH_KEYS
    }
    final = {k: final_val.get(k) for k in PRETRAIN_METRICS[:3]}
    final["final_train_loss"] = train[-1][1] if train else None
    return {
        "name": run.name,
        "pretrain_dir": str(run.pretrain_dir),
        "seed": config.get("seed"),
        "optimizer": optimizer,
        "freeze_step": config["optimizer"].get("freeze_step") if "onebit" in optimizer else None,
        "global_batch_size": batch,
        "steps": steps[-1] if steps else 0,
        "train_loss": train,
        "val_mlm_accuracy": val,
        "switch": switch,
        "final": final,
        "comm_bytes_total": sum(comm),
        "comm_by_kind": {k: {"bytes": b, "seconds": t} for k, (b, t) in sorted(by_kind.items())},
        "finetune": {}
        if run.finetune_dir is None
        else finetune_outputs.read_results(run.finetune_dir),
    }


def group_arms(runs: list[dict]) -> list[dict]:
    """Runs with the same name are one arm's pretraining seeds (first-seen order)."""
    arms: dict[str, dict] = {}
    for run in runs:
        arm = arms.setdefault(run["name"], {"name": run["name"], "seeds": []})
        if arm["seeds"] and arm["seeds"][0]["optimizer"] != run["optimizer"]:
            raise ValueError(
                f"arm {run['name']!r} mixes optimizers "
                f"{arm['seeds'][0]['optimizer']} and {run['optimizer']}"
            )
        arm["seeds"].append(run)
    for arm in arms.values():
        arm["optimizer"] = arm["seeds"][0]["optimizer"]
    return list(arms.values())


def finetune_values(run: dict, task: str, metric: str) -> list[float]:
    """One pretraining seed's scores for a task and metric, one per fine-tuning seed (at the
    best grid point); only the mean when the results carry no per-seed scores."""
    result = run["finetune"][task]
    per_seed = result.get("per_seed")
    if per_seed:
        return [float(m[metric]) for m in per_seed.values() if metric in m]
    return [float(result[metric])]


def _no_verdict(reason: str) -> dict:
    return {"verdict": reason, "p": None, "t": None, "df": None, "standard_error": None}


def verdict(reference: list[float], other: list[float]) -> dict:
    """Compare per-pretraining-seed values of an arm with the reference arm's."""
    if len(reference) < 2 or len(other) < 2:
        return _no_verdict(NO_VERDICT)
    if any(math.isnan(v) for v in (*reference, *other)):
        return _no_verdict("no verdict (NaN)")
    test = welch_t_test(reference, other)
    return {
        "verdict": "differs" if test.p < ALPHA else "no significant difference",
        "p": test.p,
        "t": test.t,
        "df": test.df,
        "standard_error": test.standard_error,
    }


def _summary(values: list[float]) -> dict:
    clean = [v for v in values if v is not None]
    if not clean:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean, std = mean_std(clean)
    return {"mean": mean, "std": std, "n": len(clean), "values": clean}


def compare_pretraining(arms: list[dict]) -> dict:
    """Per final pretraining metric: each arm's mean ± std over pretraining seeds and the
    verdict against the first arm."""
    table = {}
    reference = arms[0]
    for metric in PRETRAIN_METRICS:
        rows = {arm["name"]: _summary([r["final"][metric] for r in arm["seeds"]]) for arm in arms}
        ref_values = rows[reference["name"]]["values"]
        for arm in arms[1:]:
            row = rows[arm["name"]]
            if row["n"] and len(ref_values):
                row["difference"] = row["mean"] - rows[reference["name"]]["mean"]
                row.update(verdict(ref_values, row["values"]))
        table[metric] = rows
    return table


def compare_finetuning(arms: list[dict]) -> dict:
    """Per task and metric: each arm's mean ± std over pretraining × fine-tuning seeds, its
    per-pretraining-seed means, and the verdict against the first arm."""
    tasks = sorted(set.intersection(*(set(r["finetune"]) for a in arms for r in a["seeds"])))
    reference = arms[0]
    table = {}
    for task in tasks:
        first = reference["seeds"][0]["finetune"][task]
        metrics = sorted(
            k for k, v in first.items() if isinstance(v, int | float) and k not in ("lr", "epochs")
        )
        rows = {}
        for metric in metrics:
            per_arm = {}
            for arm in arms:
                values = [finetune_values(r, task, metric) for r in arm["seeds"]]
                flat = [v for vs in values for v in vs]
                mean, std = mean_std(flat)
                per_arm[arm["name"]] = {
                    "mean": mean,
                    "std": std,
                    "n": len(flat),
                    "pretrain_seed_means": [sum(vs) / len(vs) for vs in values],
                }
            ref = per_arm[reference["name"]]
            for arm in arms[1:]:
                row = per_arm[arm["name"]]
                row["difference"] = row["mean"] - ref["mean"]
                row.update(verdict(ref["pretrain_seed_means"], row["pretrain_seed_means"]))
            rows[metric] = per_arm
        table[task] = {"main_metric": first.get("main_metric"), "metrics": rows}
    return table


# ----------------------------------------------------------------------------- report


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _cell(row: dict) -> str:
    if not row.get("n"):
        return "–"
    return f"{_fmt(row['mean'])} ± {_fmt(row['std'])}"


def _verdict_cell(row: dict) -> str:
    if "verdict" not in row:
        return "–"
    if row["p"] is None:
        return row["verdict"]
    mark = f"**{row['verdict']}**" if row["verdict"] == "differs" else row["verdict"]
    return f"{mark} (p = {row['p']:.2f})"


def load_arms(run_specs: list[str]) -> list[dict]:
    """Load every ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` run and group them into arms (two or
    more)."""
    arms = group_arms([load_run(parse_run(spec)) for spec in run_specs])
    if len(arms) < 2:
        raise ValueError(
            "a parity report needs at least two runs with different names "
            "(NAME=PRETRAIN:FINETUNE; a repeated NAME adds a pretraining seed)"
        )
    return arms


def _table_header(columns: list[str], right: int, left: int) -> list[str]:
    """A markdown table's header row and alignment row: ``columns`` beyond the first
    ``len(columns) - right - left`` (left-aligned) are ``right`` right-aligned ones, then
    ``left`` left-aligned ones."""
    plain = len(columns) - right - left
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * plain + "---:|" * right + ":---|" * left,
    ]


def _arms_table(arms: list[dict]) -> list[str]:
    lines = [
        "| arm | optimizer | pretraining seeds | global batch | steps | bytes sent per rank |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for arm in arms:
        seeds = [r["seed"] for r in arm["seeds"]]
        comm = sum(r["comm_bytes_total"] for r in arm["seeds"]) / len(arm["seeds"])
        first = arm["seeds"][0]
        lines.append(
            f"| {arm['name']} | {arm['optimizer']} | {len(seeds)} ({', '.join(map(str, seeds))}) "
            f"| {first['global_batch_size']} | {first['steps']} | {comm:,.0f} |"
        )
    return lines


def _traffic_table(arms: list[dict]) -> list[str]:
    """Bytes and seconds per rank by kind of traffic (mean over each arm's seeds)."""
    kinds = sorted({k for a in arms for r in a["seeds"] for k in r.get("comm_by_kind", {})})
    if not kinds:
        return []
    lines = [
        "",
        "Traffic per rank over the run by kind (bytes; seconds spent in those collectives):",
        "",
        "| arm | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for arm in arms:
        cells = []
        for kind in kinds:
            entries = [r.get("comm_by_kind", {}).get(kind) for r in arm["seeds"]]
            if all(e is None for e in entries):
                cells.append("–")
                continue
            entries = [e or {"bytes": 0, "seconds": 0.0} for e in entries]
            nbytes = sum(e["bytes"] for e in entries) / len(entries)
            seconds = sum(e["seconds"] for e in entries) / len(entries)
            cells.append(f"{nbytes:,.0f} B; {seconds:.1f} s")
        lines.append(f"| {arm['name']} | " + " | ".join(cells) + " |")
    return lines


def _pretraining_section(arms: list[dict], pretraining: dict, has_switch: bool) -> list[str]:
    names = [a["name"] for a in arms]
    others = names[1:]
    lines = ["## Pretraining", "", *_arms_table(arms), *_traffic_table(arms)]
    lines += ["", "Final values, mean ± std over pretraining seeds:", ""]
    lines += _table_header(
        ["metric", *names, *(f"{n} vs {names[0]}" for n in others)], len(names), len(others)
    )
    for metric, rows in pretraining.items():
        cells = " | ".join(_cell(rows[n]) for n in names)
        verdicts = " | ".join(_verdict_cell(rows[n]) for n in others)
        lines.append(f"| {metric} | {cells} | {verdicts} |")
    lines += [
        "",
        "![pretraining loss](pretrain_loss.png)",
        "![validation MLM accuracy](val_mlm_accuracy.png)",
    ]
    if has_switch:
        lines += ["![1-bit switch: c·f, f, compression error](onebit_switch.png)"]
    return lines


def _finetuning_section(arms: list[dict], finetuning: dict) -> list[str]:
    names = [a["name"] for a in arms]
    others = names[1:]
    lines = ["## Fine-tuning", "", "Mean ± std over pretraining × fine-tuning seeds.", ""]
    columns = [
        "task",
        "metric",
        *names,
        *(f"{n} − {names[0]}" for n in others),
        *(f"{n} vs {names[0]}" for n in others),
    ]
    lines += _table_header(columns, len(names) + len(others), len(others))
    for task, info in finetuning.items():
        for metric, rows in info["metrics"].items():
            cells = " | ".join(_cell(rows[n]) for n in names)
            diffs = " | ".join(f"{rows[n]['difference']:+.4f}" for n in others)
            verdicts = " | ".join(_verdict_cell(rows[n]) for n in others)
            main = " (main)" if metric == info["main_metric"] else ""
            lines.append(f"| {task} | {metric}{main} | {cells} | {diffs} | {verdicts} |")
    lines += ["", "![fine-tuning scores](finetune_scores.png)", ""]
    return lines


def render_markdown(arms: list[dict], pretraining: dict, finetuning: dict, has_switch: bool) -> str:
    """``report.md``: the arms, the pretraining and fine-tuning tables and the figures."""
    head = ["# Parity report", "", f"Reference arm: **{arms[0]['name']}**. Verdicts: {TEST}", ""]
    lines = [
        *head,
        *_pretraining_section(arms, pretraining, has_switch),
        "",
        *_finetuning_section(arms, finetuning),
    ]
    return "\n".join(lines)


def report_data(arms: list[dict], pretraining: dict, finetuning: dict) -> dict:
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
    }


def write_report(run_specs: list[str], out: str | Path) -> dict:
    """Compare the runs and write ``report.md``, ``report.json`` and the figures into
    ``out``; returns what ``report.json`` holds."""
    arms = load_arms(run_specs)
    pretraining = compare_pretraining(arms)
    finetuning = compare_finetuning(arms)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    has_switch = write_figures(arms, finetuning, out)
    atomic_write_text(out / "report.md", render_markdown(arms, pretraining, finetuning, has_switch))
    report = report_data(arms, pretraining, finetuning)
    atomic_write_json(out / "report.json", report)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.report --run NAME=PRETRAIN_DIR:FINETUNE_DIR ... --out DIR``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.report",
        description="Compare pretraining runs (and their fine-tuning) and write report.md "
        "with figures; runs that share a NAME are seeds of one arm.",
    )
    parser.add_argument(
        "--run",
        action="append",
        required=True,
        help="NAME=PRETRAIN_RUN_DIR:FINETUNE_OUTPUT_DIR (two or more)",
    )
    parser.add_argument("--out", required=True, help="report directory")
    args = parser.parse_args(argv)
    try:
        write_report(args.run, args.out)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {args.out}/report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
