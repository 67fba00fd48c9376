"""Run metrics: always a local ``metrics.jsonl``, and wandb on the main rank when it works;
optionally TensorBoard event files.

wandb runs offline unless the user configured it (``WANDB_API_KEY`` or ``WANDB_MODE``), is
grouped by experiment, named by run, typed by phase (``job_type``), and never stops
training: if it cannot start or a log call fails, a warning is printed and the local file
carries on. Every run directory gets its own wandb run id, made once from the experiment,
the run name and the directory's path and kept in ``<run_dir>/wandb_id``: a resumed run
continues its wandb run, and two runs (arms, seeds, phases, experiments) never share one.
TensorBoard (``logging.tensorboard: true``) writes every numeric metric as a scalar under
``<run_dir>/tensorboard``; asking for it without the ``tensorboard`` package installed is an
error at start-up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit_bert.io import atomic_write_text

METRICS_FILE = "metrics.jsonl"
"""The file name of the metrics log in a run directory."""
WANDB_ID_FILE = "wandb_id"
"""The run directory's wandb run id, written on first start and read on every resume."""
PER_KIND_PREFIXES = ("comm_bytes_", "comm_seconds_")
"""Per-kind traffic figures: a record has them only for the kinds sent that step (after a
1-bit optimizer's freeze, no ``comm_bytes_gradients``). ``metrics.jsonl`` keeps records as
they are; in wandb and TensorBoard a step's record gets 0 for a per-kind key logged before
and absent now, so wandb's summary and the charts show the last step's traffic, not the
last nonzero one."""


@dataclass
class LoggingConfig:
    """Where metrics go."""

    wandb: bool = True
    """Log to wandb on rank 0 (offline unless WANDB_API_KEY or WANDB_MODE is set)."""
    project: str = "onebit-bert"
    experiment: str = "default"
    """wandb group: runs of one experiment (e.g. LAMB vs 1-bit LAMB) side by side."""
    run_name: str | None = None
    """wandb run name (the pipeline sets ``<run>-seed<N>-phase<i>``); default: the run
    directory's name and the SLURM job id."""
    job_type: str | None = None
    """wandb job type (the pipeline sets the phase, e.g. ``phase1``)."""
    every: int = 1
    """Write metrics every this many steps."""
    progress_every: int = 10
    """Print a progress line every this many steps."""
    net_interface: str | None = None
    """Also log the bytes rank 0's network interface sent and received during each step
    (``net_tx_bytes``/``net_rx_bytes``, Linux ``/proc/net/dev``) next to the communicator's
    own count (``comm_bytes``). ``auto``: the interface in GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME; null: off."""

    tensorboard: bool = False
    """Also write TensorBoard event files (every numeric metric as a scalar) under
    ``<run_dir>/tensorboard`` on rank 0; needs ``pip install tensorboard``."""

    def __post_init__(self):
        if self.every < 1 or self.progress_every < 1:
            raise ValueError("logging.every and logging.progress_every must be >= 1")


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def wandb_run_id(run_dir: Path, experiment: str, run_name: str | None) -> str:
    """The run directory's wandb id: read from ``<run_dir>/wandb_id`` when a start wrote
    it, else made from the experiment, the run name and a hash of the directory's absolute
    path (distinct for every run directory), and written there."""
    path = Path(run_dir) / WANDB_ID_FILE
    if path.is_file():
        stored = path.read_text().strip()
        if stored:
            return stored
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9_-]+", "-", f"{experiment}-{run_name or Path(run_dir).name}")
    run_id = f"{base[:100]}-{digest}"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, run_id + "\n")
    return run_id


class MetricsLogger:
    """``log(step, metrics)`` from every rank; only the main rank writes."""

    def __init__(
        self,
        run_dir: str | Path,
        is_main: bool,
        cfg: LoggingConfig,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        """``resume_step``: the run resumes after that step, so the records of later steps
        (logged before the interruption, about to be replayed) are dropped from the file."""
        self.is_main = is_main
        self.cfg = cfg
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._wandb = None
        self._tensorboard = None
        self._per_kind_keys: set[str] = set()
        if not is_main:
            return
        if cfg.tensorboard:
            self._tensorboard = _tensorboard_writer(Path(run_dir) / "tensorboard")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            drop_records_after(self.path, resume_step)
        self._file = self.path.open("a", buffering=1)
        if cfg.wandb:
            self._wandb = self._start_wandb(Path(run_dir), config or {})

    def _start_wandb(self, run_dir: Path, config: dict):
        if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        job = os.environ.get("SLURM_JOB_ID")
        name = self.cfg.run_name or (f"{run_dir.name}-{job}" if job else run_dir.name)
        try:
            import wandb

            return wandb.init(
                project=self.cfg.project,
                group=self.cfg.experiment,
                name=name,
                job_type=self.cfg.job_type,
                dir=str(run_dir),
                config=config,
                resume="allow",
                id=wandb_run_id(run_dir, self.cfg.experiment, self.cfg.run_name),
            )
        except Exception as err:  # training goes on without wandb
            warnings.warn(
                f"wandb did not start ({type(err).__name__}: {err}); metrics go to "
                f"{self.path} only",
                stacklevel=2,
            )
            return None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        scalars = self._scalars(record)
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as err:
                warnings.warn(f"wandb log failed ({err}); continuing without wandb", stacklevel=2)
                self._wandb = None

    def _scalars(self, record: dict) -> dict:
        """The record's numbers for wandb and TensorBoard; a record of a step's traffic
        (one with ``comm_bytes``) also gets 0 for every per-kind key
        (:data:`PER_KIND_PREFIXES`) logged before and absent from it. Other records (a
        validation's, logged at the same step) are left alone: a 0 there would overwrite
        the step's figure."""
        scalars = {
            k: v
            for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, int | float)
        }
        if "comm_bytes" not in scalars:
            return scalars
        self._per_kind_keys.update(k for k in scalars if k.startswith(PER_KIND_PREFIXES))
        for key in self._per_kind_keys - scalars.keys():
            scalars[key] = 0
        return scalars

    def progress(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as err:
                warnings.warn(f"wandb finish failed ({err})", stacklevel=2)
            self._wandb = None


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ValueError(
            "logging.tensorboard needs the tensorboard package: pip install tensorboard "
            "(or set logging.tensorboard=false)"
        ) from err
    return SummaryWriter(log_dir=str(log_dir))


def drop_records_after(path: str | Path, step: int) -> int:
    """Rewrite ``path`` (atomically) without its records of steps after ``step`` and any
    torn line; returns how many records were dropped (0: the file is left as it is)."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)) or (
            record["step"] <= step
        ):
            kept.append(line)
    if len(kept) == len(lines):
        return 0
    atomic_write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
