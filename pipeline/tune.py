"""Tune recipes with equal budgets as real pretraining runs (``python -m pipeline.tune``).

For each recipe of ``--recipes``: ``--budget`` trials from its search space
(:func:`pipeline.tuning.trials`), each a pretraining run of the base config with the
recipe's and the trial's overrides, on the tuning seed. Successive halving
(:func:`pipeline.tuning.successive_halving`) runs every trial to the first rung
(``--first-rung`` steps), then continues the better half from its checkpoint to twice as
many steps, and so on up to the config's ``schedule.max_steps`` (the learning-rate schedule
is the whole run's from the start, so a trial continued to the next rung is the run it
would have been). The score is the validation MLM loss at the rung's step (validation runs
at every rung).

Resumable: a trial that has a validation loss at a rung's step is not run again to it, and
a run stopped part-way resumes from its last checkpoint; run the same command again after
any interruption. Output, under ``--out``: one run folder per trial
(``<recipe>/<recipe>-t<i>``) and one ``<recipe>/tuning.json`` per recipe (the record
``pipeline.compare --tuning`` reads).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

from onebit_bert.config import load_config, save_config
from onebit_bert.io import atomic_write_json
from onebit_bert.metrics_log import read_metrics
from onebit_bert.recipes import Recipe, get_recipe
from pipeline.tuning import Trial, rungs, successive_halving, trials, tuning_record
from pretrain import outputs as pretrain_outputs
from pretrain.config import PretrainConfig


class Tuner:
    """Runs the trials of one tuning (the module docstring)."""

    def __init__(self, base: Path, data: Path, out: Path, overrides: list[str],
                 nproc: int = 1, seed: int = 1):  # fmt: skip
        self.base, self.data, self.out = base, data, out
        self.overrides = list(overrides)
        self.nproc, self.seed = nproc, seed
        self.launches = 0

    def config(self, recipe: Recipe, trial: Trial, rung_steps: list[int], stop_after: int):
        """The trial's pretraining config, checked (a clear error before any run)."""
        every = math.gcd(*rung_steps)
        return load_config(PretrainConfig, self.base, [
            *recipe.overrides(), f"recipe={recipe.name}", *trial.overrides(), *self.overrides,
            f"run_dir={self.run_dir(trial)}", f"data.path={self.data}", f"seed={self.seed}",
            f"data.validation_every={every}", f"stop_after={stop_after}",
            f"logging.run_name={trial.name}", "logging.job_type=tuning",
        ])  # fmt: skip

    def run_dir(self, trial: Trial) -> Path:
        return self.out / trial.recipe / trial.name

    def loss_at(self, trial: Trial, steps: int) -> float | None:
        path = pretrain_outputs.metrics_path(self.run_dir(trial))
        if not path.is_file():
            return None
        found = [r["val_mlm_loss"] for r in read_metrics(path)
                 if r.get("step") == steps and "val_mlm_loss" in r]  # fmt: skip
        return found[-1] if found else None

    def done_steps(self, trial: Trial) -> int:
        status = pretrain_outputs.read_status(self.run_dir(trial))
        return int(status.get("last_checkpoint") or 0) if status else 0

    def runner(self, recipe: Recipe, rung_steps: list[int]):
        """``run(trial, steps)`` for :func:`successive_halving`."""

        def run(trial: Trial, steps: int) -> float:
            loss = self.loss_at(trial, steps)
            if loss is not None:
                return loss
            cfg = self.config(recipe, trial, rung_steps, steps - self.done_steps(trial))
            path = self.out / trial.recipe / f"{trial.name}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            save_config(cfg, path)
            self.launch(path, trial.name, steps)
            loss = self.loss_at(trial, steps)
            if loss is None:
                raise RuntimeError(f"{trial.name} logged no validation loss at step {steps}")
            return loss

        return run

    def launch(self, config: Path, name: str, steps: int) -> None:
        if self.nproc == 1:
            command = [sys.executable, "-m", "pretrain", "--config", str(config)]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={self.nproc}", "-m", "pretrain", "--config",
                       str(config)]  # fmt: skip
        print(f"[tune] {name} to step {steps}", flush=True)
        log = config.with_suffix(".log")
        with log.open("a") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        self.launches += 1
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {done.returncode}); see {log}")

    def tune(self, name: str, budget: int, first_rung: int) -> dict:
        """One recipe's tuning: its record, also written to ``<out>/<recipe>/tuning.json``."""
        recipe = get_recipe(name)
        candidates = trials(recipe, budget, self.seed)
        length = load_config(PretrainConfig, self.base, self.overrides).schedule.max_steps
        rung_steps = rungs(first_rung, length)
        for trial in candidates:  # every config checked before the first run
            self.config(recipe, trial, rung_steps, rung_steps[0])
        halving = successive_halving(candidates, self.runner(recipe, rung_steps), rung_steps)
        record = {**tuning_record(recipe, candidates, halving), "seed": self.seed}
        atomic_write_json(self.out / name / "tuning.json", record)
        return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tune", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, type=Path, help="base pretraining config")
    parser.add_argument("--data", required=True, type=Path, help="prepared shard folder")
    parser.add_argument("--recipes", required=True, help="comma list of registered recipes")
    parser.add_argument("--budget", type=int, required=True, help="trials per recipe")
    parser.add_argument("--first-rung", type=int, required=True, help="steps of the first rung")
    parser.add_argument("--nproc", type=int, default=1, help="processes per trial")
    parser.add_argument("--seed", type=int, default=1, help="the tuning seed")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("overrides", nargs="*", help="section.field=value for every trial")
    args = parser.parse_args(argv)
    tuner = Tuner(args.config, args.data, args.out, args.overrides, args.nproc, args.seed)
    try:
        names = [n.strip() for n in args.recipes.split(",") if n.strip()]
        for name in names:
            get_recipe(name)
        for name in names:
            record = tuner.tune(name, args.budget, args.first_rung)
            print(f"[tune] {name}: chose {record['chosen']} {record['chosen_settings']}")
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
