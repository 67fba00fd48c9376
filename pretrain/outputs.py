"""What a pretraining phase leaves in its run directory, and what state the run is in.

    <run_dir>/
        config.yaml        the resolved config
        metrics.jsonl      one record per logged step
        checkpoints/       step_XXXXXXXX/ training checkpoints
        status.json        the run's state, written by :class:`RunStatus`
        final/             the trained model and tokenizer in HF format (complete runs only)

``status.json`` holds ``state`` (``running``, ``complete``, ``preempted``, ``stopped``, or
another word the loop chooses, e.g. ``failed``), ``step``, ``last_checkpoint``, ``host``,
``pids`` (processes of the writing node), ``heartbeat`` (unix time of the last write),
``started``, and whatever summary the loop passes when it finishes. :func:`describe` turns
it into what a user should see, checking whether the processes are still there.

    python -m pretrain.outputs state RUN_DIR      # one word: done, running, preempted, ...
    python -m pretrain.outputs describe RUN_DIR   # one line for people

Standard library only: the orchestrator and the SLURM scripts use it without torch.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onebit_bert.io import atomic_write_json, read_json_object
from onebit_bert.metrics_log import METRICS_FILE
from onebit_bert.run_lock import HEARTBEAT_INTERVAL, STALE_AFTER, pid_alive

STATUS = "status.json"
UNREADABLE = "unreadable"
"""The state :func:`describe` gives a run whose ``status.json`` is damaged."""
CONFIG = "config.yaml"
FINAL = "final"
CHECKPOINTS = "checkpoints"


# State words of status.json that the loop writes.
RUNNING = "running"
COMPLETE = "complete"
PREEMPTED = "preempted"
STOPPED = "stopped"
DIVERGED = "diverged"
FAILED = "failed"


def status_path(run_dir: str | Path) -> Path:
    """The run's ``status.json``."""
    return Path(run_dir) / STATUS


def config_path(run_dir: str | Path) -> Path:
    """The resolved config the run was started with."""
    return Path(run_dir) / CONFIG


def metrics_path(run_dir: str | Path) -> Path:
    """The run's ``metrics.jsonl``."""
    return Path(run_dir) / METRICS_FILE


def final_dir(run_dir: str | Path) -> Path:
    """The exported HF model of a complete run (what fine-tuning starts from)."""
    return Path(run_dir) / FINAL


def checkpoints_dir(run_dir: str | Path) -> Path:
    """The directory of the run's training checkpoints."""
    return Path(run_dir) / CHECKPOINTS


class StatusUnreadable(ValueError):
    """``status.json`` exists but is damaged (truncated, not JSON, not an object)."""


def read_status(run_dir: str | Path) -> dict | None:
    """The contents of ``status.json``, or None when the run has not written one;
    :class:`StatusUnreadable` (one line naming the file) when it is damaged."""
    return read_json_object(status_path(run_dir), missing=None, unreadable=StatusUnreadable)


def is_complete(run_dir: str | Path) -> bool:
    """The run finished every step and exported its model (a damaged status: no)."""
    try:
        status = read_status(run_dir)
    except StatusUnreadable:
        return False
    return (
        status is not None
        and status.get("state") == COMPLETE
        and (final_dir(run_dir) / "config.json").is_file()
    )


# ----------------------------------------------------------------------------- writing


