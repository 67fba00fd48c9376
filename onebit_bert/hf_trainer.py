"""Any optimizer, 1-bit ones included, under Hugging Face ``Trainer`` (and so Accelerate's
DDP), on any number of ranks.

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
gets the model and a :class:`~onebit_bert.distributed.comm.Communicator` over it). An
optimizer that averages across ranks by itself (``syncs_internally``: 1-bit LAMB, 1-bit
Adam, 0/1 Adam) gets :func:`~onebit_bert.ddp.register_compression_hook` on the DDP model
before the first backward pass: gradients are averaged on the steps the optimizer wants
them averaged and not sent at all on the others. Any other optimizer (LAMB, AdamW) trains
under plain DDP, which averages every gradient.

Checkpoints: ``Trainer`` writes ``optimizer.pt`` from rank 0 alone, and a 1-bit optimizer's
compression errors differ from rank to rank (its ``state_dict()["per_rank"]``). The mixin
writes each rank's part next to it, in ``optimizer_per_rank_<rank>.pt`` (as ``Trainer``
writes ``rng_state_<rank>.pth``), and on resume each rank loads its own part with the
shared state, so no rank starts its errors from zero.

fp16 is refused: torch's ``GradScaler``, which ``Trainer`` uses for it, decides on an
overflow rank by rank, so one rank could skip a step while the others wait for it in the
compressed all-reduce; bf16 and fp32 need no loss scaling.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.ddp import register_compression_hook
from onebit_bert.distributed.comm import Communicator

PER_RANK_FILE = "optimizer_per_rank_{rank}.pt"
"""A rank's part of the optimizer state in a ``Trainer`` checkpoint folder."""


def unwrap_optimizer(optimizer):
    """The optimizer inside Accelerate's (or any) ``.optimizer`` wrappers."""
    while not hasattr(optimizer, "syncs_internally") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def syncs_by_itself(optimizer) -> bool:
    """Whether ``optimizer`` averages across ranks by itself on some steps (and so needs
    :func:`~onebit_bert.ddp.register_compression_hook` under DDP): it has a communicator
    and says step by step whether it syncs (``syncs_internally``)."""
    return getattr(optimizer, "comm", None) is not None and hasattr(optimizer, "syncs_internally")


@contextlib.contextmanager
def _plain_cpu_device(args):
    """While the block runs, a CPU rank's ``args.device`` reads ``cpu`` instead of
    ``cpu:<n>``. Accelerate gives each CPU rank of a multi-process run an indexed device,
    and older transformers (5.17, for one) load the optimizer state with it as
    ``map_location``, which torch cannot restore. Where ``args`` does not cache its device
    as those versions do, nothing changes."""
    cached = vars(args).get("_setup_devices")
    if not isinstance(cached, torch.device) or cached.type != "cpu" or cached.index is None:
        yield
        return
    vars(args)["_setup_devices"] = torch.device("cpu")
    try:
        yield
    finally:
        vars(args)["_setup_devices"] = cached


@contextlib.contextmanager
def _loading_per_rank(optimizer, per_rank):
    """While the block runs, ``optimizer.load_state_dict`` takes ``per_rank`` as the
    state's per-rank part (instead of what the shared file holds: rank 0's)."""
    load = optimizer.load_state_dict

    def load_with_own_part(state_dict):
        load({**state_dict, "per_rank": per_rank})

    optimizer.load_state_dict = load_with_own_part
    try:
        yield
    finally:
        del optimizer.load_state_dict


class OneBitTrainerMixin:
    """``Trainer`` with the optimizer ``make_optimizer(model, comm)`` builds: any optimizer;
    a 1-bit one gets the compression hook and per-rank checkpoints."""

    def __init__(self, *args, make_optimizer: Callable[[nn.Module, Communicator], object], **kw):
        self.make_optimizer = make_optimizer
        self.comm: Communicator | None = None
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
            self.comm = Communicator(group, device=self.args.device)
            self.optimizer = self.make_optimizer(self.model if model is None else model, self.comm)
        return self.optimizer

    def training_step(self, model, *args, **kwargs):
        if not self._hooked and isinstance(model, DistributedDataParallel):
            optimizer = unwrap_optimizer(self.optimizer)
            if syncs_by_itself(optimizer):
                register_compression_hook(model, optimizer, optimizer.comm)
            self._hooked = True  # other optimizers: DDP's own all-reduce, every step
        return super().training_step(model, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _per_rank_path(self, folder: str) -> str:
        return os.path.join(folder, PER_RANK_FILE.format(rank=self.args.process_index))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        state = unwrap_optimizer(self.optimizer).state_dict()
        if "per_rank" not in state:
            return
        os.makedirs(output_dir, exist_ok=True)
        path = self._per_rank_path(output_dir)
        torch.save(state["per_rank"], path + ".tmp")
        os.replace(path + ".tmp", path)  # a crash mid-write leaves no half file

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = None if checkpoint is None else self._per_rank_path(checkpoint)
        if path is None or not os.path.isfile(path):
            # no per-rank part (another optimizer, or a checkpoint without it): Trainer's way
            with _plain_cpu_device(self.args):
                super()._load_optimizer_and_scheduler(checkpoint)
            return
        device = self.args.device
        per_rank = torch.load(
            path, map_location="cpu" if device.type == "cpu" else device, weights_only=True
        )
        optimizer = unwrap_optimizer(self.optimizer)
        with _loading_per_rank(optimizer, per_rank), _plain_cpu_device(self.args):
            super()._load_optimizer_and_scheduler(checkpoint)
