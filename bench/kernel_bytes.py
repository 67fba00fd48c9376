"""The bytes the fused optimizer kernels read and write per parameter, counted in Triton's
interpreter, beside the model of them and the floor.

A GPU is not needed for this figure: in the interpreter (``TRITON_INTERPRET=1``) every
load and store a kernel issues passes through one function, and :func:`counting` adds up
the elements each one touches (its mask) times their size, per kernel. That is the
traffic the kernels ask of memory if no cache keeps anything between two accesses: an
upper bound on what a GPU's memory moves for them, and with the bandwidth the time they
cannot beat. Scalars and pointer tables count as well (a few bytes per block of 2,048
elements).

For LAMB's and 1-bit LAMB's steps (the compression stage; at one rank the worker's and
the server's halves of the 1-bit all-reduce both run on every element, on ``--world-size``
gloo ranks the server's on each rank's 1/W of them), with the fused kernels, on
``--model``'s parameters with fixed random gradients, this counts the kernels of one step
after the stage switch, and prints as JSON: bytes per parameter by kernel and in all,
the model of ``docs/results/2026-11-28-fused-kernels-cpu.md`` (40 and about 96 bytes) and
the floor of ``bench/yardstick.py`` (28 and 56.5).

The torch operations around the kernels are not counted; ``outside_kernels`` lists those
that touch at least 1 % as many elements as there are parameters (views and allocations
aside), so that what the count leaves out is seen. The network, on several ranks, is not
here either. Slow (the interpreter runs each program in Python): about a minute for
bert-tiny's parameters on 2 cores.

    python -m bench.kernel_bytes [--model bert-tiny] [--vocab-size 1000] [--world-size 1]
                                 [--separate-passes] [--overlap] [--refresh]

Runs itself again in a child process with ``TRITON_INTERPRET=1`` when the interpreter is
not on (Triton fixes its mode when it is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file: make bench importable
    sys.path.insert(0, str(REPO))

KERNEL_RANGE = "interpreted kernel"
NO_TRAFFIC = {
    "aten::" + name
    for name in [
        "slice",
        "view",
        "view_as",
        "reshape",
        "select",
        "as_strided",
        "expand",
        "unsqueeze",
        "squeeze",
        "t",
        "transpose",
        "narrow",
        "alias",
        "detach",
        "empty",
        "empty_like",
        "new_empty",
        "empty_strided",
    ]
}
"""torch operations that move no data (views, allocations)."""
OPTIMIZERS = ("lamb", "onebit_lamb")
MODELLED = {"lamb": 40.0, "onebit_lamb": 96.0}
"""Bytes per parameter of the fused step, counted from the code before this measurement
(``docs/results/2026-11-28-fused-kernels-cpu.md``)."""


@contextlib.contextmanager
def counting():
    """Within the block, every interpreted kernel's loads and stores are counted: yields a
    dict ``kernel name -> {"read": bytes, "written": bytes, "launches": n}``. An address
    several elements of one load or store share (a byte of packed signs read for each of
    its 8 elements, a scale for each of its rows) counts once: the memory serves one
    access of a program once."""
    import numpy as np
    import torch
    from triton.runtime import interpreter

    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    load, store, call = builder.create_masked_load, builder.create_masked_store, executor.__call__
    counts: dict = defaultdict(lambda: {"read": 0, "written": 0, "launches": 0})
    current = ["?"]

    def touched(ptrs, mask) -> int:
        return int(np.unique(ptrs.data[mask.data.astype(bool)]).size)

    def counted_load(self, ptrs, mask, other, cache_policy, is_volatile):
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        counts[current[0]]["read"] += touched(ptrs, mask) * size
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def counted_store(self, ptrs, value, mask, cache_policy):
        size = value.data.dtype.itemsize
        counts[current[0]]["written"] += touched(ptrs, mask) * size
        return store(self, ptrs, value, mask, cache_policy)

    def named_call(self, *args, **kwargs):
        current[0] = self.fn.__name__
        counts[current[0]]["launches"] += 1
        with torch.profiler.record_function(KERNEL_RANGE):  # its copies are the interpreter's
            return call(self, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    executor.__call__ = named_call
    try:
        yield counts
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        executor.__call__ = call


def step_bytes(
    name: str,
    model: str,
    vocab_size: int,
    comm=None,
    separate_passes: bool = False,
    overlap: bool = False,
    refresh: bool = False,
) -> dict:
    """One fused step of optimizer ``name`` on ``model``'s parameters, counted (on this
    rank of ``comm``'s group; default: one rank). ``separate_passes``: 1-bit LAMB with
    its fold and the expansion in passes of their own
    (:attr:`~onebit_bert.optim.OneBitLamb.expand_in_update` off). ``overlap``: 1-bit
    LAMB's step overlapped with the backward pass (``comm.overlap``), each gradient handed
    over as its hook would, last parameter first. ``refresh``: 1-bit LAMB's counted step
    refreshes its coefficients (``coeff_refresh``: the momentum averaged exactly, outside
    the kernels)."""
    import torch

    from bench.yardstick import optimizer_bytes_per_parameter, optimizer_on_preset

    torch.manual_seed(0)
    opt, params = optimizer_on_preset(name, model, vocab_size, "cpu", comm)
    opt.set_kernels("fused")
    if separate_passes:
        opt.expand_in_update = False
    if refresh and hasattr(opt, "coeff_refresh"):
        opt.coeff_refresh = opt.coeff_refresh_max = 1  # every compression step refreshes
    world_size = comm.world_size if comm is not None else 1
    for _ in range(2):  # the warmup stage's step, then the first compressing one
        opt.step()
    overlapped = overlap and hasattr(opt, "enable_overlap")
    if overlapped:
        opt.enable_overlap(opt.comm.side_channel())
    with counting() as counts, torch.profiler.profile(record_shapes=True) as prof:
        if overlapped:
            if not opt.begin_overlap():
                raise RuntimeError("the counted step did not overlap")
            for p in reversed([p for group in opt.param_groups for p in group["params"]]):
                opt._on_grad_ready(p)  # what each parameter's post-accumulate hook does
        opt.step()
    kernels = {
        kernel: {
            "launches": c["launches"],
            "bytes_per_parameter": round((c["read"] + c["written"]) / params, 2),
            "read_per_parameter": round(c["read"] / params, 2),
            "written_per_parameter": round(c["written"] / params, 2),
        }
        for kernel, c in sorted(counts.items())
    }
    total = sum(c["read"] + c["written"] for c in counts.values()) / params
    floor = optimizer_bytes_per_parameter(name, world_size)
    return {
        "optimizer": name,
        "world_size": world_size,
        "stage": getattr(opt, "stage", None),
        "kernels_path": getattr(opt, "last_step_kernels", "fused"),
        "overlapped": overlapped,
        "refreshed": getattr(opt, "last_refreshed", False),
        "params": params,
        "kernels": kernels,
        "bytes_per_parameter": round(total, 2),
        # the model of 2026-11-28 is for one rank and the separate passes
        "modelled_bytes_per_parameter": (
            MODELLED[name] if world_size == 1 and (separate_passes or name == "lamb") else None
        ),
        "floor_bytes_per_parameter": floor,
        "over_floor": round(total / floor, 3),
        "outside_kernels": outside_kernels(prof.events(), params // 100),
    }


def outside_kernels(events, least: int) -> list[dict]:
    """The torch operations of the step that run outside the kernels and touch at least
    ``least`` elements (their largest input), views and allocations left out: what the
    count above does not see. The interpreter's own copies of a kernel's arguments are
    inside :data:`KERNEL_RANGE` and left out too."""
    found: dict = defaultdict(int)
    for e in events:
        if not e.name.startswith("aten::") or e.name in NO_TRAFFIC:
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None and not inside:
            inside = parent.name == KERNEL_RANGE or parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if inside:
            continue
        # a foreach operation records no shapes for its tensor list on the CPU, where it
        # runs as one operation per tensor: those count for it
        parts = sum(_largest(c) for c in e.cpu_children if c.name.startswith("aten::"))
        elements = max(_largest(e), parts)
        if elements >= least:
            found[e.name, elements] += 1
    return [{"op": op, "elements": n, "calls": c} for (op, n), c in sorted(found.items())]


def _largest(event) -> int:
    """The elements of an event's largest recorded input."""
    return max((_numel(shape) for shape in event.input_shapes or []), default=0)


