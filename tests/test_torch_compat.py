"""The collective shims on a torch without the 2.13 names (all_gather_single,
reduce_scatter_single): with those names hidden, 2 gloo ranks give the same results
through the older names (all_gather_into_tensor, reduce_scatter_tensor), synchronous and
asynchronous, and a 1-bit all-reduce is bit-identical."""

from __future__ import annotations

import torch
import torch.distributed as dist

from onebit_bert.distributed import Communicator
from onebit_bert.distributed.compat import all_gather_flat, reduce_scatter_flat
from onebit_bert.distributed.compression import ErrorFeedback
from tests.distributed_harness import run_ranks

NEW_NAMES = ("all_gather_single", "reduce_scatter_single")


def _collectives(comm: Communicator) -> dict:
    rank, p = comm.rank, comm.world_size
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    gathered = torch.empty(6 * p)
    all_gather_flat(gathered, x, group=comm.group)
    scattered = torch.empty(6 // p)
    reduce_scatter_flat(scattered, x.clone(), group=comm.group)
    later = torch.empty(6 * p)
    all_gather_flat(later, x, group=comm.group, async_op=True).wait()
    generator = torch.Generator().manual_seed(rank)
    buffer = torch.randn(4096, generator=generator)
    feedback = ErrorFeedback(4096, p, rank=rank, bucket_numel=1024)
    padded = torch.zeros(feedback.padded_numel)
    padded[:4096] = buffer
    comm.compressed_all_reduce(padded, feedback)
    return {"gathered": gathered, "scattered": scattered, "later": later, "onebit": padded}


def _with_old_names_only(comm: Communicator) -> dict:
    hidden = {name: getattr(dist, name) for name in NEW_NAMES if hasattr(dist, name)}
    for name in hidden:
        delattr(dist, name)
    try:
        assert not any(hasattr(dist, name) for name in NEW_NAMES)
        return _collectives(comm)
    finally:
        for name, fn in hidden.items():
            setattr(dist, name, fn)


def _both(comm: Communicator) -> tuple[dict, dict]:
    return _collectives(comm), _with_old_names_only(comm)


def test_collectives_give_the_same_results_through_the_older_names():
    for rank, (current, old) in enumerate(run_ranks(_both, 2)):
        assert torch.equal(
            current["gathered"], torch.cat([torch.arange(6.0), torch.arange(6.0) + 10])
        )
        expected_sum = 2 * torch.arange(6.0) + 10
        assert torch.equal(current["scattered"], expected_sum[3 * rank : 3 * rank + 3])
        for key in current:
            assert torch.equal(current[key], old[key]), (rank, key)
