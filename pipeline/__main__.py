"""``python -m pipeline``: run the whole reproduction, locally or as SLURM jobs.

    python -m pipeline run    --config configs/experiments/smoke.yaml [--stages data pretrain/lamb]
    python -m pipeline submit --config configs/experiments/bert_large.yaml [--dry-run]
    python -m pipeline status --config ...
    python -m pipeline report --config ...

Extra ``section.field=value`` arguments override the experiment config. Stages whose outputs
are complete are skipped; an interrupted stage resumes (every stage program resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from onebit_bert.config import ConfigError
from pipeline.experiment import INPUTS_COMPLETE, Experiment, Stage, load_experiment
from pretrain.outputs import describe


def stage_threads(kind: str, nproc: int, cores: int | None = None) -> int:
    """Threads per process for a local stage (unless OMP_NUM_THREADS is set): pretraining
    shares the cores among its ``nproc`` processes, every other stage is one process and
    gets them all."""
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere all CPUs
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // nproc) if kind == "pretrain" else cores


def _run_stage(exp: Experiment, stage: Stage) -> None:
    log = exp.path("logs", stage.name.replace("/", "_") + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    command = exp.command(stage, nproc=exp.cfg.local.nproc_per_node)
    print(f"[pipeline] {stage.name}: {' '.join(command)}", flush=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")
        or str(stage_threads(stage.kind, exp.cfg.local.nproc_per_node)),
    }
    start = time.perf_counter()
    with log.open("a") as out:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for line in proc.stdout:
            out.write(line)
            if not line.startswith(("W1", "I1", "wandb:")) and "Writing model shards" not in line:
                sys.stdout.write(f"  {line}")
        proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage.name} failed (exit {proc.returncode}); see {log}")
    if stage.kind == "inputs":
        (stage.output / INPUTS_COMPLETE).write_text("")
    if not stage.done():
        raise RuntimeError(
            f"stage {stage.name} ended without finishing its outputs "
            f"(interrupted or stopped early); run again to resume; see {log}"
        )
    print(f"[pipeline] {stage.name}: done in {time.perf_counter() - start:.0f} s", flush=True)


def cmd_run(exp: Experiment, stages: list[str] | None) -> int:
    selected = exp.select(stages)
    exp.check_world_size(exp.cfg.local.nproc_per_node, selected)
    start = time.perf_counter()
    for stage in selected:
        if stage.done():
            print(f"[pipeline] {stage.name}: complete, skipped", flush=True)
            continue
        exp.save([stage])  # just before it starts: the file it reads is this invocation's
        _run_stage(exp, stage)
    summary = {
        "experiment": exp.cfg.name,
        "seconds": round(time.perf_counter() - start, 1),
        "stages": [s.name for s in selected],
    }
    report = exp.stage("report")
    if report in selected and report.done():
        summary["report"] = str(report.output / "report.md")
    print(json.dumps(summary))
    if "report" in summary:
        print(f"report: {summary['report']}")
    return 0


def stage_state(stage: Stage, jobs: dict[str, int]) -> str:
    """One line on a stage: done, what its outputs say (pretraining: see
    :func:`pretrain.outputs.describe`), its SLURM job's state, or pending."""
    from pipeline.slurm import job_state

    if stage.done():
        return "done"
    parts = []
    if stage.kind == "pretrain":
        run = describe(stage.output)
        if run.word != "pending":
            parts.append(run.text)
    if stage.name in jobs:
        slurm = job_state(jobs[stage.name])
        parts.append(
            f"slurm job {jobs[stage.name]}: {slurm or 'unknown to SLURM (finished or failed)'}"
        )
    return "; ".join(parts) or "pending"


def cmd_status(exp: Experiment) -> int:
    """Print every stage's state; reads outputs only, writes nothing."""
    from pipeline.slurm import SlurmChain

    jobs = SlurmChain(exp).jobs()
    rows = [(stage.name, stage_state(stage, jobs)) for stage in exp.stages]
    width = max(len(n) for n, _ in rows)
    for name, state in rows:
        print(f"{name:<{width}}  {state}")
    return 0


def cmd_submit(exp: Experiment, stages: list[str] | None, dry_run: bool) -> int:
    from pipeline.slurm import SlurmChain

    selected = exp.select(stages)
    spec = exp.cfg.slurm
    exp.check_world_size(spec.nodes * (spec.gpus_per_node or spec.cpu_procs_per_node), selected)
    for stage in selected:  # generators run here; they are quick and need no cluster
        if stage.kind == "inputs" and not stage.done():
            _run_stage(exp, stage)
    exp.save([s for s in selected if not s.done()])  # the scripts read these files
    chain = SlurmChain(exp)
    jobs = chain.submit([s for s in selected if s.kind != "inputs"], dry_run=dry_run)
    for name, job in jobs.items():
        print(f"{name}: {'(dry run)' if dry_run else f'job {job}'}")
    print(f"scripts in {chain.dir}; logs in {chain.logs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("run", "run stages on this machine"),
        ("submit", "submit stages as chained SLURM jobs"),
        ("status", "what is done, running, failed"),
        ("report", "write the parity report now"),
    ]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", required=True, help="experiment config (configs/experiments/)")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name in ("run", "submit"):
            p.add_argument("--stages", nargs="*", help="stage names or prefixes (default: all)")
        if name == "submit":
            p.add_argument("--dry-run", action="store_true", help="write scripts, print sbatch")
    args, extra = parser.parse_known_args(argv)
    # Overrides may also come after the flags (argparse stops collecting them at a flag).
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    overrides = [*args.overrides, *extra]
    try:
        exp = load_experiment(Path(args.config), overrides)
        # Every stage config is checked before anything runs; run and submit save only the
        # configs of the stages they launch (see Experiment.save), status writes nothing.
        exp.resolve(write=False)
        if args.command == "run":
            return cmd_run(exp, args.stages)
        if args.command == "submit":
            return cmd_submit(exp, args.stages, args.dry_run)
        if args.command == "status":
            return cmd_status(exp)
        report = exp.stage("report")
        exp.save([report])
        _run_stage(exp, report)  # always rewritten: the inputs may have changed
        print(f"report: {report.output / 'report.md'}")
        return 0
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
