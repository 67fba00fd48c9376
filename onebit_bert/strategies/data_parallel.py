"""Data parallelism with a gradient average every step (LAMB, AdamW), and the strategies of
the optimizers that average across ranks by themselves on some steps (1-bit LAMB, 1-bit
Adam; 0/1 Adam in :mod:`onebit_bert.strategies.zero_one_adam`): they average gradients
only on the steps whose optimizer asks for it."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.distributed.env import DistContext
from onebit_bert.strategies.base import GradientSync, Strategy


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

    def gradient_sync(self) -> GradientSync:
        """Every step's gradients are averaged."""
        return "allreduce"

    def backward_context(self, last_micro_batch: bool):
        if self.ddp is not None and not (last_micro_batch and self.gradient_sync() == "allreduce"):
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        if self.gradient_sync() == "allreduce" and self.ddp is None and self.ctx.world_size > 1:
            with self.comm.traffic("gradients"):
                self.comm.all_reduce_coalesced([p.grad for p in self.params if p.grad is not None])


class SelfSyncingDataParallel(DataParallel):
    """For an optimizer with ``syncs_internally``: averaged gradients (as
    :class:`DataParallel`) on the steps it says False, none on the others, where its step
    communicates by itself."""

    def gradient_sync(self) -> GradientSync:
        return "optimizer" if self.optimizer.syncs_internally else "allreduce"

    def metrics(self) -> dict:
        """The base figures, and with ``freeze_step: auto`` the detector's last statistic
        (``freeze_statistic``) and, once chosen, the last warmup step (``freeze_step``)."""
        out = super().metrics()
        if getattr(self.optimizer, "auto_freeze", False):
            if self.optimizer.freeze_statistic is not None:
                out["freeze_statistic"] = self.optimizer.freeze_statistic
            if self.optimizer.freeze_step is not None:
                out["freeze_step"] = self.optimizer.freeze_step
        return out


class OneBitLambStrategy(SelfSyncingDataParallel):
    """1-bit LAMB: averaged gradients up to ``freeze_step``, then none: the optimizer's step
    all-reduces its momentum in 1 bit (``momentum``)."""

    name = "onebit_lamb"


class OneBitAdamStrategy(SelfSyncingDataParallel):
    """1-bit Adam: averaged gradients up to ``freeze_step``, then none: the optimizer's step
    all-reduces its momentum in 1 bit (``momentum``)."""

    name = "onebit_adam"
