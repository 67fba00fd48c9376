"""Seconds on the device's own clock.

On a GPU, work is queued and the host goes on: ``time.perf_counter()`` around a kernel or
an NCCL collective measures its launch, not its run. There, phases and collectives are
timed with CUDA events recorded on the current stream, and the seconds are read once the
step has waited for the device anyway (the training step's statistics copy), so timing
adds no wait of its own. On the CPU the host's clock is the device's.

- :class:`DeviceClock` marks points of a step and gives the seconds between two marks;
- :data:`PENDING` holds the event pairs of collectives whose seconds are not known yet;
  :func:`resolve_pending` adds them to the statistics they belong to.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

CUDA_EVENTS = "cuda_events"
PERF_COUNTER = "perf_counter"


def uses_events(device: torch.device | str) -> bool:
    """Whether work on ``device`` is timed with CUDA events (else the host's clock)."""
    return torch.device(device).type == "cuda"


class DeviceClock:
    """Marks on ``device``'s clock: a CUDA event on the current stream, or the host's
    ``perf_counter``. :meth:`seconds` between two marks needs both to have completed (on
    CUDA: call it after the host has waited for the device)."""

    def __init__(self, device: torch.device | str):
        self.events = uses_events(device)
        self.name = CUDA_EVENTS if self.events else PERF_COUNTER

    def mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.events:
            return end - start
        if not end.query():  # not expected after the step's wait; never read a pending event
            end.synchronize()
        return start.elapsed_time(end) / 1000


class PendingTimings:
    """Event pairs (start, end) of collectives, each with the statistics object and kind
    of traffic its seconds go to (``stats.add_seconds(kind, seconds)``).

    Code that never resolves them (a user's own loop) does not make the list grow without
    bound: past ``limit`` pairs, the finished ones at its head are filed into their
    statistics (checked with ``query()``, which never waits)."""

    def __init__(self, limit: int = 4096):
        self._pairs: list[tuple[object, str, torch.cuda.Event, torch.cuda.Event]] = []
        self.limit = limit

    def __len__(self) -> int:
        return len(self._pairs)

    def add(self, stats, kind: str, start, end) -> None:
        self._pairs.append((stats, kind, start, end))
        if len(self._pairs) > self.limit:
            self._file_finished_head()

    def _file_finished_head(self) -> None:
        done = 0
        for stats, kind, start, end in self._pairs:
            if not end.query():
                break
            stats.add_seconds(kind, start.elapsed_time(end) / 1000)
            done += 1
        del self._pairs[:done]

    def resolve(self, since: int = 0, upto: int | None = None) -> dict[int, dict[str, float]]:
        """Add every pending pair's seconds to its statistics and forget them; returns the
        seconds of pairs ``since`` to ``upto`` (positions in the pending list; default:
        all) per ``id(stats)`` and kind."""
        clock = DeviceClock("cuda") if self._pairs else None
        chosen: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for i, (stats, kind, start, end) in enumerate(self._pairs):
            seconds = clock.seconds(start, end)
            stats.add_seconds(kind, seconds)
            if i >= since and (upto is None or i < upto):
                chosen[id(stats)][kind] += seconds
        self._pairs.clear()
        return {key: dict(kinds) for key, kinds in chosen.items()}


PENDING = PendingTimings()
"""The process's pending collective timings (every communicator files its CUDA ones here)."""


def resolve_pending(since: int = 0, upto: int | None = None) -> dict[int, dict[str, float]]:
    """:meth:`PendingTimings.resolve` on :data:`PENDING`."""
    return PENDING.resolve(since, upto)