class RunStatus:
    """Writes ``status.json`` for the training loop.

    ``start`` and ``finish`` always write; ``heartbeat`` writes when ``interval`` seconds
    have passed since the last write, or when ``last_checkpoint`` changed, and otherwise
    only compares two numbers, so the loop can call it every step. Every write is atomic.
    With ``is_writer=False`` (ranks other than 0) every method does nothing.

        status = RunStatus(run_dir, is_writer=rank == 0)
        status.start(step)
        ...
        status.heartbeat(step, last_checkpoint)
        ...
        status.finish("complete", summary)
    """

    def __init__(
        self,
        run_dir: str | Path,
        is_writer: bool = True,
        interval: float = HEARTBEAT_INTERVAL,
    ):
        self.path = status_path(run_dir)
        self.is_writer = is_writer
        self.interval = interval
        self._record: dict[str, Any] = {
            "state": RUNNING,
            "step": 0,
            "last_checkpoint": None,
            "host": socket.gethostname(),
            "pids": [os.getpid()],
        }
        self._last_write = -float("inf")
        self._warned = False
        self._created = time.time()

    @property
    def record(self) -> dict[str, Any]:
        """A copy of what was last written (or is about to be)."""
        return dict(self._record)

    def start(
        self,
        step: int,
        *,
        last_checkpoint: int | None = None,
        host: str | None = None,
        pids: Sequence[int] | None = None,
        **info: Any,
    ) -> None:
        """The run is (re)starting at ``step``; ``host`` defaults to this host, ``pids`` to
        this process. ``info`` (e.g. world_size) is kept in every later write."""
        if not self.is_writer:
            return
        now = time.time()
        self._record = {
            "state": RUNNING,
            "step": int(step),
            "last_checkpoint": last_checkpoint,
            "host": host or self._record["host"],
            "pids": [int(p) for p in pids] if pids is not None else self._record["pids"],
            "heartbeat": now,
            "started": now,
            **info,
        }
        self._write()

    def heartbeat(self, step: int, last_checkpoint: int | None = None) -> bool:
        """Record progress; returns whether ``status.json`` was written. A failed write
        warns (once) and training goes on."""
        if not self.is_writer:
            return False
        self._record["step"] = int(step)
        checkpoint_changed = (
            last_checkpoint is not None and last_checkpoint != self._record["last_checkpoint"]
        )
        if last_checkpoint is not None:
            self._record["last_checkpoint"] = int(last_checkpoint)
        if not checkpoint_changed and time.monotonic() - self._last_write < self.interval:
            return False
        self._record["heartbeat"] = time.time()
        try:
            self._write()
        except OSError as err:
            if not self._warned:
                warnings.warn(f"could not write {self.path}: {err}", stacklevel=2)
                self._warned = True
            return False
        return True

    def update(self, **info: Any) -> None:
        """Add ``info`` to the record (kept in every later write) and write now."""
        if not self.is_writer:
            return
        self._record.update(info)
        self._write()

    def finish(self, state: str = COMPLETE, summary: dict[str, Any] | None = None) -> None:
        """The run ends in ``state`` (complete, preempted, stopped, failed, ...); the
        ``summary`` keys (e.g. step, last_checkpoint, world_size) are added to the record."""
        if not self.is_writer:
            return
        now = time.time()
        record = {**self._record, **(summary or {})}
        record.update(state=state, heartbeat=now, finished=now)
        ordered = {k: record.pop(k) for k in ("state", "step", "last_checkpoint")}
        self._record = {**ordered, **record}
        self._write()

    def fail(self, error: str, rank: int = 0, **info: Any) -> bool:
        """The run failed on ``rank`` with ``error`` (one line): any rank may call this, so
        the first rank that fails names the cause. An earlier failure of this launch
        already on disk (another rank's, whose loss made this one fail) is kept, and False
        returned; else ``state: failed`` with ``error``, ``failed_rank`` and ``info`` (e.g.
        step, last_checkpoint) is written, and True returned. Never raises: the caller is
        on its way out."""
        try:
            current = read_status(self.path.parent) or {}
        except (StatusUnreadable, OSError):
            current = {}
        if current.get("state") == FAILED and current.get("finished", 0) >= self._created:
            return False
        # The writer's own record once it started; else (another rank, or a launch that
        # failed before it started) the record on disk, which rank 0 keeps current.
        base = self._record if "started" in self._record else {**self._record, **current}
        now = time.time()
        record = {**base, **info, "error": error, "failed_rank": int(rank)}
        record.update(state=FAILED, heartbeat=now, finished=now)
        ordered = {k: record.pop(k, None) for k in ("state", "step", "last_checkpoint")}
        self._record = {**ordered, **record}
        try:
            self._write()
        except OSError as err:
            print(f"could not write {self.path}: {err}", file=sys.stderr)
        return True

    def _write(self) -> None:
        atomic_write_json(self.path, self._record)
        self._last_write = time.monotonic()


