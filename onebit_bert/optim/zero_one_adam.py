"""0/1 Adam (Lu et al., arXiv 2202.06009): Adam with adaptive variance freezing and local
steps, communicating 1-bit values on all but a vanishing share of its steps.

The schedules are DeepSpeed's ``ZeroOneAdam`` code, run on this optimizer's step counter
``t`` (1 for the first real step). Per parameter tensor ``x`` (no bias correction, ``eps``
outside the square root, decoupled weight decay ``wd``, ``d = m/(sqrt(v)+eps) + wd·x``):

**Variance stage**, ``t <= var_freeze_step``:

* *variance steps*, ``t % var_interval == 0``: the caller averages gradients in full
  precision (``syncs_internally`` is False), ``v = β2·v + (1-β2)·ḡ²``,
  ``m = β1·m + (1-β1)·ḡ``;
* otherwise the caller sends nothing and the optimizer averages the local gradients in
  1 bit, ``ĝ = C(g)``: ``m = β1·m + (1-β1)·ĝ``, ``v`` unchanged;
* then ``x = x - lr·d``. Each variance step counts; after ``var_update_scaler`` (kappa)
  of them ``var_interval`` doubles: kappa variance updates one step apart, then kappa two
  steps apart, kappa four apart, ...

**Local steps**, ``t > var_freeze_step``: ``v`` is frozen and each rank steps alone::

    m = β1·m + (1-β1)·g_local;   lrs += lr;   x = x - lr·d;   u = u - lr·d

and when ``t % local_step_interval == 0`` the ranks synchronise in 1 bit (``x_s`` the
parameters of the previous synchronisation)::

    u = C(u ⊙ (sqrt(v)+eps));   m = -u / lrs;   x = x_s + u / (sqrt(v)+eps);   u = 0; lrs = 0

Every ``local_step_scaler`` local steps, ``local_step_interval`` doubles, up to
``local_step_clipper`` (H). After a synchronisation ``m`` is the learning-rate weighted mean
of the ranks' update directions scaled back by ``sqrt(v)+eps`` (weight decay included), as
in DeepSpeed. The compression errors serve the gradients in the variance stage and ``u``
afterwards; they are zeroed once at the switch, as in DeepSpeed.

On a world of one nothing is compressed (``force_compression`` compresses anyway).

Where this differs from DeepSpeed's ``ZeroOneAdam``, on purpose:

* No discarded step: DeepSpeed's first ``step()`` only allocates buffers and drops that
  batch. Its counter includes that call, so its ``k``-th update runs the rules above with
  ``t = k + 1``. Here ``t = k``: variance updates come exactly kappa per gap (DeepSpeed's
  first gap-2 update lands one step early, on its 17th update), and its last variance-stage
  update is the ``var_freeze_step``-th, as here.
* The synchronised parameters are ``x_s + u/(sqrt(v)+eps)`` with ``x_s`` kept from the
  previous synchronisation, rather than ``(x - u) + u/(sqrt(v)+eps)``: equal in exact
  arithmetic, but ``x - u`` rounds differently on every rank, and here the ranks' parameters
  are bit-identical after every synchronisation. Costs one copy of the parameters during
  the local steps.
* On a world of one DeepSpeed skips the momentum update of non-variance steps (it
  sits inside its ``size > 1`` branch); here the local gradient (the average of a world of
  one) updates ``m`` as on any other step.
* A synchronisation after steps whose learning rates sum to zero sets ``m`` to zero
  (DeepSpeed divides by zero).
* One fused buffer compressed bucket by bucket, with per-layer scaling coefficients fixed
  from the rank-identical momentum at the first compressed step of each stage
  (:mod:`onebit_bert.optim.compressed`); DeepSpeed compresses tensor by tensor.
* Exact resume: the schedule's counters and intervals, and this rank's compression errors,
  momentum, accumulator and (between synchronisations) parameters are checkpointed;
  DeepSpeed's load resets the intervals to 1, drops errors and accumulator, and sets a
  misspelt flag (``var_freeze_key``), so its first step after resuming in the local-step
  stage runs the variance stage's logic.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim import defaults
from onebit_bert.optim.compressed import CompressedOptimizer
from onebit_bert.optim.deepspeed import FromDeepSpeed, zero_one_adam_kwargs
from onebit_bert.optim.lamb import (
    adam_hyperparameters,
    begin_step,
    check_state_shapes,
    groups_with_grads,
    zero_moments,
)
from onebit_bert.optim.onebit_adam import adam_update, fold_gradients, fold_squares, unscale

NAME = "0/1 Adam"
SECTION = "zero_one_adam"
"""The key of this optimizer's own entries in its state dict."""
ACCUMULATOR = "momentum_accumulator"
SYNCED = "synced_param"

