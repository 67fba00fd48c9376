"""The parity report: do pretraining runs (e.g. LAMB vs 1-bit LAMB) give the same model?

Input: two or more runs, each a name, a pretraining run directory (its ``metrics.jsonl``
and ``config.yaml``) and a fine-tuning output directory (its ``results.json``). Output, in
one directory: ``report.md``, ``report.json`` and PNG plots of pretraining loss and
validation MLM accuracy against samples seen, and of fine-tuning scores per task.

A task's scores are "within the seed spread" when the difference between two runs' means
is at most the sum of their standard deviations over seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.io import atomic_write_json, atomic_write_text
from pipeline.logging import read_metrics


@dataclass
class RunInputs:
    name: str
    pretrain_dir: Path
    finetune_dir: Path


def parse_run(spec: str) -> RunInputs:
    """``NAME=PRETRAIN_DIR:FINETUNE_DIR``."""
    name, sep, dirs = spec.partition("=")
    pretrain, sep2, finetune = dirs.partition(":")
    if not (sep and sep2 and name and pretrain and finetune):
        raise ValueError(f"run {spec!r} is not of the form NAME=PRETRAIN_DIR:FINETUNE_DIR")
    return RunInputs(name, Path(pretrain), Path(finetune))


def load_run(run: RunInputs) -> dict:
    metrics_path = run.pretrain_dir / "metrics.jsonl"
    config_path = run.pretrain_dir / "config.yaml"
    results_path = run.finetune_dir / "results.json"
    for path in (metrics_path, config_path, results_path):
        if not path.is_file():
            raise FileNotFoundError(f"run {run.name!r}: {path} is missing")
    config = yaml.safe_load(config_path.read_text())
    batch = config["batch"]["global_batch_size"]
    by_step: dict[int, dict] = {}
    for record in read_metrics(metrics_path):  # a resumed run logs some steps twice
        by_step.setdefault(record["step"], {}).update(record)
    steps = sorted(by_step)
    train = [(s * batch, by_step[s]["loss"]) for s in steps if "loss" in by_step[s]]
    val = [
        (s * batch, by_step[s]["val_mlm_accuracy"])
        for s in steps
        if "val_mlm_accuracy" in by_step[s]
    ]
    final_val = next((by_step[s] for s in reversed(steps) if "val_mlm_accuracy" in by_step[s]), {})
    comm = [by_step[s]["comm_bytes"] for s in steps if "comm_bytes" in by_step[s]]
    return {
        "name": run.name,
        "optimizer": config["optimizer"]["name"],
        "global_batch_size": batch,
        "steps": steps[-1] if steps else 0,
        "train_loss": train,
        "val_mlm_accuracy": val,
        "final": {
            k: final_val.get(k) for k in ("val_mlm_accuracy", "val_mlm_loss", "val_nsp_accuracy")
        },
        "final_train_loss": train[-1][1] if train else None,
        "comm_bytes_total": sum(comm),
        "finetune": json.loads(results_path.read_text()),
    }


def compare(runs: list[dict]) -> dict:
    """Per task and metric: each run's mean and std, and whether they agree within spread."""
    tasks = sorted(set.intersection(*(set(r["finetune"]) for r in runs)))
    table = {}
    for task in tasks:
        metrics = sorted(
            k
            for k, v in runs[0]["finetune"][task].items()
            if isinstance(v, int | float) and k not in ("lr", "epochs")
        )
        rows = {}
        for metric in metrics:
            means = [r["finetune"][task][metric] for r in runs]
            stds = [r["finetune"][task]["std"].get(metric, 0.0) for r in runs]
            worst_gap = max(abs(a - b) for a in means for b in means)
            spread = min(sa + sb for sa in stds for sb in stds) if len(stds) > 1 else 0.0
            rows[metric] = {
                "means": dict(zip([r["name"] for r in runs], means, strict=True)),
                "stds": dict(zip([r["name"] for r in runs], stds, strict=True)),
                "max_difference": worst_gap,
                "within_seed_spread": bool(worst_gap <= spread + 1e-12),
            }
        table[task] = {"main_metric": runs[0]["finetune"][task].get("main_metric"), "metrics": rows}
    return table


def _plot_curves(runs: list[dict], key: str, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        if run[key]:
            xs, ys = zip(*run[key], strict=True)
            ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=run["name"])
    ax.set_xlabel("samples seen")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_finetune(runs: list[dict], table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(table)
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks)), 4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        means, errs = [], []
        for task in tasks:
            metric = table[task]["metrics"][table[task]["main_metric"]]
            scale = 1.0 if task == "squad" else 100.0  # GLUE metrics are fractions
            means.append(metric["means"][run["name"]] * scale)
            errs.append(metric["stds"][run["name"]] * scale)
        xs = [t + (i - (len(runs) - 1) / 2) * width for t in range(len(tasks))]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=run["name"])
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([f"{t}\n({table[t]['main_metric']})" for t in tasks])
    ax.set_ylabel("score (x100 for GLUE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_report(run_specs: list[str], out: str | Path) -> dict:
    if len(run_specs) < 2:
        raise ValueError("a parity report needs at least two runs (NAME=PRETRAIN:FINETUNE)")
    runs = [load_run(parse_run(spec)) for spec in run_specs]
    table = compare(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _plot_curves(runs, "train_loss", "pretraining loss (MLM + NSP)", out / "pretrain_loss.png")
    _plot_curves(runs, "val_mlm_accuracy", "validation MLM accuracy", out / "val_mlm_accuracy.png")
    _plot_finetune(runs, table, out / "finetune_scores.png")
    names = [r["name"] for r in runs]
    lines = [
        "# Parity report",
        "",
        "## Pretraining",
        "",
        "| run | optimizer | global batch | steps | final train loss | val MLM acc | "
        "val NSP acc | bytes sent per rank |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['name']} | {r['optimizer']} | {r['global_batch_size']} | {r['steps']} "
            f"| {_fmt(r['final_train_loss'])} | {_fmt(r['final']['val_mlm_accuracy'])} "
            f"| {_fmt(r['final']['val_nsp_accuracy'])} | {r['comm_bytes_total']:,} |"
        )
    lines += [
        "",
        "![pretraining loss](pretrain_loss.png)",
        "![validation MLM accuracy](val_mlm_accuracy.png)",
        "",
        "## Fine-tuning",
        "",
        "Mean ± standard deviation over seeds; *within spread* when the largest "
        "difference between runs is at most the sum of their standard deviations.",
        "",
        "| task | metric | " + " | ".join(names) + " | difference | within spread |",
        "|---|---|" + "---:|" * len(names) + "---:|:---:|",
    ]
    for task, info in table.items():
        for metric, row in info["metrics"].items():
            cells = " | ".join(f"{row['means'][n]:.4f} ± {row['stds'][n]:.4f}" for n in names)
            mark = "yes" if row["within_seed_spread"] else "**no**"
            main = " (main)" if metric == info["main_metric"] else ""
            lines.append(
                f"| {task} | {metric}{main} | {cells} | {row['max_difference']:.4f} | {mark} |"
            )
    lines += ["", "![fine-tuning scores](finetune_scores.png)", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
    report = {
        "runs": [{k: v for k, v in r.items() if k not in ("train_loss", "finetune")} for r in runs],
        "finetune": table,
    }
    atomic_write_json(out / "report.json", report)
    return report
