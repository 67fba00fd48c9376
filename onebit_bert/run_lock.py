"""One writer per run directory: ``run.lock`` names the launch that writes there.

Rank 0 takes the lock before anything is written (:meth:`RunLock.acquire`) and refreshes
its heartbeat while it trains (data_prep holds its output's lock with
:func:`holding_lock`); a second launch on the same run directory stops with
:class:`RunLocked`, which names the holder. A lock is taken over, not obeyed, when its
holder is certainly gone:

- on this host, none of its processes is alive (a crash, a kill, torchrun's restart);
- it was held by this same SLURM job (``SLURM_JOB_ID``): a requeued job comes back under
  its own id while nothing of the old allocation may write any more;
- its heartbeat is older than ``stale_after`` seconds (a holder on another host that
  stopped beating: a dead node).
- this very process holds it (an earlier run in the same process that never released it).

The file is JSON (``host``, ``pids``, ``job_id``, ``started``, ``heartbeat``, ``token``),
written atomically; two launches that take over the same stale lock at once are told
apart by re-reading the token after the write, and the one that lost stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onebit_bert.io import atomic_write_json, read_json_object

LOCK_FILE = "run.lock"
STALE_AFTER = 600.0
"""Seconds without a heartbeat after which a holder on another host counts as gone."""
HEARTBEAT_INTERVAL = 30.0
"""Seconds between two heartbeat writes."""


class RunLocked(RuntimeError):
    """Another live launch writes this run directory; the message names it and the way out."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux), or it ended just now: trust kill()
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or None


def read_lock(run_dir: str | Path) -> dict[str, Any] | None:
    """The lock's record; None when there is none; ``{}`` when it is damaged."""
    try:
        return read_json_object(Path(run_dir) / LOCK_FILE, missing=None)
    except ValueError:
        return {}


def holder_gone(
    record: dict[str, Any],
    stale_after: float = STALE_AFTER,
    now: float | None = None,
    host: str | None = None,
    job_id: str | None = None,
) -> str | None:
    """Why the holder of ``record`` is certainly gone, or None while it may be alive."""
    if not record:
        return "the lock file is damaged"
    now = time.time() if now is None else now
    host = host or socket.gethostname()
    job_id = _job_id() if job_id is None else job_id
    if job_id and record.get("job_id") == job_id:
        return f"it was held by this SLURM job ({job_id}) before a requeue"
    if record.get("host") == host:
        pids = [int(p) for p in record.get("pids") or []]
        if pids == [os.getpid()]:
            return "this process held it (an earlier run in it did not release it)"
        if not any(pid_alive(p) for p in pids):
            return f"its process(es) {', '.join(map(str, pids)) or '(none)'} ended on {host}"
        return None
    beat = record.get("heartbeat")
    if beat is None or now - float(beat) > stale_after:
        return f"its heartbeat is older than {stale_after:.0f} s"
    return None


def describe_holder(record: dict[str, Any], now: float | None = None) -> str:
    """``host vm, pid 123, SLURM job 45, heartbeat 3 s ago``."""
    now = time.time() if now is None else now
    parts = [f"host {record.get('host', '?')}"]
    pids = record.get("pids") or []
    parts.append(f"pid {', '.join(map(str, pids))}" if pids else "no pid recorded")
    if record.get("job_id"):
        parts.append(f"SLURM job {record['job_id']}")
    if record.get("heartbeat") is not None:
        parts.append(f"heartbeat {max(0.0, now - float(record['heartbeat'])):.0f} s ago")
    return ", ".join(parts)


class RunLock:
    """The lock of one run directory, held by this process (rank 0).

    ::

        lock = RunLock(run_dir)
        lock.acquire()         # RunLocked if another live launch holds it
        ... lock.heartbeat()   # every step; writes every HEARTBEAT_INTERVAL seconds
        lock.release()
    """

    def __init__(
        self,
        run_dir: str | Path,
        stale_after: float = STALE_AFTER,
        interval: float = HEARTBEAT_INTERVAL,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.stale_after = stale_after
        self.interval = interval
        self.token = uuid.uuid4().hex
        self.held = False
        self.took_over: str | None = None
        """Why an earlier holder's lock was taken over (None: there was none)."""
        self._last_write = -float("inf")

    def _record(self) -> dict[str, Any]:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pids": [os.getpid()],
            "job_id": _job_id(),
            "started": now,
            "heartbeat": now,
            "token": self.token,
        }

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunLocked` naming its live holder."""
        record = self._record()
        for _ in range(3):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileNotFoundError:  # a releasing launch removed the empty folders: again
                continue
            except FileExistsError:
                holder = read_lock(self.run_dir)
                if holder is None:  # released between our open and our read: try again
                    continue
                self._take_over(holder, record)
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(record, indent=2) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            break
        else:
            raise RunLocked(f"{self.run_dir}: another launch took the run lock just now")
        self.held = True
        self._held_record = record
        self._last_write = time.monotonic()

    def _take_over(self, holder: dict[str, Any], record: dict[str, Any]) -> None:
        why = holder_gone(holder, self.stale_after)
        if why is None:
            raise RunLocked(
                f"{self.run_dir} is being written by another launch ({describe_holder(holder)}; "
                f"{self.path}). Stop that job or wait for it to end; its lock is taken over "
                f"automatically once its processes are gone on its host, its heartbeat is "
                f"older than {self.stale_after:.0f} s, or by the same SLURM job after a "
                f"requeue. Remove the file by hand only when no job writes there"
            )
        atomic_write_json(self.path, record)
        current = read_lock(self.run_dir) or {}
        if current.get("token") != self.token:
            raise RunLocked(
                f"{self.run_dir}: another launch took over the stale run lock at the same "
                f"time ({describe_holder(current)})"
            )
        self.took_over = f"{describe_holder(holder)}: {why}"

    def heartbeat(self) -> bool:
        """Refresh the heartbeat when ``interval`` seconds have passed; returns whether it
        wrote. Refuses to go on if another launch took the lock over meanwhile."""
        if not self.held or time.monotonic() - self._last_write < self.interval:
            return False
        current = read_lock(self.run_dir)
        if current and current.get("token") != self.token:
            self.held = False
            raise RunLocked(
                f"{self.run_dir}: the run lock was taken over by another launch "
                f"({describe_holder(current)}); this one stops writing"
            )
        self._held_record["heartbeat"] = time.time()
        try:
            atomic_write_json(self.path, self._held_record)
        except OSError:
            return False
        self._last_write = time.monotonic()
        return True

    def release(self) -> None:
        """Remove the lock if this process still holds it."""
        if not self.held:
            return
        self.held = False
        current = read_lock(self.run_dir)
        if current is not None and current.get("token") == self.token:
            self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def holding_lock(run_dir: str | Path, interval: float = HEARTBEAT_INTERVAL) -> Iterator[RunLock]:
    """The lock of ``run_dir`` for the ``with`` block (:class:`RunLocked` if another live
    launch holds it), its heartbeat refreshed by a thread: for work that has no loop of its
    own to call :meth:`RunLock.heartbeat` from (data_prep's worker pool)."""
    lock = RunLock(run_dir, interval=interval)
    lock.acquire()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval / 2):
            try:
                lock.heartbeat()
            except RunLocked:  # taken over: the holder's next write will not be ours
                return

    thread = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield lock
    finally:
        stop.set()
        thread.join()
        lock.release()
