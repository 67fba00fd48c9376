"""An experiment: the whole chain of stages, described by one config.

    inputs (optional generator) → data → pretrain/<run>/phase<i> … → finetune/<run> → report

Each stage runs one of the stage programs (``python -m data_prep``, ``-m pretrain``,
``-m finetune``) with a stage config written under ``<workdir>/configs/``: the stage's own
config file plus the experiment's overrides plus the paths that link stages (data
directory, ``init_from``, checkpoint, output). Stages hand off through those directories
only; a stage is done when its outputs say so, as each stage's ``outputs`` module reads
them (:mod:`data_prep.outputs`, :mod:`pretrain.outputs`, :mod:`finetune.outputs`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data_prep import outputs as data_outputs
from finetune import outputs as finetune_outputs
from onebit_bert.config import load_config, save_config
from onebit_bert.recipes import get_recipe
from pipeline.target import parse_utc, read_target
from pretrain import outputs as pretrain_outputs

TARGET_FILE = "target.json"
"""The parity gate's target under the workdir (:mod:`pipeline.target`)."""
BASELINE = "random-init"
"""The fine-tuning stage of the randomly initialised baseline (``finetune/random-init``)."""
INPUTS_COMPLETE = ".complete"
"""Marker the orchestrator writes in ``<workdir>/inputs`` once the generator succeeded."""


@dataclass
class StageSpec:
    """A stage program's config file and overrides (``section.field=value``)."""

    config: str | None = None
    overrides: list[str] = field(default_factory=list)


@dataclass
class PhaseSpec(StageSpec):
    """One pretraining phase of a run: its config, overrides and sequence length."""

    seq_length: int = 128
    """Which prepared length this phase trains on (the data stage must produce it)."""


@dataclass
class RunSpec:
    """One pretraining recipe to compare (e.g. LAMB, or 1-bit LAMB)."""

    name: str
    phases: list[PhaseSpec]
    """Phase 2 starts from phase 1 (``model.init_from``), and so on."""
    recipe: str | None = None
    """A registered recipe (:mod:`onebit_bert.recipes`): its overrides come before each
    phase's own, and the runs record it; null: each phase's overrides say what it runs."""
    seeds: list[int] | None = None
    """Pretraining seeds of this run; null: the experiment's ``seeds``."""
    finetune: bool = True
    """Fine-tune this run's checkpoints (false: pretraining only, e.g. a sensitivity run)."""
    sensitivity: bool = False
    """Parity report: a sensitivity run (e.g. another freeze step), shown in its own table
    and figure and never gated or used for a verdict."""

    def __post_init__(self):
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"run {self.name!r}: seeds must be distinct, got {self.seeds}")
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"run name {self.name!r}: use letters, digits, '-' and '_'")
        if not self.phases:
            raise ValueError(f"run {self.name!r} has no phases")
        if self.recipe is not None:
            get_recipe(self.recipe)


@dataclass
class LocalSpec:
    """How `python -m pipeline run` executes stages on this machine."""

    nproc_per_node: int = 2
    """Pretraining processes on this machine (torchrun --nproc-per-node)."""


@dataclass
class SlurmSpec:
    """How the chain becomes SLURM jobs (see docs/guide/clusters.md)."""

    partition: str | None = None
    account: str | None = None
    nodes: int = 1
    """Nodes for each pretraining phase."""
    gpus_per_node: int = 8
    """GPUs per node = pretraining processes per node (0: CPU-only nodes)."""
    cpu_procs_per_node: int = 2
    """Processes per node when gpus_per_node is 0."""
    cpus_per_task: int = 8
    time_data: str = "12:00:00"
    time_pretrain: str = "24:00:00"
    time_finetune: str = "04:00:00"
    signal_lead: int = 300
    """Seconds before the time limit at which SLURM sends USR1: the run checkpoints and the
    job requeues itself."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run first in every job (module load ..., source a venv, ...)."""
    env: dict = field(default_factory=dict)
    """Environment for the jobs, e.g. NCCL_SOCKET_IFNAME or NCCL_IB_HCA."""
    offline: bool = False
    """Compute nodes without internet: every job runs with HF_HUB_OFFLINE=1 and
    HF_DATASETS_OFFLINE=1, and with the Hugging Face cache variables (HF_HOME,
    HF_HUB_CACHE, HF_DATASETS_CACHE) that were set when the chain was submitted. Fill
    that cache on a login node first (docs/guide/clusters.md)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """More #SBATCH options, e.g. --qos=high."""
    master_port: int = 29500


