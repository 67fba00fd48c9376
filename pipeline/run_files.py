"""A pretraining run's files as the chain hands them on, read for whoever judges the run:
the target stage (:mod:`pipeline.target`) and the reports (:mod:`pipeline.reports.runs`).

A run is named on the command line as ``NAME=PRETRAIN_DIR:FINETUNE_DIR`` (or
``NAME=PRETRAIN_DIR`` where fine-tuning is optional); runs that share a NAME are one arm's
pretraining seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune import outputs as finetune_outputs
from onebit_bert.io import read_json_object
from onebit_bert.metrics_log import read_metrics
from pretrain import outputs as pretrain_outputs

TOTALS = "totals.json"
"""An archived record's sums over every step (:mod:`pipeline.reports.archive`): the thinned
``metrics.jsonl`` beside it no longer adds up to them."""


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


def by_samples(by_step: dict[int, dict], batch: int, metric: str) -> list[tuple[int, float]]:
    """(samples seen, value) at every step that logged ``metric``."""
    return [(s * batch, by_step[s][metric]) for s in sorted(by_step) if metric in by_step[s]]


def max_samples(config: dict, by_step: dict[int, dict]) -> int:
    """The samples the run is scheduled to see (its last logged step's where the config
    sets no ``schedule.max_steps``)."""
    steps = sorted(by_step)
    last = steps[-1] if steps else 0
    return config.get("schedule", {}).get("max_steps", last) * config["batch"]["global_batch_size"]


def read_totals(run_dir: str | Path) -> dict | None:
    """An archived record's ``totals.json`` (None for a run directory, whose metrics hold
    every step)."""
    return read_json_object(Path(run_dir) / TOTALS, None)
