"""The experiment's chain as SLURM jobs: sbatch scripts rendered from ``slurm/*.tmpl`` and
saved under ``<workdir>/slurm/``, submitted with ``--dependency=afterok`` between stages.

Placeholders in the templates are ``{{name}}``; everything else (``$SLURM_JOB_ID``,
``${ARRAY[@]}``) is left to bash.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from onebit_bert.io import atomic_write_json, atomic_write_text
from pipeline.experiment import Experiment, Stage

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "slurm"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


HF_CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
"""Where the Hugging Face cache is; passed to the jobs of an offline chain as submitted."""


def job_environment(spec, environ: dict | None = None) -> dict[str, str]:
    """What every job exports: ``slurm.env``, and with ``slurm.offline`` the hub's offline
    switches and the cache variables set in ``environ`` (default: this process's), so that
    the jobs read the cache a login node filled. ``slurm.env`` wins where both set one."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    if spec.offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        env.update({k: environ[k] for k in HF_CACHE_VARIABLES if environ.get(k)})
    env.update({k: str(v) for k, v in spec.env.items()})
    return env


def render(template: str, values: dict[str, object]) -> str:
    def fill(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
        return str(values[key])

    return _PLACEHOLDER.sub(fill, template)


def _template(name: str) -> str:
    return (TEMPLATES / f"{name}.tmpl").read_text()


class SlurmChain:
    """Render and submit the sbatch scripts of an experiment's stages."""

    def __init__(self, experiment: Experiment, python: str = sys.executable):
        self.exp = experiment
        self.spec = experiment.cfg.slurm
        self.python = python
        self.dir = experiment.path("slurm")
        self.logs = experiment.path("logs")
        self.jobs_file = self.dir / "jobs.json"

    # ------------------------------------------------------------------ rendering
    def _base(self, stage: Stage) -> dict[str, object]:
        spec = self.spec
        extra = [f"#SBATCH --partition={spec.partition}"] if spec.partition else []
        extra += [f"#SBATCH --account={spec.account}"] if spec.account else []
        extra += [f"#SBATCH {opt}" for opt in spec.extra_sbatch]
        env = "\n".join(
            f"export {k}={shlex.quote(str(v))}" for k, v in job_environment(spec).items()
        )
        common = render(
            _template("common.sh"),
            {"repo": REPO, "setup": "\n".join(spec.setup), "env": env, "stage": stage.name},
        )
        return {
            "name": self.exp.cfg.name,
            "python": self.python,
            "logs": self.logs,
            "sbatch_extra": "\n".join(extra),
            "common": common,
            "cpus_per_task": spec.cpus_per_task,
            "config": stage.config_path,
        }

    def script(self, stage: Stage) -> str:
        spec = self.spec
        values = self._base(stage)
        if stage.kind == "data":
            values["time_data"] = spec.time_data
            return render(_template("data.sbatch"), values)
        if stage.kind == "pretrain":
            _, run, phase = stage.name.split("/")
            nproc = spec.gpus_per_node or spec.cpu_procs_per_node
            values.update(
                run=run,
                phase=phase.removeprefix("phase"),
                nodes=spec.nodes,
                time_pretrain=spec.time_pretrain,
                signal_lead=spec.signal_lead,
                sbatch_gpus=f"#SBATCH --gpus-per-node={spec.gpus_per_node}"
                if spec.gpus_per_node
                else "",
                master_port=spec.master_port,
                run_dir=stage.output,
                nproc_per_node=nproc,
                shutdown_timeout=max(60, spec.signal_lead - 60),
            )
            return render(_template("pretrain.sbatch"), values)
        if stage.kind == "finetune":
            cfg = stage.stage_config()
            tasks, seeds = cfg.tasks, cfg.seeds
            values.update(
                run=stage.name.split("/")[1],
                time_finetune=spec.time_finetune,
                array_last=len(tasks) * len(seeds) - 1,
                tasks=" ".join(tasks),
                seeds=" ".join(str(s) for s in seeds),
                sbatch_gpus_one="#SBATCH --gpus=1" if spec.gpus_per_node else "",
            )
            return render(_template("finetune.sbatch"), values)
        if stage.kind == "target":
            values.update(
                target_args=" ".join(shlex.quote(a) for a in stage.args), out=stage.output
            )
            return render(_template("target.sbatch"), values)
        if stage.kind == "report":
            aggregate = "\n".join(
                f'"{self.python}" -m finetune run --config "{s.config_path}"'
                for s in self.exp.stages
                if s.kind == "finetune"
            )
            values.update(
                aggregate=aggregate,
                out=stage.output,
                report_module=self.exp.cfg.report.module,
                report_runs=" ".join(shlex.quote(a) for a in stage.args),
            )
            return render(_template("report.sbatch"), values)
        raise ValueError(
            f"stage {stage.name} ({stage.kind}) is not submitted as a job; "
            f"run it locally first (`pipeline run --stages {stage.name}`)"
        )

    def write_scripts(self, stages: list[Stage]) -> dict[str, Path]:
        paths = {}
        for stage in stages:
            path = self.dir / (stage.name.replace("/", "_") + ".sbatch")
            atomic_write_text(path, self.script(stage))
            path.chmod(0o755)
            paths[stage.name] = path
        return paths

    # ------------------------------------------------------------------ submission
    def jobs(self) -> dict[str, int]:
        return json.loads(self.jobs_file.read_text()) if self.jobs_file.is_file() else {}

    def submit(
        self, stages: list[Stage], dry_run: bool = False, sbatch: str = "sbatch"
    ) -> dict[str, int]:
        """Submit the stages that are not done, each after the jobs it depends on."""
        self.logs.mkdir(parents=True, exist_ok=True)
        todo = [s for s in stages if not s.done()]
        scripts = self.write_scripts(todo)
        submitted: dict[str, int] = {}
        for stage in todo:
            after = [str(submitted[d]) for d in stage.depends if d in submitted]
            command = [sbatch, "--parsable"]
            if after:
                command.append("--dependency=afterok:" + ":".join(after))
            command.append(str(scripts[stage.name]))
            if dry_run:
                print(" ".join(shlex.quote(c) for c in command))
                submitted[stage.name] = -(len(submitted) + 1)
                continue
            out = subprocess.run(command, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"sbatch failed for {stage.name}: {out.stderr.strip()}")
            submitted[stage.name] = int(out.stdout.strip().split(";")[0])
        if not dry_run:
            atomic_write_json(self.jobs_file, {**self.jobs(), **submitted})
        return submitted


def job_state(job_id: int) -> str | None:
    """JobState of a SLURM job (None when SLURM does not know it, or is absent)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(job_id)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bJobState=(\S+)", out.stdout)
    return match.group(1) if match else None