@dataclass
class ReportSpec:
    """Which report the last stage writes."""

    kind: Literal["parity", "compare"] = "parity"
    """parity: the parity report (``python -m pipeline.reports.parity``: arms side by side, Welch
    verdicts); compare: the comparison report (``python -m pipeline.reports.compare``: samples-,
    bytes- and modelled time-to-target per strategy)."""
    netem: str | list[str] | None = None
    """compare: a ``bench.netem`` netem.json with measured samples/s per strategy (the
    modelled times), or a list of them (sweeps of the same settings at other bandwidths or
    world sizes, merged); null: no modelled times."""
    target_loss: float | None = None
    """compare: the target validation MLM loss; null: the first run's final, mean over its
    seeds."""
    folder: str = "report"
    """The report's folder under the workdir (two experiments sharing a workdir, one
    reusing the other's runs, keep their reports apart)."""
    gate: bool = False
    """parity: fix a target from the reference arm (the first run) in a ``target`` stage
    that every other arm's pretraining waits for (``<workdir>/target.json``), and gate each
    arm's samples to that target (:mod:`pipeline.reports.gate`)."""
    target_fraction: float = 0.8
    """parity gate: the target is the worst reference seed's validation MLM loss at this
    fraction of the run (unless target_loss fixes it)."""
    margin: float = 0.05
    """parity gate: an arm passes when its mean samples to target is at most this fraction
    above the reference's (one-sided test at ``alpha``)."""
    alpha: float = 0.05
    min_seeds: int = 5
    """parity gate: fewer pretraining seeds per arm give no pass or fail (Welch); the
    paired test's pre-registered number of seed pairs."""
    test: Literal["welch", "paired"] = "welch"
    """parity gate: the primary test. welch: one-sided Welch test on the arms' mean samples
    to target; paired: one-sided paired t-test on the per-seed log(candidate / reference)
    over seed-matched pairs (:func:`pipeline.reports.gate.paired_gate`), Welch then a secondary
    line."""
    preregistered: str | None = None
    """parity gate: when the test, margin, alpha and seed count were fixed (ISO 8601 UTC,
    e.g. "2026-11-28T21:41:00Z"); the report prints it and checks that it precedes every
    candidate arm's first step. Required with test: paired."""
    arms_fixed: dict[str, str] = field(default_factory=dict)
    """parity gate: candidate arm name -> when it was added under the pre-registered test
    (ISO 8601 UTC), for an arm added after ``preregistered``; the report checks each against
    that arm's first steps."""
    finetune_baseline: bool = False
    """parity: also fine-tune a randomly initialised model of the reference's architecture
    (stage ``finetune/random-init``): tasks where pretraining does not beat it by several
    fine-tuning seed spreads carry no signal and get no verdict."""

    def __post_init__(self):
        if self.test == "paired" and self.preregistered is None:
            raise ValueError(
                "report.test: paired needs report.preregistered, the UTC time the test, "
                'margin, alpha and seeds were fixed (e.g. "2026-11-28T21:41:00Z"), '
                "written before any candidate arm runs"
            )
        if self.preregistered is not None:
            parse_utc(self.preregistered, "report.preregistered")
        for name, stamp in self.arms_fixed.items():
            parse_utc(stamp, f"report.arms_fixed.{name}")
        if not 0 < self.target_fraction <= 1:
            raise ValueError(
                f"report.target_fraction must lie in (0, 1], got {self.target_fraction}"
            )
        if not 0 <= self.margin < 1 or not 0 < self.alpha < 0.5 or self.min_seeds < 2:
            raise ValueError(
                "report.margin must lie in [0, 1), report.alpha in (0, 0.5) and "
                "report.min_seeds be >= 2"
            )

    @property
    def module(self) -> str:
        return "pipeline.reports.compare" if self.kind == "compare" else "pipeline.reports.parity"

    def args(self) -> list[str]:
        """The report program's arguments besides the runs and the output."""
        if self.kind != "compare":
            if not self.gate:
                return []
            out = ["--margin", str(self.margin), "--alpha", str(self.alpha),
                   "--min-seeds", str(self.min_seeds), "--test", self.test]  # fmt: skip
            if self.preregistered is not None:
                out += ["--preregistered", self.preregistered]
            for name, stamp in self.arms_fixed.items():
                out += ["--arm-fixed", f"{name}={stamp}"]
            return out
        out = []
        for path in [self.netem] if isinstance(self.netem, str) else self.netem or []:
            out += ["--netem", path]
        if self.target_loss is not None:
            out += ["--target-loss", str(self.target_loss)]
        return out


