"""1-bit optimizers under Hugging Face ``Trainer`` (and so Accelerate's DDP).

Mix :class:`OneBitTrainerMixin` in front of ``transformers.Trainer``; it imports nothing
from transformers itself, so the core library stays free of it::

    from transformers import Trainer
    from onebit_bert.hf_trainer import OneBitTrainerMixin
    from onebit_bert.optim import OneBitLamb

    class OneBitTrainer(OneBitTrainerMixin, Trainer):
        pass

    trainer = OneBitTrainer(
        model=model,
        args=TrainingArguments(..., bf16=True),
        train_dataset=data,
        make_optimizer=lambda model, comm: OneBitLamb(
            model.parameters(), lr=2e-3, freeze_step=1000, comm=comm
        ),
    )
    trainer.train()

The optimizer is built once ``Trainer`` has joined the process group (``make_optimizer``
gets the model and a :class:`~onebit_bert.distributed.comm.Communicator` over it), and
before the first backward pass the DDP model gets
:func:`~onebit_bert.ddp.register_compression_hook`: gradients are averaged on the steps
the optimizer wants them averaged and not sent at all on the others. fp16 is refused:
torch's ``GradScaler``, which ``Trainer`` uses for it, decides on an overflow rank by rank,
so one rank could skip a step while the others wait for it in the compressed all-reduce;
bf16 and fp32 need no loss scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.ddp import register_compression_hook
from onebit_bert.distributed.comm import Communicator


def unwrap_optimizer(optimizer):
    """The optimizer inside Accelerate's (or any) ``.optimizer`` wrappers."""
    while not hasattr(optimizer, "syncs_internally") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


class OneBitTrainerMixin:
    """``Trainer`` with a 1-bit optimizer from ``make_optimizer(model, comm)``."""

    def __init__(self, *args, make_optimizer: Callable[[nn.Module, Communicator], object], **kw):
        self.make_optimizer = make_optimizer
        self._hooked = False
        super().__init__(*args, **kw)
        if getattr(self.args, "fp16", False):
            raise ValueError(
                "a 1-bit optimizer under Trainer needs bf16 or fp32: fp16's GradScaler "
                "skips an overflowing step on one rank while the others wait for it in the "
                "compressed all-reduce; set bf16=True (or neither)"
            )

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            comm = Communicator(group, device=self.args.device)
            self.optimizer = self.make_optimizer(self.model if model is None else model, comm)
        return self.optimizer

    def training_step(self, model, *args, **kwargs):
        if not self._hooked and isinstance(model, DistributedDataParallel):
            optimizer = unwrap_optimizer(self.optimizer)
            register_compression_hook(model, optimizer, optimizer.comm)
            self._hooked = True
        return super().training_step(model, *args, **kwargs)
