"""1-bit Adam (Tang et al., arXiv 2102.02888): Adam whose momentum is synchronised with
1-bit compression once its second moment is frozen.

Per parameter tensor ``x`` with gradient ``g`` (no bias correction, ``eps`` outside the
square root, decoupled weight decay ``wd``), as DeepSpeed's ``OnebitAdam`` computes it:

* **warmup**, steps ``1 .. freeze_step``: the caller averages gradients over ranks
  (``syncs_internally`` is False), and ::

      m = β1·m + (1-β1)·ḡ;   v = β2·v + (1-β2)·ḡ²;   x = x - lr·(m/(sqrt(v)+eps) + wd·x)

* **compression**, later steps: ``v`` is frozen and the caller sends nothing; each rank
  folds its local gradient into the momentum, and the momenta are averaged with the
  error-compensated 1-bit all-reduce
  (:func:`onebit_bert.distributed.codecs.compressed_all_reduce`)::

      m = C(β1·m + (1-β1)·g_local) ⊙ mask;   x = x - lr·(m/(sqrt(v)+eps) + wd·x)

On a world of one nothing is compressed (as in DeepSpeed): the optimizer is then Adam
without bias correction whose ``v`` stops changing after ``freeze_step``.

Without bias correction every compression-stage step is ``1/sqrt(1 - β2^freeze_step)``
times the step of a bias-corrected Adam with the same frozen ``v`` (2.02 at β2 = 0.999 and
freeze 280; 1.26 in the parity regime), so its learning rate is not AdamW's. The option
``bias_correction=True`` (a deviation from DeepSpeed) divides ``m`` by ``1 - β1^t`` and
``v`` by ``1 - β2^min(t, freeze_step)``: warmup steps are AdamW's, and later steps keep the
correction the frozen ``v`` had at the freeze, so the same learning rate means the same
step size as AdamW.
``force_compression`` compresses anyway (tests of the collective on one process).

Where this differs from DeepSpeed's ``OnebitAdam``, on purpose:

* No discarded step: DeepSpeed's first ``step()`` only allocates buffers and throws the
  first batch's gradient away; here step 1 is a real Adam step, and ``freeze_step`` counts
  real steps (DeepSpeed's counter includes the discarded call, so its last full-precision
  update is its ``freeze_step - 1``-th).
* One fused buffer for all layers, compressed bucket by bucket (DeepSpeed compresses
  every tensor on its own, two collectives per tensor): each layer is multiplied by a
  scaling coefficient before compression and divided by it after, fixed at the first
  compression step from the (rank-identical) momentum, as 1-bit LAMB does
  (:mod:`onebit_bert.optim.compressed`). The padding sits at the end of the buffer and
  stays zero, and scales use real elements only.
* This rank's compression errors are checkpointed (``state_dict()["per_rank"]``) and
  restored on resume with the same world size; DeepSpeed resets them on every load.
* ``freeze_step="auto"`` (:mod:`onebit_bert.optim.auto_freeze`).
* No ``non_freeze`` parameter groups (DeepSpeed's option to keep some groups in full
  precision), and masks are set with :meth:`set_momentum_mask`, not ``exp_avg_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim import defaults
from onebit_bert.optim.auto_freeze import AutoFreezeConfig
from onebit_bert.optim.compressed import CompressedOptimizer, WarmupThenCompress
from onebit_bert.optim.deepspeed import FromDeepSpeed, onebit_adam_kwargs
from onebit_bert.optim.lamb import adam_hyperparameters, begin_step, groups_with_grads, zero_moments
from onebit_bert.optim.warmup_state import WarmupCheckpoint

NAME = "1-bit Adam"
SECTION = "onebit_adam"
"""The key of this optimizer's own entries in its state dict."""


def adam_update(
    group: dict,
    params: list[torch.Tensor],
    states: list[dict],
    corrections: tuple[float, float] | None = None,
) -> None:
    """``x = x - lr·(m/(sqrt(v)+eps) + wd·x)`` with the group's hyperparameters, on tensors
    of one device and dtype; ``corrections`` ``(c1, c2)``: Adam's bias correction,
    ``m/c1`` and ``v/c2`` in place of ``m`` and ``v`` (None: none, DeepSpeed's)."""
    denom = torch._foreach_sqrt([st["exp_avg_sq"] for st in states])
    if corrections is not None:
        torch._foreach_div_(denom, math.sqrt(corrections[1]))
    torch._foreach_add_(denom, group["eps"])
    update = torch._foreach_div([st["exp_avg"] for st in states], denom)
    if corrections is not None:
        torch._foreach_div_(update, corrections[0])
    if group["weight_decay"] > 0.0:
        torch._foreach_add_(update, params, alpha=group["weight_decay"])
    torch._foreach_add_(params, update, alpha=-group["lr"])


def fold_gradients(momenta: list[torch.Tensor], grads: list[torch.Tensor], beta1: float) -> None:
    """``m = β1·m + (1-β1)·g`` in place."""
    torch._foreach_mul_(momenta, beta1)
    torch._foreach_add_(momenta, grads, alpha=1.0 - beta1)


def unscale(optimizer: CompressedOptimizer, params: list[torch.Tensor], key: str) -> list:
    """State ``key`` of ``params`` after a compressed all-reduce: divided back by each
    layer's scaling coefficient, then masked (the optimizer's momentum masks, and zero
    where nothing has trained yet); the tensors, in place."""
    tensors = [optimizer.state[p][key] for p in params]
    torch._foreach_div_(tensors, [optimizer.state[p]["scaling_coeff"] for p in params])
    optimizer._apply_masks(params, tensors)
    return tensors