@dataclass
class ExperimentConfig:
    """A whole experiment: inputs, data, pretraining runs (x seeds), fine-tuning, report,
    and how to run them locally or on SLURM."""

    name: str
    workdir: str
    data: StageSpec
    runs: list[RunSpec]
    finetune: StageSpec
    seeds: list[int] = field(default_factory=list)
    """Pretraining seeds: every run is pretrained and fine-tuned once per seed (stages
    ``pretrain/<run>-seed<N>/…``, ``finetune/<run>-seed<N>``) and the report gives the
    spread over seeds. Empty: once, with the pretraining config's own seed."""
    inputs: list[str] = field(default_factory=list)
    """Optional command (argv) that creates input files first; ``{workdir}`` and
    ``{python}`` are substituted here and in every override."""
    local: LocalSpec = field(default_factory=LocalSpec)
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    report: ReportSpec = field(default_factory=ReportSpec)

    def __post_init__(self):
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"runs must have unique names, got {names}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if unknown := sorted(set(self.report.arms_fixed) - set(names[1:])):
            raise ValueError(
                f"report.arms_fixed names {', '.join(unknown)}, not a candidate run "
                f"(candidates: {', '.join(names[1:])})"
            )

    def instances(self) -> list[tuple[RunSpec, str, int | None]]:
        """(run, instance name, seed) for every run × pretraining seed."""
        out: list[tuple[RunSpec, str, int | None]] = []
        for run in self.runs:
            seeds = self.seeds if run.seeds is None else run.seeds
            if not seeds:
                out.append((run, run.name, None))
            out.extend((run, f"{run.name}-seed{s}", s) for s in seeds)
        return out


@dataclass
class Stage:
    """One step of the chain: what it runs, where its config and outputs are."""

    name: str  # e.g. "pretrain/lamb/phase1"
    kind: str  # inputs | data | pretrain | target | finetune | report
    config_path: Path | None
    output: Path
    depends: list[str]
    args: list[str] = field(default_factory=list)
    """Extra arguments (the report's NAME=PRETRAIN:FINETUNE runs)."""
    expected: float | None = None
    """target stages: the value the experiment config fixes (None: the rule decides)."""
    config: Any = None
    """The resolved stage config (a DataPrepConfig, PretrainConfig or FinetuneConfig);
    loaded from ``config_path`` on first use when not given."""

    def stage_config(self) -> Any:
        """The stage's config dataclass (None for stages without a config file)."""
        if self.config is None and self.config_path is not None:
            self.config = load_config(_config_class(self.kind), self.config_path)
        return self.config

    def done(self) -> bool:
        """Whether the stage's outputs say it is finished."""
        return _DONE[self.kind](self)