STEP_KINDS = ("variance", "compressed", "local", "sync")
"""What a step does: a variance step (full-precision gradient average by the caller), a
1-bit gradient average, a local step (nothing sent), or a local step ending in the 1-bit
synchronisation."""


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class ZeroOneAdam(FromDeepSpeed, CompressedOptimizer):
    """0/1 Adam over the ranks of ``comm`` (default: the default process group, or a world
    of one when none exists).

    Args:
        lr, betas, eps, weight_decay: Adam's (no bias correction, decoupled weight decay),
            checked and defaulted by :func:`~onebit_bert.optim.lamb.adam_hyperparameters`.
        var_freeze_step: last step of the variance stage.
        var_update_scaler: variance updates per interval before it doubles (kappa).
        local_step_scaler: local steps between two doublings of the local-step interval.
        local_step_clipper: the largest local-step interval (H).
        comm, bucket_numel, force_compression: as for
            :class:`~onebit_bert.optim.onebit_adam.OneBitAdam`.

    After each step: ``stage`` (one of :data:`STEP_KINDS`), ``var_interval``,
    ``local_step_interval``, ``replicas_agree``, ``last_compression_error``,
    ``last_step_bytes``, ``bytes_sent``.
    """

    NAME = NAME
    deepspeed_kwargs = staticmethod(zero_one_adam_kwargs)

    def __init__(
        self,
        params: Iterable,
        *,
        comm: Communicator | None = None,
        bucket_numel: int | None = None,
        force_compression: bool = False,
        var_freeze_step: int = defaults.VAR_FREEZE_STEP,
        var_update_scaler: int = defaults.VAR_UPDATE_SCALER,
        local_step_scaler: int = defaults.LOCAL_STEP_SCALER,
        local_step_clipper: int = defaults.LOCAL_STEP_CLIPPER,
        **hyperparameters,
    ):
        group_defaults = adam_hyperparameters(**hyperparameters)
        for name, value in (
            ("var_freeze_step", var_freeze_step),
            ("var_update_scaler", var_update_scaler),
            ("local_step_scaler", local_step_scaler),
            ("local_step_clipper", local_step_clipper),
        ):
            _positive_int(name, value)
        super().__init__(params, group_defaults, comm, bucket_numel)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.compresses = self.comm.world_size > 1 or force_compression
        """Whether the 1-bit all-reduce runs (not on a world of one, unless forced)."""
        self.var_interval = 1
        self.var_counter = 0
        self.local_step_interval = 1
        self.local_step_counter = 0
        self.local_steps_since_sync = 0
        self._lrs = [0.0] * len(self.param_groups)
        self.stage = "variance"
        """What the last step did (:data:`STEP_KINDS`)."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_lrs"):
            self._lrs.append(0.0)

    # ------------------------------------------------------------------ public state
    @property
    def next_step_kind(self) -> str:
        """What the next ``step()`` will do (:data:`STEP_KINDS`)."""
        t = self._step + 1
        if t <= self.var_freeze_step:
            return "variance" if t % self.var_interval == 0 else "compressed"
        return "sync" if t % self.local_step_interval == 0 else "local"

    @property
    def next_stage(self) -> str:
        """What the next ``step()`` will do (:attr:`next_step_kind`); :attr:`stage` is what
        the last one did."""
        return self.next_step_kind

    @property
    def syncs_internally(self) -> bool:
        """True unless the next step is a variance step, whose gradients the caller must
        average in full precision; otherwise the caller passes local gradients."""
        return self.next_step_kind != "variance"

    @property
    def replicas_agree(self) -> bool:
        """Whether parameters, ``m`` and ``u`` are the same on every rank now: always in
        the variance stage, and right after each synchronisation."""
        return self._step <= self.var_freeze_step or self.local_steps_since_sync == 0

    def synced_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s value at the last synchronisation (identical on every rank); in the
        variance stage, and right after a synchronisation, ``param`` itself."""
        if self.replicas_agree:
            return param.detach()
        return self.state[param][SYNCED]

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly. The schedule's counters and the state all
        ranks hold alike are shared; this rank's compression errors and, between two
        synchronisations, its momentum and accumulator are under ``"per_rank"`` (its
        parameters then differ too: they are the caller's to save, see ``replicas_agree``).
        The synchronised parameters are saved only while they differ from the parameters."""
        state = super().state_dict()
        drop = {ACCUMULATOR} | ({SYNCED} if self.replicas_agree else set())
        state["state"] = {
            index: {k: v for k, v in entry.items() if k not in drop}
            for index, entry in state["state"].items()
        }
        state[SECTION] = {
            "step": self._step,
            "var_interval": self.var_interval,
            "var_counter": self.var_counter,
            "local_step_interval": self.local_step_interval,
            "local_step_counter": self.local_step_counter,
            "local_steps_since_sync": self.local_steps_since_sync,
            "lrs": list(self._lrs),
            "stage": self.stage,
        }
        local = None
        if not self.replicas_agree:
            members = self._members()
            local = {
                "exp_avg": [self.state[p]["exp_avg"].clone() for p in members],
                ACCUMULATOR: [self.state[p][ACCUMULATOR].clone() for p in members],
            }
        state["per_rank"] = {**self._per_rank_state(), "local": local}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`. Without this rank's part (another
        world size wrote it), compression errors start from zero, and a state saved between
        two synchronisations restarts from the last one (its local steps are dropped, and
        ``m`` is the saving rank's); both with a warning."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(SECTION, None)
        per_rank = state_dict.pop("per_rank", None) or {}
        if extra is None:
            raise ValueError(
                "this optimizer state has no 0/1 Adam section; it was saved by another "
                "optimizer (resume with the optimizer that wrote it)"
            )
        check_state_shapes(self, state_dict)
        super().load_state_dict(state_dict)
        self._step = int(extra["step"])
        self.var_interval = int(extra["var_interval"])
        self.var_counter = int(extra["var_counter"])
        self.local_step_interval = int(extra["local_step_interval"])
        self.local_step_counter = int(extra["local_step_counter"])
        self.local_steps_since_sync = int(extra["local_steps_since_sync"])
        self._lrs = [float(x) for x in extra["lrs"]]
        self.stage = extra["stage"]
        members = self._members()
        for p in members:
            self.state[p][ACCUMULATOR] = torch.zeros_like(p)
            if self._step > self.var_freeze_step and SYNCED not in self.state[p]:
                self.state[p][SYNCED] = p.detach().clone()
        local = per_rank.get("local")
        if local is not None:
            for p, m, u in zip(members, local["exp_avg"], local[ACCUMULATOR], strict=True):
                self.state[p]["exp_avg"].copy_(m)
                self.state[p][ACCUMULATOR].copy_(u)
        elif not self.replicas_agree:
            warnings.warn(
                f"0/1 Adam state at step {self._step} was saved between two synchronisations "
                f"without this rank's part; restarting from the last synchronisation",
                stacklevel=2,
            )
            self.local_steps_since_sync = 0
            self._lrs = [0.0] * len(self.param_groups)
            with torch.no_grad():
                for p in members:
                    p.copy_(self.state[p][SYNCED])
        compressed_before = self._step > self.var_freeze_step or self.var_interval > 1
        self._load_per_rank_state(per_rank, self.compresses and compressed_before)

    def _members(self) -> list[torch.Tensor]:
        """The parameters with optimizer state, in group and parameter order."""
        return [p for g in self.param_groups for p in g["params"] if "exp_avg" in self.state[p]]

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = begin_step(self, closure, NAME)
        kind = self.next_step_kind
        self._step += 1
        self.last_compression_error = None
        self.last_step_bytes = 0
        for _, params in groups_with_grads(self):
            for p in params:
                zero_moments(self.state[p], p, ACCUMULATOR)
        if kind == "variance":
            self._variance_step()
        elif kind == "compressed":
            self._compressed_gradient_step()
        else:
            self._local_step(sync=kind == "sync")
        self.stage = kind
        return loss

    def _variance_step(self) -> None:
        for group, params in groups_with_grads(self):
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            grads = [p.grad for p in params]
            fold_squares([st["exp_avg_sq"] for st in states], grads, beta2)
            fold_gradients([st["exp_avg"] for st in states], grads, beta1)
            adam_update(group, params, states)
        self.var_counter += 1
        if self.var_counter == self.var_update_scaler:
            self.var_counter = 0
            self.var_interval *= 2

    def _compressed_gradient_step(self) -> None:
        layout = self._layout("exp_avg", "after the first step")
        members = [p for _, ps in layout for p in ps]
        if not members:
            return
        if self.compresses:
            flat = self._fused(members, ACCUMULATOR)  # the accumulator is idle until the switch
            if "scaling_coeff" not in self.state[members[0]]:
                # m is identical on every rank in this stage
                self._set_scaling_coefficients(members, "exp_avg")
            for _, params in layout:
                if not params:
                    continue
                views = [self.state[p][ACCUMULATOR] for p in params]
                torch._foreach_copy_(views, self._grads(params))
                torch._foreach_mul_(views, [self.state[p]["scaling_coeff"] for p in params])
            self._compressed_all_reduce(flat, "gradients")
        for group, params in layout:
            if not params:
                continue
            states = [self.state[p] for p in params]
            if self.compresses:
                averaged = unscale(self, params, ACCUMULATOR)
            else:
                averaged = self._grads(params)
            fold_gradients([st["exp_avg"] for st in states], averaged, group["betas"][0])
            adam_update(group, params, states)
        if self.compresses:
            flat.zero_()

    @staticmethod
    def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def _start_local_steps(self, members: list[torch.Tensor]) -> None:
        """At the first step after ``var_freeze_step``: the errors served gradients until
        now and start again from zero for ``u``; the scaling coefficients are taken afresh
        from ``m`` (still identical on every rank); the parameters become the first
        synchronised ones."""
        if self._own_codec:
            self.codec.reset()
        if self.compresses:
            self._set_scaling_coefficients(members, "exp_avg")
        for p in members:
            self.state[p][SYNCED] = p.detach().clone()
        self.local_step_interval, self.local_step_counter = 1, 0
        self.local_steps_since_sync = 0
        self._lrs = [0.0] * len(self.param_groups)

    def _local_step(self, sync: bool) -> None:
        layout = self._layout("exp_avg", "after the first step")
        members = [p for _, ps in layout for p in ps]
        if not members:
            return
        if SYNCED not in self.state[members[0]]:
            self._start_local_steps(members)
        flat = self._fused(members, ACCUMULATOR) if self.compresses else None
        denominators = []
        for index, (group, params) in enumerate(layout):
            if not params:
                denominators.append(None)
                continue
            states = [self.state[p] for p in params]
            fold_gradients([st["exp_avg"] for st in states], self._grads(params), group["betas"][0])
            self._lrs[index] += group["lr"]
            denom = torch._foreach_sqrt([st["exp_avg_sq"] for st in states])
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div([st["exp_avg"] for st in states], denom)
            if group["weight_decay"] > 0.0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
            torch._foreach_add_([st[ACCUMULATOR] for st in states], update, alpha=-group["lr"])
            denominators.append(denom)
        self.local_steps_since_sync += 1
        if sync:
            self._synchronise(layout, denominators, flat)
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)

    def _synchronise(self, layout, denominators, flat: torch.Tensor | None) -> None:
        for (_, params), denom in zip(layout, denominators, strict=True):
            if not params:
                continue
            accumulators = [self.state[p][ACCUMULATOR] for p in params]
            torch._foreach_mul_(accumulators, denom)
            if self.compresses:
                torch._foreach_mul_(accumulators, [self.state[p]["scaling_coeff"] for p in params])
        if self.compresses:
            self._compressed_all_reduce(flat, "momentum")
        for index, ((_, params), denom) in enumerate(zip(layout, denominators, strict=True)):
            if not params:
                continue
            states = [self.state[p] for p in params]
            accumulators = [st[ACCUMULATOR] for st in states]
            if self.compresses:
                unscale(self, params, ACCUMULATOR)
            momenta = [st["exp_avg"] for st in states]
            if self._lrs[index] > 0:
                torch._foreach_copy_(momenta, accumulators)
                torch._foreach_div_(momenta, -self._lrs[index])
            else:
                torch._foreach_zero_(momenta)
            synced = [st[SYNCED] for st in states]
            torch._foreach_div_(accumulators, denom)
            torch._foreach_copy_(params, synced)
            torch._foreach_add_(params, accumulators)
            torch._foreach_copy_(synced, params)
            torch._foreach_zero_(accumulators)
            self._lrs[index] = 0.0
        self.local_steps_since_sync = 0
