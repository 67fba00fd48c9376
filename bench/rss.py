"""Peak resident memory of this process and all its descendants, sampled from ``/proc``.

``PeakRSS`` is a context manager: a daemon thread sums the resident set size of the current
process and every live descendant (children, grandchildren, ... found by walking the parent
pids in ``/proc/*/stat``) every ``interval`` seconds, plus one sample at enter and one at
exit, and keeps the largest sum seen::

    with PeakRSS() as rss:
        work()
    print(rss.peak_mb)

Caveats: pages shared between processes (e.g. copy-on-write memory of forked workers, shared
libraries) are counted once per process, so the sum overstates the physical memory in use;
anything shorter-lived than the sampling interval can be missed. Linux only; no psutil.
"""

from __future__ import annotations

import os
import threading

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_MB = 1 << 20


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process readable in ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # vanished (or not ours to read) between listdir and open
            continue
        # Fields after the command name, which is in parentheses and may itself contain
        # spaces or ')': state, ppid, ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def _rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 if it has gone or is a zombie)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss_bytes(root: int | None = None) -> int:
    """Summed RSS in bytes of ``root`` (default: this process) and all its descendants."""
    root = os.getpid() if root is None else root
    children = _children_map()
    total, stack, seen = 0, [root], set()
    while stack:
        pid = stack.pop()
        if pid in seen:  # pids can be reused mid-walk; never loop
            continue
        seen.add(pid)
        total += _rss_bytes(pid)
        stack.extend(children.get(pid, ()))
    return total


class PeakRSS:
    """Context manager recording the peak summed RSS of this process tree.

    Attributes (valid after ``__exit__``; ``peak_mb`` is also updated live):
        peak_mb: largest summed RSS seen, in MiB.
        start_mb: summed RSS at enter, in MiB.
        samples: number of samples taken.
    """

    def __init__(self, interval: float = 0.05, pid: int | None = None):
        self.interval = interval
        self.pid = os.getpid() if pid is None else pid
        self.peak_mb = 0.0
        self.start_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> float:
        """Take one sample now, update the peak, and return this sample in MiB."""
        mb = tree_rss_bytes(self.pid) / _MB
        self.samples += 1
        if mb > self.peak_mb:
            self.peak_mb = mb
        return mb

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PeakRSS:
        self._stop.clear()
        self.peak_mb = 0.0
        self.samples = 0
        self.start_mb = self.sample()
        self._thread = threading.Thread(target=self._run, name="PeakRSS", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()