def _config_class(kind: str) -> type:
    if kind == "data":
        from data_prep.config import DataPrepConfig

        return DataPrepConfig
    if kind == "pretrain":
        from pretrain.config import PretrainConfig

        return PretrainConfig
    if kind == "finetune":
        from finetune.config import FinetuneConfig

        return FinetuneConfig
    raise ValueError(f"{kind} stages have no config file")


def _inputs_done(stage: Stage) -> bool:
    return (stage.output / INPUTS_COMPLETE).is_file()


def _data_done(stage: Stage) -> bool:
    return data_outputs.is_complete(stage.output, stage.stage_config().instances.seq_lengths)


def _pretrain_done(stage: Stage) -> bool:
    return pretrain_outputs.is_complete(stage.output)


def _finetune_done(stage: Stage) -> bool:
    cfg = stage.stage_config()
    return finetune_outputs.is_complete(stage.output, cfg.tasks, cfg.seeds)


def _target_done(stage: Stage) -> bool:
    target = read_target(stage.output)
    if target is None:
        return False
    if stage.expected is not None and target["value"] != stage.expected:
        raise ValueError(
            f"{stage.output} holds target {target['value']} but the experiment config fixes "
            f"report.target_loss={stage.expected}: a target is fixed once; remove the file to "
            f"fix it anew only if no other arm has run yet"
        )
    return True


def _report_done(stage: Stage) -> bool:
    return (stage.output / "report.md").is_file()


_DONE = {
    "inputs": _inputs_done,
    "data": _data_done,
    "pretrain": _pretrain_done,
    "finetune": _finetune_done,
    "report": _report_done,
    "target": _target_done,
}


