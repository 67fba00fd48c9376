"""Counting the times a piece of work makes the host wait for the device.

A training step on a GPU should queue its kernels and go on; each ``.item()``, copy to the
host or index by a boolean mask stops the host until the GPU catches up. The count for one
step is the check that the fast path stays fast (``bench/gpu.py`` reports it, and the tests
hold it to what the step needs: a constant, not one per parameter).

- On CUDA, torch's sync debug mode warns at every operation that synchronises; the
  warnings are counted (torch's own caveat: collectives are not covered).
- On the CPU nothing waits, so the operations that would wait on a GPU are counted in a
  profiler trace instead: reading a scalar (``aten::_local_scalar_dense``: ``.item()``,
  ``float(t)``, ``bool(t)``) and ``aten::nonzero`` (boolean-mask indexing). Copies to the
  host (``.cpu()``, ``.tolist()``) are no operation on the CPU and go uncounted there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

CPU_SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
"""Operations that synchronise on a GPU, as the CPU profiler names them."""


def count_host_syncs(fn: Callable[[], T], device: torch.device | str) -> tuple[T, int]:
    """``fn()``'s result and the host synchronisations it made on ``device``."""
    result, sites = find_host_syncs(fn, device)
    return result, len(sites)


def find_host_syncs(fn: Callable[[], T], device: torch.device | str) -> tuple[T, list[str]]:
    """``fn()``'s result and one entry per host synchronisation it made on ``device``:
    on CUDA the Python line that made it (``file:line``), on the CPU the operation."""
    if torch.device(device).type == "cuda":
        return _find_on_cuda(fn)
    return _find_on_cpu(fn)


def _find_on_cuda(fn: Callable[[], T]) -> tuple[T, list[str]]:
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return result, [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


def _find_on_cpu(fn: Callable[[], T]) -> tuple[T, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        result = fn()
    return result, [
        event.key
        for event in trace.key_averages()
        if event.key in CPU_SYNC_OPS
        for _ in range(event.count)
    ]
