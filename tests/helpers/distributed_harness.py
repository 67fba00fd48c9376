"""Run a function on N real gloo processes and collect what each rank returns.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, joins them in a gloo
group, calls ``fn(comm, *args)`` with a :class:`Communicator` for that group, and returns
the list of results, rank by rank. ``world_size == 1`` calls ``fn`` in this process with a
world-of-one communicator (no process group), the path single-process runs take.
``fn`` must be a module-level function (it is pickled by name). The ranks start from a fork
server that has imported torch and the project (:data:`PRELOAD`), not as fresh
interpreters, so they see the environment the fork server started with;
``start_method="spawn"`` starts fresh interpreters that read this process's environment
as it is now (the golden trajectories pin the instruction set that way).

``device`` (default CPU) is the communicator's device: ``fn`` puts its tensors on
``comm.device``. With ``device="cuda:0"`` every rank shares the one GPU; gloo carries
CUDA tensors for all-reduce, all-to-all, all-gather and broadcast, where NCCL would refuse
two ranks on one device.

Naming ``backend`` always builds a process group, of one rank too (its collectives then
really run instead of returning at once): ``"gloo"``, or ``"nccl"``, where each rank
takes its own GPU (``cuda:<rank>``) whatever ``device`` says.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onebit_bert.distributed import Communicator

TIMEOUT_S = 120
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "transformers",
    "onebit_bert.strategies",
    "pretrain.train",
    "tests.helpers.runs",
    "tests.helpers.toy",
]
"""Imported once by the fork server, so that each rank starts as a fork of a process that
has them (about 0.1 s) instead of importing them anew (several seconds per spawn)."""
mp.set_forkserver_preload(PRELOAD)


def _entry(rank, world_size, store_path, out_dir, device, fn, args, backend="gloo"):
    torch.set_num_threads(1)  # 4 ranks on 2 cores: avoid oversubscribing the thread pools
    device_id = None
    if backend == "nccl":
        device = device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
        device_id=device_id,
    )
    try:
        result = fn(Communicator(dist.group.WORLD, device=device), *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(
    fn,
    world_size: int,
    *args,
    device: str = "cpu",
    backend: str | None = None,
    start_method: str = "forkserver",
):
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"{world_size} NCCL ranks need {world_size} GPUs; {torch.cuda.device_count()} found"
        )
    if world_size == 1 and backend is None:
        return [fn(Communicator(None, device=device), *args)]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _entry,
            args=(world_size, store, tmp, device, fn, args, backend or "gloo"),
            nprocs=world_size,
            join=True,
            start_method=start_method,
        )
        return [
            torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