class Experiment:
    """The stages of an experiment config, with their stage configs resolved and saved."""

    def __init__(self, cfg: ExperimentConfig, config_path: Path | None = None):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir)
        self.config_path = config_path
        self.stages: list[Stage] = []
        self._write = False

    def path(self, *parts: str) -> Path:
        return self.workdir.joinpath(*parts)

    def resolve(self, write: bool = True) -> list[Stage]:
        """Check every stage config and, with ``write``, save it under ``<workdir>/configs``
        with the experiment config (nothing runs). ``write=False`` touches no file."""
        from data_prep.config import DataPrepConfig
        from pretrain.config import PretrainConfig

        cfg = self.cfg
        stages: list[Stage] = []
        configs = self.path("configs")

        self._write = write

        def save(config, path: Path) -> None:
            if write:
                save_config(config, path)

        save(cfg, self.path("experiment.yaml"))
        if cfg.inputs:
            stages.append(Stage("inputs", "inputs", None, self.path("inputs"), []))
        data_out = self.path("data")
        data_cfg = self._stage_config(DataPrepConfig, cfg.data, [f"output={data_out}"])
        lengths = sorted({p.seq_length for r in cfg.runs for p in r.phases})
        missing = [n for n in lengths if n not in data_cfg.instances.seq_lengths]
        if missing:
            raise ValueError(
                f"phases train on seq lengths {missing} that the data stage does not "
                f"prepare (instances.seq_lengths={data_cfg.instances.seq_lengths})"
            )
        save(data_cfg, configs / "data.yaml")
        data_depends = ["inputs"] if cfg.inputs else []
        stages.append(
            Stage("data", "data", configs / "data.yaml", data_out, data_depends, config=data_cfg)
        )
        reports, report_depends = [], []
        first_phases: dict[str, Stage] = {}  # instance -> its first pretraining stage
        reference = cfg.runs[0].name
        for run, instance, seed in cfg.instances():
            previous: Stage | None = None
            for i, phase in enumerate(run.phases, start=1):
                name = f"pretrain/{instance}/phase{i}"
                run_dir = self.path("pretrain", instance, f"phase{i}")
                links = [
                    f"run_dir={run_dir}",
                    f"data.path={data_outputs.seq_dir(data_out, phase.seq_length)}",
                    f"logging.experiment={cfg.name}",
                    f"logging.run_name={instance}-phase{i}",
                    f"logging.job_type=phase{i}",
                ]
                if seed is not None:
                    links.append(f"seed={seed}")
                if previous is not None:
                    links.append(f"model.init_from={previous.output}")
                recipe = get_recipe(run.recipe).overrides() if run.recipe else []
                if run.recipe:
                    recipe.append(f"recipe={run.recipe}")
                pcfg = self._stage_config(PretrainConfig, phase, links, before=recipe)
                path = configs / f"pretrain_{instance}_phase{i}.yaml"
                save(pcfg, path)
                depends = [previous.name] if previous else ["data"]
                stage = Stage(name, "pretrain", path, run_dir, depends, config=pcfg)
                stages.append(stage)
                first_phases.setdefault(instance, stage)
                previous = stage
            if run.sensitivity:
                reports += ["--sensitivity", f"{run.name}={previous.output}"]
                report_depends.append(previous.name)
            if not run.finetune:
                if not run.sensitivity:
                    reports += ["--run", f"{run.name}={previous.output}"]
                    report_depends.append(previous.name)
                continue
            ft_out = self.path("finetune", instance)
            stages.append(self._finetune_stage(f"finetune/{instance}", previous, ft_out, []))
            report_depends.append(f"finetune/{instance}")
            if not run.sensitivity:
                reports += ["--run", f"{run.name}={previous.output}:{ft_out}"]
        if cfg.report.finetune_baseline:
            first = cfg.instances()[0][1]
            source = [s for s in stages if s.name.startswith(f"pretrain/{first}/")][-1]
            ft_out = self.path("finetune", BASELINE)
            stages.append(
                self._finetune_stage(f"finetune/{BASELINE}", source, ft_out, ["init=random"])
            )
            report_depends.append(f"finetune/{BASELINE}")
            reports += ["--baseline", f"{BASELINE}={ft_out}"]
        if cfg.report.gate and cfg.report.kind == "parity":
            stages = self._insert_target_stage(stages, first_phases, reference)
            reports += ["--target", str(self.path(TARGET_FILE))]
        runs_args = reports + [self._expand(a) for a in cfg.report.args()]
        stages.append(
            Stage(
                "report",
                "report",
                None,
                self.path(cfg.report.folder),
                report_depends,
                args=runs_args,
            )
        )
        self.stages = stages
        return stages

    def save(self, stages: list[Stage]) -> None:
        """Save the experiment config and the configs of ``stages`` (those about to run or be
        submitted) under ``<workdir>/configs``. Other stages' files are left alone, so two
        invocations that run different stages of one workdir with different overrides (a
        sweep beside a fine-tuning chain) never rewrite each other's configs."""
        save_config(self.cfg, self.path("experiment.yaml"))
        for stage in stages:
            if stage.config_path is not None and stage.config is not None:
                save_config(stage.config, stage.config_path)

    def _finetune_stage(self, name: str, source: Stage, out: Path, extra: list[str]) -> Stage:
        """Fine-tuning of ``source``'s final checkpoint into ``out``."""
        from finetune.config import FinetuneConfig

        links = [
            f"checkpoint={pretrain_outputs.final_dir(source.output)}",
            f"output={out}",
            # its wandb runs in the group of the pretraining runs, named after the instance
            f"logging.experiment={self.cfg.name}",
            f"logging.run_name={name.split('/', 1)[1]}",
            "logging.job_type=finetune",
        ]
        fcfg = self._stage_config(FinetuneConfig, self.cfg.finetune, [*extra, *links])
        path = self.path("configs", f"finetune_{name.split('/', 1)[1]}.yaml")
        if self._write:
            save_config(fcfg, path)
        return Stage(name, "finetune", path, out, [source.name], config=fcfg)

    def _insert_target_stage(
        self, stages: list[Stage], first_phases: dict[str, Stage], reference: str
    ) -> list[Stage]:
        """The ``target`` stage after the reference arm's last pretraining stage and before
        any other arm's first one, which waits for it."""
        cfg = self.cfg
        ref_instances = [inst for run, inst, _ in cfg.instances() if run.name == reference]
        ref_finals = [
            [s for s in stages if s.name.startswith(f"pretrain/{inst}/")][-1]
            for inst in ref_instances
        ]
        args = [arg for s in ref_finals for arg in ("--run", f"{reference}={s.output}")]
        args += ["--fraction", str(cfg.report.target_fraction)]
        if cfg.report.target_loss is not None:
            args += ["--value", str(cfg.report.target_loss)]
        target = Stage(
            "target",
            "target",
            None,
            self.path(TARGET_FILE),
            [s.name for s in ref_finals],
            args=args,
        )
        target.expected = cfg.report.target_loss
        others = [s for inst, s in first_phases.items() if inst not in ref_instances]
        for stage in others:
            stage.depends.append("target")
        position = min((stages.index(s) for s in others), default=len(stages))
        return [*stages[:position], target, *stages[position:]]

    def _expand(self, text: str) -> str:
        return text.replace("{workdir}", str(self.workdir)).replace("{python}", sys.executable)

    def _stage_config(self, cls, spec: StageSpec, links: list[str], before: list[str] = ()):
        base = None
        if spec.config:
            base = Path(spec.config)
            if not base.is_absolute() and self.config_path is not None and not base.exists():
                base = self.config_path.parent / base
        overrides = [*before, *(self._expand(o) for o in spec.overrides), *links]
        return load_config(cls, base, overrides)

    def check_world_size(self, world_size: int, stages: list[Stage]) -> None:
        """Every pretraining stage's batch must divide over ``world_size`` processes: a clear
        error now rather than a failed job later."""
        for stage in stages:
            if stage.kind == "pretrain":
                try:
                    stage.stage_config().batch_plan(world_size)
                except ValueError as err:
                    raise ValueError(f"stage {stage.name}: {err}") from None

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def select(self, names: list[str] | None) -> list[Stage]:
        """The named stages (a prefix such as ``pretrain`` or ``pretrain/lamb`` selects all
        below it), in chain order; all stages when ``names`` is empty."""
        if not names:
            return list(self.stages)
        chosen = [
            s for s in self.stages if any(s.name == n or s.name.startswith(n + "/") for n in names)
        ]
        unknown = [
            n
            for n in names
            if not any(s.name == n or s.name.startswith(n + "/") for s in self.stages)
        ]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages: {[s.name for s in self.stages]}")
        return chosen

    def command(self, stage: Stage, python: str = sys.executable, nproc: int = 1) -> list[str]:
        """The program a stage runs (locally; SLURM jobs wrap the same programs)."""
        if stage.kind == "inputs":
            return [self._expand(part) for part in self.cfg.inputs]
        config = ["--config", str(stage.config_path)]
        if stage.kind == "data":
            return [python, "-m", "data_prep", *config]
        if stage.kind == "pretrain":
            launcher = [python, "-m", "torch.distributed.run", "--standalone"]
            return [*launcher, f"--nproc-per-node={nproc}", "-m", "pretrain", *config]
        if stage.kind == "finetune":
            return [python, "-m", "finetune", "run", *config]
        if stage.kind == "target":
            return [python, "-m", "pipeline.target", *stage.args, "--out", str(stage.output)]
        return [python, "-m", self.cfg.report.module, *stage.args, "--out", str(stage.output)]


def load_experiment(path: str | Path, overrides: list[str] = ()) -> Experiment:
    path = Path(path)
    cfg = load_config(ExperimentConfig, path, list(overrides))
    return Experiment(cfg, path)
