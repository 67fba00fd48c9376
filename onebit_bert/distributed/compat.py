"""Collectives under the names the installed torch has.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and
``reduce_scatter_tensor`` to ``reduce_scatter_single`` (the old names still work there and
warn); earlier releases, as cluster images and NGC containers ship them, have only the old
names. The library calls these two functions instead of either name, and they pick
whichever the running torch provides (same arguments, same result).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op=False):
    """Gather equal-size flat ``tensor``s from every rank into flat ``output``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op=False):
    """Sum flat ``tensor`` (``world_size`` equal slices) over ranks; this rank's slice of
    the sum lands in flat ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group, async_op=async_op)
