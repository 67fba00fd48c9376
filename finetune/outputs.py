"""Where the fine-tuning stage puts its outputs, and how to tell they are finished.

    <output>/
        config.yaml                     the resolved config
        results.json                    per task: the best grid point's metrics, mean and
                                        std over seeds, the whole grid (the stage's result)
        <task>/results.json             the same for one task
        <task>/runs/lr<LR>_ep<E>_seed<S>.json   one finished (lr, epochs, seed) run each;
                                        a rerun skips the ones present
        <task>/locks/lr<LR>_ep<E>_seed<S>/run.lock   held while that run trains (one
                                        launch per run; removed when it ends)
        <task>/logs/lr<LR>_ep<E>_seed<S>/    that run's metrics.jsonl, wandb folder and
                                        TensorBoard events (the ``logging`` section)

``results.json`` is rewritten at the end of every run of the stage with the tasks and seeds
of that run (a SLURM array task writes one task and seed; the aggregating run writes all).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from onebit_bert.io import atomic_write_json, read_json_object

RESULTS = "results.json"
CONFIG = "config.yaml"


def results_path(output: str | Path) -> Path:
    """The stage's ``results.json``."""
    return Path(output) / RESULTS


def config_path(output: str | Path) -> Path:
    """The resolved config of the last run of the stage."""
    return Path(output) / CONFIG


def task_results_path(output: str | Path, task: str) -> Path:
    """One task's ``results.json``."""
    return Path(output) / task / RESULTS


def run_path(output: str | Path, task: str, lr: float, epochs: float, seed: int) -> Path:
    """The record of one finished (task, learning rate, epochs, seed) run."""
    return Path(output) / task / "runs" / f"lr{lr:g}_ep{epochs:g}_seed{seed}.json"


def artifact_dir(output: str | Path, task: str, lr: float, epochs: float, seed: int, kind: str):
    """Where one run's ``kind`` (``models``, ``predictions`` or ``logs``) goes:
    ``<output>/<task>/<kind>/lr<lr>_ep<epochs>_seed<seed>/``."""
    return Path(output) / task / kind / f"lr{lr:g}_ep{epochs:g}_seed{seed}"


def write_results(output: str | Path, results: dict) -> Path:
    """Write ``results.json`` (``{task: summary}``) atomically."""
    return atomic_write_json(results_path(output), results)


def write_task_results(output: str | Path, task: str, summary: dict) -> Path:
    """Write one task's ``results.json`` atomically."""
    return atomic_write_json(task_results_path(output, task), summary)


def read_results(output: str | Path) -> dict:
    """``{task: summary}`` from ``results.json``; FileNotFoundError when there is none."""
    return read_json_object(
        results_path(output),
        missing="fine-tuning has not finished",
        fix="run the fine-tuning stage again",
    )


def is_complete(
    output: str | Path, tasks: Iterable[str], seeds: Iterable[int] | None = None
) -> bool:
    """``results.json`` holds every one of ``tasks`` (and, when ``seeds`` is given, each
    task's summary covers all of them)."""
    try:
        results = read_results(output)
    except (FileNotFoundError, ValueError):  # missing or damaged: not complete
        return False
    wanted = None if seeds is None else set(seeds)
    for task in tasks:
        if task not in results:
            return False
        if wanted is not None and not wanted <= set(results[task].get("seeds", ())):
            return False
    return True