# ----------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class RunState:
    """What a run is doing, for people (``text``) and scripts (``word``).

    ``word`` is one of ``pending`` (no status yet), ``running``, ``done``, ``preempted``,
    ``stopped`` (stopped early, or its processes are gone without a final status),
    ``stale`` (on another host, no heartbeat for too long), ``unreadable`` (a damaged
    ``status.json``), or a state word the loop wrote (e.g. ``failed``)."""

    word: str
    text: str
    step: int | None = None
    last_checkpoint: int | None = None
    host: str | None = None

    def __str__(self) -> str:
        return self.text


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def _checkpoint_text(last_checkpoint: int | None) -> str:
    if last_checkpoint is None:
        return "no checkpoint"
    return f"last checkpoint {last_checkpoint}"


def describe(
    run_dir: str | Path,
    *,
    stale_after: float = STALE_AFTER,
    now: float | None = None,
    host: str | None = None,
) -> RunState:
    """The state of the run in ``run_dir``. A ``running`` status is checked against its
    processes: on this host (``host``, default ``socket.gethostname()``) by their pids, on
    another host by the age of the heartbeat (older than ``stale_after`` seconds: stale)."""
    try:
        status = read_status(run_dir)
    except StatusUnreadable as err:
        return RunState(UNREADABLE, str(err))
    if status is None:
        return RunState("pending", "pending")
    state = status.get("state", "unknown")
    step = status.get("step")
    checkpoint = status.get("last_checkpoint")
    where = status.get("host")
    facts = {"step": step, "last_checkpoint": checkpoint, "host": where}
    if state == COMPLETE:
        if is_complete(run_dir):
            return RunState("done", f"done at step {step}", **facts)
        return RunState(
            STOPPED,
            f"stopped at step {step}: complete, but {final_dir(run_dir)} is missing",
            **facts,
        )
    if state != RUNNING:
        return RunState(state, f"{state} at step {step} ({_checkpoint_text(checkpoint)})", **facts)
    beat = status.get("heartbeat")
    age = None if beat is None else (time.time() if now is None else now) - beat
    if where is None or age is None:
        return RunState(RUNNING, f"running at step {step} (no heartbeat recorded)", **facts)
    if where == (host or socket.gethostname()):
        pids = status.get("pids") or []
        if not any(pid_alive(p) for p in pids):
            gone = ", ".join(str(p) for p in pids) or "none recorded"
            text = (
                f"stopped at step {step} ({_checkpoint_text(checkpoint)}): "
                f"process(es) {gone} ended without a final status"
            )
            return RunState(STOPPED, text, **facts)
        late = f", no heartbeat for {_ago(age)}" if age > stale_after else ""
        return RunState(RUNNING, f"running at step {step}{late}", **facts)
    if age > stale_after:
        text = f"stale: no heartbeat for {_ago(age)} ({_checkpoint_text(checkpoint)}; on {where})"
        return RunState("stale", text, **facts)
    return RunState(RUNNING, f"running at step {step} (on {where})", **facts)


def main(argv: list[str] | None = None) -> int:
    """``state RUN_DIR`` prints the state word, ``describe RUN_DIR`` the line for people."""
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.outputs", description=describe.__doc__
    )
    parser.add_argument("what", choices=("state", "describe"))
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--stale-after",
        type=float,
        default=STALE_AFTER,
        help="seconds without a heartbeat before a run on another host is stale",
    )
    args = parser.parse_args(argv)
    state = describe(args.run_dir, stale_after=args.stale_after)
    print(state.word if args.what == "state" else state.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