def fold_squares(squares: list[torch.Tensor], grads: list[torch.Tensor], beta2: float) -> None:
    """``v = β2·v + (1-β2)·g²`` in place."""
    torch._foreach_mul_(squares, beta2)
    torch._foreach_addcmul_(squares, grads, grads, value=1.0 - beta2)


class OneBitAdam(WarmupCheckpoint, FromDeepSpeed, WarmupThenCompress):
    """1-bit Adam over the ranks of ``comm`` (default: the default process group, or a
    world of one when none exists).

    Args:
        lr, betas, eps, weight_decay: Adam's (no bias correction, decoupled weight decay),
            checked and defaulted by :func:`~onebit_bert.optim.lamb.adam_hyperparameters`.
        freeze_step: last step of the warmup (>= 1), or ``"auto"``
            (:mod:`onebit_bert.optim.auto_freeze`, bounded by ``auto_freeze`` and
            ``total_steps``).
        comm: the :class:`Communicator` whose ranks share this model.
        bucket_numel: compress in buckets of at most this many elements; ``None``: one.
        auto_freeze, total_steps: with ``freeze_step="auto"``, the detector's settings and
            the run's length in steps.
        force_compression: compress even on a world of one.

    After each step: ``stage`` ("warmup" or "compression"), ``last_compression_error``,
    ``last_step_bytes`` and ``bytes_sent``.
    """

    NAME = NAME
    SECTION = SECTION
    deepspeed_kwargs = staticmethod(onebit_adam_kwargs)

    def __init__(
        self,
        params: Iterable,
        *,
        freeze_step: int | str = defaults.FREEZE_STEP,
        comm: Communicator | None = None,
        bucket_numel: int | None = None,
        auto_freeze: AutoFreezeConfig | None = None,
        total_steps: int | None = None,
        force_compression: bool = False,
        bias_correction: bool = False,
        **hyperparameters,
    ):
        group_defaults = adam_hyperparameters(**hyperparameters)
        self.bias_correction = bias_correction
        """Adam's bias correction, with the second moment's frozen at ``freeze_step``
        (:meth:`_corrections`); False: none (DeepSpeed's)."""
        self._check_freeze_step(freeze_step)
        super().__init__(params, group_defaults, comm, bucket_numel)
        self._init_freeze(freeze_step, auto_freeze, total_steps)
        self.compresses = self.comm.world_size > 1 or force_compression
        """Whether the compression stage runs the 1-bit all-reduce (not on a world of one,
        unless forced)."""

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = begin_step(self, closure, NAME)
        self._step += 1
        self.last_compression_error = None
        self.last_step_bytes = 0
        if self.freeze_step is None or self._step <= self.freeze_step:
            self._warmup_step()
        else:
            self._compression_step()
        return loss

    def _corrections(self, group: dict) -> tuple[float, float] | None:
        """``(1 - β1^t, 1 - β2^t_v)`` at step ``t`` with ``t_v = min(t, freeze_step)`` (the
        second moment stops at the freeze, and so does its correction), or None without
        bias correction."""
        if not self.bias_correction:
            return None
        beta1, beta2 = group["betas"]
        frozen = self.freeze_step is not None and self._step > self.freeze_step
        return 1.0 - beta1**self._step, 1.0 - beta2 ** (self.freeze_step if frozen else self._step)

    def _next_step_overlaps(self) -> bool:
        return self.compresses and self.syncs_internally and self._codec_overlaps()

    def _prepare_compression(self, members: list[torch.Tensor], flat: torch.Tensor) -> None:
        if "scaling_coeff" not in self.state[members[0]]:
            # the momentum is identical on every rank here: warmup averaged the gradients
            self._set_scaling_coefficients(members, "exp_avg")

    def _fold_for_compression(
        self, group: dict, params: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> None:
        """``m = β1·m + (1-β1)·g`` (``g`` times ``grad_scale`` when given), then the scaling
        coefficient when compressing."""
        momenta = [self.state[p]["exp_avg"] for p in params]
        grads = self._gradients(params, grad_scale)
        fold_gradients(momenta, grads, group["betas"][0])
        if self.compresses:
            torch._foreach_mul_(momenta, [self.state[p]["scaling_coeff"] for p in params])

    def _warmup_step(self) -> None:
        for group, params in groups_with_grads(self):
            for p in params:
                zero_moments(self.state[p], p)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            grads = [p.grad for p in params]
            fold_gradients([st["exp_avg"] for st in states], grads, beta1)
            fold_squares([st["exp_avg_sq"] for st in states], grads, beta2)
            adam_update(group, params, states, self._corrections(group))
        self._observe_warmup(self._states_with("exp_avg_sq"))

    def _compression_step(self) -> None:
        layout = self._layout("exp_avg", f"after freeze_step={self.freeze_step}")
        members = [p for _, ps in layout for p in ps]
        if not members:
            return
        overlapped = self._take_overlapped() if self.compresses else None
        if overlapped is not None:  # folded and all-reduced during the backward pass
            overlapped.finish()
        else:
            flat = self._fused(members, "exp_avg") if self.compresses else None
            if self.compresses:
                self._prepare_compression(members, flat)
            for group, params in layout:
                if params:
                    self._fold_for_compression(group, params)
            if self.compresses:
                self._compressed_all_reduce(flat, "momentum")
        for group, params in layout:
            if not params:
                continue
            if self.compresses:
                unscale(self, params, "exp_avg")
            adam_update(group, params, [self.state[p] for p in params], self._corrections(group))
