"""Data parallelism with a gradient average every step (LAMB, AdamW), and 1-bit LAMB,
which needs averaged gradients only in its warmup stage and then communicates by itself."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.distributed.env import DistContext
from onebit_bert.strategies.base import Strategy


class DataParallel(Strategy):
    """Average gradients over ranks, then step: with DDP (bucketed all-reduces overlapped
    with the backward pass, skipped by ``no_sync`` during accumulation) or with one
    bucketed all-reduce after the last micro-batch (exact byte and time accounting).
    Gradient traffic is counted as ``gradients``."""

    name = "data_parallel"

    def __init__(
        self, model: nn.Module, loss_module: nn.Module, optimizer, ctx: DistContext, use_ddp: bool
    ):
        self.ddp = None
        module = loss_module
        if ctx.world_size > 1 and use_ddp:
            self.ddp = DistributedDataParallel(
                loss_module,
                device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
            )
            self.ddp.register_comm_hook(None, ctx.comm.ddp_comm_hook())
            module = self.ddp
        super().__init__(model, module, optimizer, ctx)

    def sync_gradients(self) -> bool:
        """Whether this step's gradients are averaged across ranks."""
        return True

    def backward_context(self, last_micro_batch: bool):
        if self.ddp is not None and not (last_micro_batch and self.sync_gradients()):
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        if self.sync_gradients() and self.ddp is None and self.ctx.world_size > 1:
            with self.comm.traffic("gradients"):
                self.comm.all_reduce_coalesced([p.grad for p in self.params if p.grad is not None])


class OneBitLambStrategy(DataParallel):
    """1-bit LAMB: averaged gradients (as :class:`DataParallel`) up to ``freeze_step``,
    then none: the optimizer's step all-reduces its momentum in 1 bit (``momentum``)."""

    name = "onebit_lamb"

    def sync_gradients(self) -> bool:
        return not self.optimizer.syncs_internally
