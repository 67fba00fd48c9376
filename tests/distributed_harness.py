"""Run a function on N real gloo processes and collect what each rank returns.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, joins them in a gloo
group, calls ``fn(comm, *args)`` with a :class:`Communicator` for that group, and returns
the list of results, rank by rank. ``world_size == 1`` calls ``fn`` in this process with a
world-of-one communicator (no process group), the path single-process runs take.
``fn`` must be a module-level function (it is pickled by name).

``device`` (default CPU) is the communicator's device: ``fn`` puts its tensors on
``comm.device``. With ``device="cuda:0"`` every rank shares the one GPU; gloo carries
CUDA tensors for all-reduce, all-to-all, all-gather and broadcast, where NCCL would refuse
two ranks on one device.
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


def _entry(rank, world_size, store_path, out_dir, device, fn, args):
    torch.set_num_threads(1)  # 4 ranks on 2 cores: avoid oversubscribing the thread pools
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        result = fn(Communicator(dist.group.WORLD, device=device), *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, device: str = "cpu"):
    if world_size == 1:
        return [fn(Communicator(None, device=device), *args)]
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(
            _entry, args=(world_size, store, tmp, device, fn, args), nprocs=world_size, join=True
        )
        return [
            torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
