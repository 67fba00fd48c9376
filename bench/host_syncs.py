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

import os
import traceback
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


def sites_by_count(sites: list[str]) -> dict[str, int]:
    """``sites`` (:func:`find_host_syncs`) counted, most frequent first, with paths inside
    this repository made relative to it."""
    from collections import Counter
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent) + os.sep
    counts = Counter(site.replace(root, "") for site in sites)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


_primed = False


def _prime_sync_debug_mode() -> None:
    """Switch the sync debug mode on and off once, discarding what it reports: its first
    switch in a process reports one sync inside torch itself, even around no work at all
    (measured with torch 2.11 on an H100), which would count against the first step."""
    global _primed
    if _primed:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.set_sync_debug_mode(previous)
    _primed = True


def _find_on_cuda(fn: Callable[[], T]) -> tuple[T, list[str]]:
    _prime_sync_debug_mode()
    previous = torch.cuda.get_sync_debug_mode()
    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites.append(_site(filename, lineno))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return result, sites


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP = {__file__, warnings.__file__}


def _site(filename: str, lineno: int) -> str:
    """``file:line`` of a sync; when that line is inside torch, also the innermost caller
    outside it (``ours:line via torch/...:line``), which is the line to change."""
    where = f"{filename}:{lineno}"
    if not filename.startswith(_TORCH_DIR):
        return where
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename not in _SKIP:
            return f"{frame.filename}:{frame.lineno} via {where}"
    return where


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