def _numel(shape) -> int:
    """Elements of one recorded input: a tensor's shape, or a list of tensors' shapes (a
    foreach operation's) summed; 0 for a scalar or a non-tensor."""
    if not shape:
        return 0
    if all(isinstance(size, int) for size in shape):
        return math.prod(shape)
    if all(isinstance(item, list) for item in shape):
        return sum(_numel(item) for item in shape)
    return 0


def _rank_main(rank, world_size, store, out_path, model, vocab_size, variant):
    """One gloo rank of ``--world-size``: both steps counted here (``variant``:
    :func:`step_bytes`'s switches); rank 0 saves its rows (every rank does the same share
    of the work)."""
    import torch
    import torch.distributed as dist

    from bench.common import init_gloo
    from onebit_bert.distributed.comm import Communicator

    torch.set_num_threads(1)
    init_gloo(rank, world_size, store)
    try:
        comm = Communicator(dist.group.WORLD)
        rows = [step_bytes(name, model, vocab_size, comm, **variant) for name in OPTIMIZERS]
        if rank == 0:
            torch.save(rows, out_path)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel_bytes", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="bert-tiny", help="the parameters' preset")
    parser.add_argument(
        "--vocab-size", type=int, default=1000, help="embedding rows (default: 1000)"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="gloo ranks the 1-bit all-reduce spans; the counts are one rank's (default: 1)",
    )
    parser.add_argument(
        "--separate-passes",
        action="store_true",
        help="1-bit LAMB's fold and expansion in passes of their own (before they were "
        "folded into the worker's first pass and the update)",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="1-bit LAMB's step overlapped with the backward pass (comm.overlap), the "
        "gradients handed over one by one as their hooks would",
    )
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="1-bit LAMB's counted step refreshes its coefficients (optimizer.coeff_refresh; "
        "the exact average runs outside the kernels)",
    )
    args = parser.parse_args(argv)
    if args.refresh and args.overlap:
        parser.error("--refresh and --overlap: a refresh step does not overlap")
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    from onebit_bert.kernels import interpreter_problem, interpreting, triton_available

    if not triton_available():
        parser.error("needs Triton (pip install '.[gpu]')")
    if interpreter_problem() is not None:
        parser.error(interpreter_problem())
    if not interpreting():
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
        command = [sys.executable, "-m", "bench.kernel_bytes", *(argv or sys.argv[1:])]
        return subprocess.run(command, cwd=REPO, env=env).returncode
    variant = dict(separate_passes=args.separate_passes, overlap=args.overlap, refresh=args.refresh)
    if args.world_size > 1:
        from bench.common import run_gloo_ranks

        rows = run_gloo_ranks(_rank_main, args.world_size, args.model, args.vocab_size, variant)
    else:
        rows = [step_bytes(name, args.model, args.vocab_size, **variant) for name in OPTIMIZERS]
    print(json.dumps({"benchmark": "kernel_bytes", "model": args.model, "steps": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
