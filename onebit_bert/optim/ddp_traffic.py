"""A 1-bit optimizer inside a ``DistributedDataParallel`` model that still all-reduces
every gradient: found, warned about once, and its bytes counted.

A 1-bit optimizer averages its compressed momentum inside ``step()`` once its warmup is
over and wants local gradients. Under DDP that takes
:func:`onebit_bert.ddp.register_compression_hook`; without it, DDP keeps all-reducing
every gradient in fp32 after the freeze, the run sends more than plain LAMB does, and
neither the optimizer's nor the communicator's byte counters would show it, because DDP's
built-in all-reduce goes around them.

:class:`DdpGradientTraffic` finds, at the optimizer's first step, every live DDP model
whose parameters include the optimizer's (one pass over the garbage collector's objects,
once per optimizer and only on more than one rank: about a second in a process holding
BERT-base and transformers, on a busy 2-core machine). A model counts as hooked for this
optimizer when the compression hook built for it is among the hooks DDP recorded
(``DistributedDataParallel._comm_hooks``). For each model that is not, it registers a
post-accumulate-grad hook on one of the model's parameters, which counts the backward
passes that ran while the model synchronised its gradients
(``require_backward_grad_sync``, False inside ``no_sync()``). The optimizer's first
step cannot have been counted that way; it counts as a synchronised one for a model that
has no comm hook at all (DDP's own all-reduce, the forgotten-hook case) and as an
unknown one otherwise.

Bytes: a model with no comm hook at all sends, per synchronised backward pass, what a
ring all-reduce of its gradient buckets sends from each rank,
``2·(p−1)/p × (bytes of the gradients it reduces)`` (the formula the communicator uses for
its own all-reduces; DDP's buckets hold exactly those gradients). These are filed in the
communicator's statistics under ``gradients`` with no seconds (DDP does not say how long
its all-reduce took) and added to the optimizer's ``last_step_bytes`` and
``bytes_sent``. A model with some other comm hook counts its own bytes, or not: its hook
is its owner's.
"""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

HOOK_OWNER = "onebit_optimizer"
"""The attribute :func:`onebit_bert.ddp.compression_hook` sets on the hook it builds: the
optimizer it serves."""


def _recorded_hooks(model: DistributedDataParallel) -> list:
    return [hook for hook, _state in getattr(model, "_comm_hooks", [])]


class _Watched:
    """One DDP model holding the optimizer's parameters and not hooked for it."""

    def __init__(self, model: DistributedDataParallel, param: torch.Tensor, world_size: int):
        self.model = weakref.ref(model)
        self.plain = not _recorded_hooks(model)
        """No comm hook at all: DDP's own fp32 all-reduce, whose bytes nobody counts."""
        grads = [p for p in model.parameters() if p.requires_grad]
        nbytes = sum(p.numel() * p.element_size() for p in grads)
        self.bytes_per_sync = 2 * (world_size - 1) * nbytes // world_size
        self.syncs = 0
        self.handle = param.register_post_accumulate_grad_hook(self._backward_done)

    def _backward_done(self, _param) -> None:
        model = self.model()
        if model is not None and model.require_backward_grad_sync:
            self.syncs += 1


class DdpGradientTraffic:
    """The DDP models that all-reduce ``optimizer``'s gradients without its compression
    hook (module docstring); :meth:`before_step` and :meth:`after_step` run around each of
    its steps (torch's step pre- and post-hooks)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.watched: list[_Watched] | None = None
        """None until the first step looked for models."""
        self.warned = False
        self._step_bytes = 0

    def _find(self) -> list[_Watched]:
        opt = self.optimizer
        params = {id(p): p for g in opt.param_groups for p in g["params"] if p.requires_grad}
        watched = []
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which some lazy module
            # proxies answer by importing (and warning)
            if not issubclass(type(obj), DistributedDataParallel):
                continue
            if any(getattr(h, HOOK_OWNER, None) is opt for h in _recorded_hooks(obj)):
                continue
            shared = [params[id(p)] for p in obj.parameters() if id(p) in params]
            if shared:
                watch = _Watched(obj, shared[0], opt.comm.world_size)
                watch.syncs = 1 if watch.plain else 0  # the step that found it
                watched.append(watch)
        return watched

    def before_step(self, *_args) -> None:
        opt = self.optimizer
        self._step_bytes = 0
        if opt.comm.world_size == 1:
            return
        if self.watched is None:
            self.watched = self._find()
        synced = False
        for watch in self.watched:
            synced = synced or watch.syncs > 0
            if watch.plain:
                self._step_bytes += watch.syncs * watch.bytes_per_sync
            watch.syncs = 0
        if self._step_bytes:
            opt.comm.stats.add("gradients", self._step_bytes, 0.0)
        if synced and opt.syncs_internally and not self.warned:
            self.warned = True
            warnings.warn(
                f"{opt.NAME} compresses from step {opt.step_count + 1} on, but a "
                f"DistributedDataParallel model still all-reduces every gradient of it in "
                f"fp32: call onebit_bert.ddp.register_compression_hook(model, optimizer, comm) "
                f"before the first backward pass (its bytes are counted under 'gradients')",
                stacklevel=3,
            )

    def after_step(self, *_args) -> None:
        opt = self.optimizer
        opt.last_step_bytes += self._step_bytes
        opt.bytes_sent += self._step_bytes
        self._step_bytes = 0
