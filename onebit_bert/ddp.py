"""1-bit optimizers in a plain ``DistributedDataParallel`` script.

DDP all-reduces every gradient during the backward pass. A 1-bit optimizer needs that
only on the steps it says so (``optimizer.syncs_internally`` is False: 1-bit LAMB's and
1-bit Adam's warmup, 0/1 Adam's variance steps); on the others it averages its compressed
momentum inside ``step()`` and must get the local gradients, and a full all-reduce would
send more than plain LAMB does. :func:`register_compression_hook` installs a DDP comm
hook that does exactly that, so a DDP + LAMB script changes in a few lines::

    from onebit_bert.ddp import register_compression_hook
    from onebit_bert.distributed import Communicator
    from onebit_bert.optim import OneBitLamb

    comm = Communicator(dist.group.WORLD, device)
    model = DistributedDataParallel(model, device_ids=[device])
    optimizer = OneBitLamb(model.parameters(), lr=..., freeze_step=..., comm=comm)
    register_compression_hook(model, optimizer, comm)

Forgetting the hook is not silent: at the first compression step, the optimizer warns
once (naming :func:`register_compression_hook`) and counts DDP's fp32 all-reduce in its
bytes (:mod:`onebit_bert.optim.ddp_traffic`).

For fp16, :class:`~onebit_bert.precision.LossScaler` (not torch's ``GradScaler``) agrees
on an overflow across ranks before anyone steps: a rank that skipped its step while the
others entered the compressed all-reduce would leave them waiting for it. The per-rank
compression errors are in ``optimizer.state_dict()["per_rank"]``;
:func:`split_state_dict` separates them so that
:class:`~onebit_bert.checkpoint.CheckpointManager` writes them once per rank.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.distributed.codecs import PlainCodec
from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim.ddp_traffic import HOOK_OWNER


def compression_hook(optimizer, comm: Communicator):
    """A DDP comm hook: on steps whose gradients ``optimizer`` wants averaged, an
    asynchronous all-reduce of each bucket (counted in ``comm``'s stats as ``gradients``);
    on the others nothing is sent and each rank keeps its local gradients."""
    average = PlainCodec(comm).ddp_hook()

    def hook(state, bucket):
        if optimizer.syncs_internally:
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future
        return average(state, bucket)

    setattr(hook, HOOK_OWNER, optimizer)  # how the optimizer knows its DDP model is hooked
    return hook


def register_compression_hook(
    model: DistributedDataParallel, optimizer, comm: Communicator
) -> None:
    """Install :func:`compression_hook` on ``model`` (once, before the first backward)."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"register_compression_hook needs the DistributedDataParallel wrapper, got "
            f"{type(model).__name__}: wrap the model first"
        )
    ranks = torch.distributed.get_process_group_ranks
    if comm.group is not None and sorted(ranks(model.process_group)) != sorted(ranks(comm.group)):
        # the hook's all-reduce runs on comm's group: it must hold the model's ranks
        raise ValueError(
            "the communicator's process group and the DDP model's have different ranks: "
            "build the Communicator on the group the model was wrapped with"
        )
    model.register_comm_hook(None, compression_hook(optimizer, comm))


def split_state_dict(optimizer) -> tuple[dict, dict]:
    """``(shared, per_rank)`` of ``optimizer.state_dict()``: what every rank holds alike
    and what only this rank holds (the compression errors), as
    :meth:`~onebit_bert.checkpoint.CheckpointManager.save` takes them."""
    state = dict(optimizer.state_dict())
    per_rank = state.pop("per_rank", None)
    return {"optimizer": state}, {"optimizer": per_rank}


def merge_state_dict(shared: dict, per_rank: dict | None) -> dict:
    """The inverse of :func:`split_state_dict`, for ``optimizer.load_state_dict``
    (``per_rank`` None: a checkpoint from another world size; the errors restart)."""
    state = dict(shared["optimizer"])
    rank_state = (per_rank or {}).get("optimizer")
    if rank_state is not None:
        state["per_rank"] = rank_state
    return state
