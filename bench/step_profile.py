"""Where a training step's time goes: a few steps under ``torch.profiler``, by category.

:func:`profile_steps` sums what the profiler recorded:

- on CUDA (``source: "cuda kernels"``): the GPU time of every kernel, copy and memset;
- on the CPU (``source: "cpu ops, self time"``): each operation's self time on the host
  (its time less that of the operations it called), so that nested operations count once.
  torch's ``record_function`` ranges (``Optimizer.step#...``, ``ProfilerStep#...``) are
  not operations and are left out; their own time is Python's.

The figures, in ms per step:

- ``wall_ms_per_step``: the host's clock around the profiled steps, the device
  synchronised before and after them;
- ``busy_ms_per_step``: the sum of the categories but ``idle``;
- ``categories``: ``gemm``, ``attention``, ``communication`` and ``other`` by name
  (:data:`CATEGORIES`); ``optimizer``: the work inside torch's ``Optimizer.step#...``
  ranges, whatever its name (every torch optimizer's ``step`` runs in one); ``idle``: wall
  less busy, at least 0. On CUDA idle is the GPU waiting for the host (Python, launches,
  host syncs); on the CPU it is mostly the profiler's own overhead and Python between
  operations;
- ``shares``: each category over the wall time;
- ``top``: the largest kernels (operations on the CPU) by time, with their calls.

The optimizer's share on CUDA is the kernels launched from inside its step: those whose
launch call (``cudaLaunchKernel``, ``cuLaunchKernel``) the host made inside the range, or
that are linked to an operation nested in it (on torch builds whose events lack the
activity type and the link, both added in 2026, by the launch calls' names and times
alone). The launch time is the one that finds the
fused Triton kernels, which launch outside any aten operation and so have no linked one.
On the CPU it is the self time of the operations nested in the step. Those kernels and
operations count under ``optimizer`` only, so a collective the optimizer makes itself
(1-bit LAMB's exchange) is there, not under ``communication``.

Caveats: kernels on several CUDA streams can run at the same time, so busy can exceed the
GPU's wall time (idle then reads 0); the profiler lengthens every operation on the host,
which slows a host-bound step. Names decide the other categories: attention is its fused
kernels' time, so where torch falls back to its math path for attention (the CPU, with
dropout) those products count as gemm and the softmax as other. The CPU figures measure
the host's operations: nothing about a GPU.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # flash and memory-efficient attention (fmha_cutlass*), cuDNN's (*_sdpa_*), the aten ops
    (
        "attention",
        ("flash", "fmha", "sdpa", "scaled_dot_product", "efficient_attention", "flex_attention"),
    ),
    # cuBLAS (sm90_xmma_gemm_*, ampere_*gemm*, nvjet_* on Hopper), CUTLASS kernels (not
    # kernels that merely take a CUTLASS type), the matrix-product aten ops by exact name
    # (Inductor names a bias-and-activation kernel triton_poi_fused_addmm_*: elementwise)
    (
        "gemm",
        (
            "gemm",
            "gemv",
            "xmma",
            "nvjet",
            "cublas",
            r"^(void )?cutlass",
            r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_addmm_activation)$",
        ),
    ),
    # NCCL kernels and ranges, gloo, c10d's ops; broadcast but aten's shape ops
    (
        "communication",
        (
            "nccl",
            "gloo",
            "c10d",
            "all_?reduce",
            "all_?gather",
            "reduce_?scatter",
            "all_?to_?all",
            r"^(?!aten::).*broadcast",
        ),
    ),
)
"""Kernel and operation names by category: regular expressions searched in the name,
ignoring case, the categories tried in this order (attention before gemm: PyTorch's
memory-efficient attention kernels are CUTLASS ones). A name no pattern finds is ``other``."""

_MATCHERS = [(name, re.compile("|".join(patterns), re.I)) for name, patterns in CATEGORIES]
OPTIMIZER_RANGE = "Optimizer.step#"  # torch names its ranges Optimizer.step#<Class>.step
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the host-side calls, kineto's activity types
LAUNCH_NAME = re.compile(r"^cu\w*Launch")
BUSY = ("gemm", "attention", "communication", "optimizer", "other")
TOP = 12


def classify(name: str) -> str:
    """The category of a kernel or operation name (:data:`CATEGORIES`), else ``other``."""
    for category, pattern in _MATCHERS:
        if pattern.search(name):
            return category
    return "other"


def profile_steps(step: Callable[[int], object], steps: int, cuda: bool) -> dict:
    """``step(i)`` for ``i`` in ``range(steps)`` under the profiler (CPU, and CUDA when
    ``cuda``), and where their time went (the module docstring): a JSON-able dict."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize = torch.cuda.synchronize if cuda else lambda: None
    with profile(activities=activities) as prof:
        synchronize()
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        synchronize()
        wall_ms = (time.perf_counter() - start) * 1000 / steps
    events = prof.events()
    work = device_work(events) if cuda else host_work(events)
    source = "cuda kernels" if cuda else "cpu ops, self time"
    return summarise(work, wall_ms, steps, source)


