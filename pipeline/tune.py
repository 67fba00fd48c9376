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
``pipeline.reports.compare --tuning`` reads).

``--eval-seeds`` then runs the chosen setting for the whole run on each of those seeds
(fresh seeds, not the tuning seed: ``<recipe>/<recipe>-eval-seed<N>``, resumable the same
way) and adds their final validation losses to the record. ``--nodes`` runs every trial as
that many torchrun agents on this machine (``--nproc`` split evenly between them, a static
rendezvous on 127.0.0.1), so a recipe with ``comm.hierarchy: node`` sees nodes of
``nproc / nodes`` ranks: nodes as workers, tested on one host.

``--evaluate FILE`` tunes nothing: it runs the chosen setting of a recorded tuning (a
``tuning.json``, or a ``pipeline.reports.compare`` report whose tuning section holds the recipe) on
``--eval-seeds`` with ``--data``, for example on other data than the tuning saw, and writes
``<recipe>/evaluation.json`` (the setting, where it came from, the data's identity and each
seed's final validation loss).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from onebit_bert.config import load_config, save_config
from onebit_bert.io import atomic_write_json
from onebit_bert.metrics_log import read_metrics
from onebit_bert.recipes import Recipe, get_recipe
from pipeline.tuning import (
    Trial,
    data_identity,
    rungs,
    successive_halving,
    trials,
    tuning_record,
)
from pretrain import outputs as pretrain_outputs
from pretrain.config import PretrainConfig


class Tuner:
    """Runs the trials of one tuning (the module docstring)."""

    def __init__(self, base: Path, data: Path, out: Path, overrides: list[str],
                 nproc: int = 1, seed: int = 1, nodes: int = 1):  # fmt: skip
        if nodes < 1 or nproc % nodes:
            raise ValueError(
                f"--nproc {nproc} does not split into --nodes {nodes} equal nodes; give a "
                "multiple of the node count"
            )
        self.base, self.data, self.out = base, data, out
        self.overrides = list(overrides)
        self.nproc, self.seed, self.nodes = nproc, seed, nodes
        self.launches = 0

    def config(self, recipe: Recipe, trial: Trial, rung_steps: list[int] | None,
               stop_after: int | None, seed: int | None = None,
               name: str | None = None):  # fmt: skip
        """The trial's pretraining config, checked (a clear error before any run): it
        validates at every rung and stops after ``stop_after`` steps (``rung_steps`` None:
        at the base config's interval; ``stop_after`` None: runs to the end)."""
        name = name or trial.name
        every = [f"data.validation_every={math.gcd(*rung_steps)}"] if rung_steps else []
        return load_config(PretrainConfig, self.base, [
            *recipe.overrides(), f"recipe={recipe.name}", *trial.overrides(), *self.overrides,
            f"run_dir={self.out / trial.recipe / name}", f"data.path={self.data}",
            f"seed={self.seed if seed is None else seed}", *every,
            f"stop_after={'null' if stop_after is None else stop_after}",
            f"logging.run_name={name}", "logging.job_type=tuning",
        ])  # fmt: skip

    def length(self, recipe: Recipe) -> int:
        """The steps of the whole run (the base config's ``schedule.max_steps``)."""
        overrides = [*recipe.overrides(), f"recipe={recipe.name}", *self.overrides]
        return load_config(PretrainConfig, self.base, overrides).schedule.max_steps

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
        print(f"[tune] {name} to step {steps}", flush=True)
        log = config.with_suffix(".log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("a") as out:
            agents = [subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
                      for command in launch_commands(config, self.nproc, self.nodes)]  # fmt: skip
            failed = _wait_all(agents)
        self.launches += 1
        if failed:
            raise RuntimeError(f"{name} failed (exit {failed}); see {log}")

    def evaluate(self, name: str, record: dict, seeds: list[int]) -> list[dict]:
        """Run the chosen setting of ``record`` for the whole run on each seed (resumable)."""
        recipe = get_recipe(name)
        trial = Trial(name, -1, record["chosen_settings"] or {})
        length = self.length(recipe)
        runs = []
        for seed in seeds:
            run_name = f"{name}-eval-seed{seed}"
            run_dir = self.out / name / run_name
            if not pretrain_outputs.is_complete(run_dir):  # a complete run validates at its end
                cfg = self.config(recipe, trial, None, None, seed, run_name)
                path = self.out / name / f"{run_name}.yaml"
                save_config(cfg, path)
                self.launch(path, run_name, length)
            losses = [r["val_mlm_loss"] for r in
                      read_metrics(pretrain_outputs.metrics_path(run_dir))
                      if r.get("step") == length and "val_mlm_loss" in r]  # fmt: skip
            if not losses:
                raise RuntimeError(f"{run_name} logged no validation loss at step {length}")
            runs.append({"seed": seed, "run_dir": str(run_dir), "final_val_loss": losses[-1]})
        return runs

    def tune(self, name: str, budget: int, first_rung: int, eval_seeds: list[int] = ()) -> dict:
        """One recipe's tuning: its record, also written to ``<out>/<recipe>/tuning.json``."""
        recipe = get_recipe(name)
        candidates = trials(recipe, budget, self.seed)
        length = self.length(recipe)
        rung_steps = rungs(first_rung, length)
        for trial in candidates:  # every config checked before the first run
            self.config(recipe, trial, rung_steps, rung_steps[0])
        data = data_identity(self.data)  # a bad --data fails here, before any run
        halving = successive_halving(candidates, self.runner(recipe, rung_steps), rung_steps)
        record = {**tuning_record(recipe, candidates, halving), "seed": self.seed}
        if self.nodes > 1:
            record["nodes"] = self.nodes
        record["data"] = data
        atomic_write_json(self.out / name / "tuning.json", record)
        if eval_seeds:
            record["evaluation"] = self.evaluate(name, record, list(eval_seeds))
            atomic_write_json(self.out / name / "tuning.json", record)
        return record


def recorded_tuning(path: Path, name: str) -> dict:
    """``name``'s tuning record from a ``tuning.json`` (one record or a list) or from a
    ``pipeline.reports.compare`` report's tuning section."""
    if not path.is_file():
        raise FileNotFoundError(f"--evaluate {path}: no such file (a tuning.json or a report)")
    loaded = json.loads(path.read_text())
    if isinstance(loaded, dict) and isinstance(loaded.get("tuning"), dict):
        found = loaded["tuning"].get(name)
    else:
        found = next((r for r in (loaded if isinstance(loaded, list) else [loaded])
                      if isinstance(r, dict) and r.get("recipe") == name), None)  # fmt: skip
    if not found or "chosen_settings" not in found:
        raise ValueError(f"--evaluate {path}: it holds no tuning record of {name}")
    return found


def reevaluate(tuner: Tuner, name: str, source: Path, seeds: list[int]) -> dict:
    """Run the chosen setting recorded in ``source`` for ``name`` on ``seeds`` with the
    tuner's data; the result, also written to ``<out>/<recipe>/evaluation.json``."""
    record = recorded_tuning(source, name)
    if not seeds:
        raise ValueError("--evaluate needs --eval-seeds: the seeds to run the setting on")
    if record.get("seed") in seeds:
        raise ValueError(f"--eval-seeds {seeds} holds {name}'s tuning seed {record['seed']}; "
                         "evaluate on fresh seeds")  # fmt: skip
    nodes = record.get("nodes", 1)
    if nodes != tuner.nodes:
        raise ValueError(f"--evaluate {source}: {name} was tuned with --nodes {nodes}; "
                         f"evaluate it the same way (--nodes {nodes})")  # fmt: skip
    tuner.config(get_recipe(name), Trial(name, -1, record["chosen_settings"] or {}), None, None)
    result = {"recipe": name, "chosen_settings": record["chosen_settings"],
              "from": str(source), "tuned_on": record.get("data"),
              "data": data_identity(tuner.data)}  # fmt: skip
    if tuner.nodes > 1:
        result["nodes"] = tuner.nodes
    result["evaluation"] = tuner.evaluate(name, record, seeds)
    atomic_write_json(tuner.out / name / "evaluation.json", result)
    return result


def _wait_all(agents: list[subprocess.Popen], poll_s: float = 1.0) -> int:
    """Wait for every agent; when one fails, stop the others (they would wait for it at
    the rendezvous until their timeout). Returns the first non-zero exit code, else 0."""
    while True:
        codes = [agent.poll() for agent in agents]
        failed = next((c for c in codes if c not in (None, 0)), 0)
        if failed:
            for agent in agents:
                if agent.poll() is None:
                    agent.terminate()
            for agent in agents:
                agent.wait()
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_commands(config: Path, nproc: int, nodes: int = 1) -> list[list[str]]:
    """The commands that run ``python -m pretrain --config config`` on ``nproc`` processes:
    one plain process, one standalone torchrun, or ``nodes`` torchrun agents on this machine
    meeting at a static rendezvous on 127.0.0.1 (each with ``nproc / nodes`` ranks)."""
    program = ["-m", "pretrain", "--config", str(config)]
    if nproc == 1:
        return [[sys.executable, *program]]
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        return [[*run, "--standalone", f"--nproc-per-node={nproc}", *program]]
    port = _free_port()
    return [[*run, f"--nnodes={nodes}", f"--node-rank={rank}", "--master-addr=127.0.0.1",
             f"--master-port={port}", f"--nproc-per-node={nproc // nodes}", *program]
            for rank in range(nodes)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tune", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, type=Path, help="base pretraining config")
    parser.add_argument("--data", required=True, type=Path, help="prepared shard folder")
    parser.add_argument("--recipes", required=True, help="comma list of registered recipes")
    parser.add_argument("--budget", type=int, help="trials per recipe")
    parser.add_argument("--first-rung", type=int, help="steps of the first rung")
    parser.add_argument("--nproc", type=int, default=1, help="processes per trial")
    parser.add_argument("--seed", type=int, default=1, help="the tuning seed")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="run each trial as this many torchrun agents here (nodes as workers)",
    )
    parser.add_argument(
        "--eval-seeds", default="", help="comma list of fresh seeds to run the chosen setting on"
    )
    parser.add_argument(
        "--evaluate",
        type=Path,
        help="tune nothing: run the chosen setting recorded in this tuning.json or report",
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("overrides", nargs="*", help="section.field=value for every trial")
    args = parser.parse_args(argv)
    try:
        tuner = Tuner(args.config, args.data, args.out, args.overrides, args.nproc, args.seed,
                      args.nodes)  # fmt: skip
        names = [n.strip() for n in args.recipes.split(",") if n.strip()]
        seeds = [int(s) for s in args.eval_seeds.split(",") if s.strip()]
        for name in names:
            get_recipe(name)
        if args.evaluate is not None:
            for name in names:
                result = reevaluate(tuner, name, args.evaluate, seeds)
                for run in result["evaluation"]:
                    print(f"[tune] {name} seed {run['seed']}: final {run['final_val_loss']:.4f}")
            return 0
        if args.budget is None or args.first_rung is None:
            raise ValueError("--budget and --first-rung are needed to tune (or give --evaluate)")
        if args.seed in seeds:
            raise ValueError(f"--eval-seeds {seeds} holds the tuning seed {args.seed}; "
                             "evaluate on fresh seeds")  # fmt: skip
        for name in names:
            record = tuner.tune(name, args.budget, args.first_rung, seeds)
            print(f"[tune] {name}: chose {record['chosen']} {record['chosen_settings']}")
            for run in record.get("evaluation", []):
                print(f"[tune] {name} seed {run['seed']}: final {run['final_val_loss']:.4f}")
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