def _optimizer_ranges(events) -> list:
    """torch's optimizer step ranges on the host (not their spans on the GPU)."""
    from torch.autograd import DeviceType

    return [
        e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(OPTIMIZER_RANGE)
    ]


def _optimizer_events(events) -> list:
    """The host events inside torch's optimizer step ranges (the ranges included)."""
    found, stack = [], _optimizer_ranges(events)
    while stack:
        event = stack.pop()
        found.append(event)
        stack.extend(event.cpu_children)
    return found


def host_work(events) -> list[tuple[str, str, float]]:
    """``(name, category, microseconds)`` of every host operation: its self time."""
    from torch.autograd import DeviceType

    in_optimizer = {id(e) for e in _optimizer_events(events)}
    work = []
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async or e.is_user_annotation:
            continue
        category = "optimizer" if id(e) in in_optimizer else classify(e.name)
        work.append((e.name, category, e.self_cpu_time_total))
    return work


def _activity(event) -> str | None:
    """Kineto's activity type of ``event`` (``cpu_op``, ``cuda_runtime``, ``kernel``, ...).
    On torch builds from before ``FunctionEvent.activity_type`` existed, a host event
    named like a launch call (``cudaLaunchKernel``, ``cuLaunchKernel``,
    ``cudaGraphLaunch``) is ``cuda_runtime``, another host event ``cpu_op``."""
    from torch.autograd import DeviceType

    kind = getattr(event, "activity_type", None)
    if kind is not None or event.device_type != DeviceType.CPU:
        return kind
    return "cuda_runtime" if LAUNCH_NAME.match(event.name) else "cpu_op"


def device_work(events) -> list[tuple[str, str, float]]:
    """``(name, category, microseconds)`` of every kernel, copy and memset on the GPU
    (torch's GPU-side spans of ``record_function`` ranges left out: they cover kernels)."""
    from torch.autograd import DeviceType

    ranges = [e.time_range for e in _optimizer_ranges(events)]
    nested_ops = {
        e.id
        for e in _optimizer_events(events)
        if _activity(e) == "cpu_op" and not e.is_user_annotation
    }
    # a launch call's id is its kernel's (CUPTI's correlation id); ops have ids of their own
    launched_inside = {
        e.id
        for e in events
        if _activity(e) in LAUNCHES and any(r.start <= e.time_range.start <= r.end for r in ranges)
    }
    annotations = {
        e.name for e in events if e.device_type == DeviceType.CPU and e.is_user_annotation
    }
    work = []
    for e in events:
        if e.device_type != DeviceType.CUDA or e.is_user_annotation or e.name in annotations:
            continue
        linked = getattr(e, "linked_correlation_id", 0)
        optimizer = e.id in launched_inside or linked in nested_ops
        category = "optimizer" if optimizer else classify(e.name)
        work.append((e.name, category, e.time_range.elapsed_us()))
    return work


def _significant(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits}g}")


def summarise(work: list[tuple[str, str, float]], wall_ms: float, steps: int, source: str):
    """The profile's figures (the module docstring) from ``(name, category, microseconds)``
    entries over ``steps`` steps of ``wall_ms`` each."""
    busy = dict.fromkeys(BUSY, 0.0)
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for name, category, microseconds in work:
        busy[category] += microseconds / 1000 / steps
        totals = by_name[name, category]
        totals[0] += microseconds
        totals[1] += 1
    busy_ms = sum(busy.values())
    categories = {**busy, "idle": max(0.0, wall_ms - busy_ms)}
    top = sorted(by_name.items(), key=lambda item: item[1][0], reverse=True)[:TOP]
    return {
        "steps": steps,
        "source": source,
        "wall_ms_per_step": _significant(wall_ms),
        "busy_ms_per_step": _significant(busy_ms),
        "categories": {name: _significant(ms) for name, ms in categories.items()},
        "shares": {name: _significant(ms / wall_ms, 3) for name, ms in categories.items()},
        "top": [
            {
                "name": name[:120],
                "category": category,
                "ms_per_step": _significant(microseconds / 1000 / steps),
                "calls_per_step": _significant(calls / steps),
            }
            for (name, category), (microseconds, calls) in top
        ],
    }
