"""1-bit LAMB (Li et al., 2021): LAMB whose momentum is synchronised with 1-bit compression.

Steps ``1 .. freeze_step`` (warmup) are exactly LAMB on gradients the caller has averaged,
while recording an EMA ``c`` of every layer's trust ratio. At ``freeze_step`` the second
moment ``v`` freezes and a "fresh" copy starts. From then on (compression) the caller
does NOT all-reduce gradients (``syncs_internally`` is True): each rank folds its local
gradient into its momentum, and the momenta of all layers are averaged with one
error-compensated 1-bit all-reduce. Each layer's step is ``lr · c · f · u`` where the
factor ``f`` tracks how far the fresh second moment has drifted from the frozen one.

Hyperparameter names match DeepSpeed's ``OneBitLamb`` so its JSON config maps one to one
(:meth:`OneBitLamb.from_deepspeed_config`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebit_bert.distributed.comm import Communicator
from onebit_bert.distributed.compression import ErrorFeedback, padded_size
from onebit_bert.optim import defaults
from onebit_bert.optim.deepspeed import onebit_lamb_kwargs
from onebit_bert.optim.lamb import (
    check_lamb_hyperparameters,
    check_params_and_grads,
    check_state_shapes,
    lamb_group_update,
)

NAME = "1-bit LAMB"


class OneBitLamb(Optimizer):
    """1-bit LAMB over the ranks of ``comm`` (default: the default process group, or a
    world of one when none exists).

    Args:
        lr, betas, eps, weight_decay: as in LAMB (decoupled weight decay).
        freeze_step: last step of the warmup stage (>= 1).
        max_coeff, min_coeff: bounds of the warmup trust ratio.
        coeff_beta: EMA rate of the recorded trust ratio ``c``.
        factor_max, factor_min: bounds of the compression-stage factor ``f``.
        factor_threshold: largest relative change of ``f`` from one step to the next.
        comm: the :class:`Communicator` whose ranks share this model.
        bucket_numel: compress the momentum in buckets of at most this many elements
            (bounds the temporary memory of one all-reduce); ``None``: one bucket.

    After each step: ``stage`` ("warmup" or "compression"), ``last_trust_ratios`` (``r``
    in warmup, ``c·f`` in compression, one per layer), ``last_factors`` (``f``, or None in
    warmup), ``last_compression_error`` (‖this rank's worker error‖ / ‖the scaled momentum
    it compressed‖, or None in warmup), ``last_step_bytes`` and ``bytes_sent`` (this
    optimizer's traffic from this rank).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = defaults.LR,
        freeze_step: int = defaults.FREEZE_STEP,
        betas: tuple[float, float] = defaults.BETAS,
        eps: float = defaults.EPS,
        weight_decay: float = defaults.WEIGHT_DECAY,
        max_coeff: float = defaults.MAX_COEFF,
        min_coeff: float = defaults.MIN_COEFF,
        coeff_beta: float = defaults.COEFF_BETA,
        factor_max: float = defaults.FACTOR_MAX,
        factor_min: float = defaults.FACTOR_MIN,
        factor_threshold: float = defaults.FACTOR_THRESHOLD,
        comm: Communicator | None = None,
        bucket_numel: int | None = None,
    ):
        check_lamb_hyperparameters(lr, betas, eps, weight_decay, max_coeff, min_coeff)
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be an integer >= 1 (the last warmup step), got {freeze_step!r}"
            )
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(
                f"factor bounds need 0 < factor_min <= factor_max, got factor_min={factor_min}, "
                f"factor_max={factor_max}"
            )
        if not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"factor_threshold must be in [0, 1), got {factor_threshold}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive element count, got {bucket_numel}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults)
        check_params_and_grads(self, NAME)
        self._check_single_fp32_device()
        self.freeze_step = freeze_step
        self.bucket_numel = bucket_numel
        if comm is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            comm = Communicator(group=group, device=self._device)
        self.comm = comm
        self._step = 0
        # Masks describe this run (e.g. the phase's sequence length), not its history, so
        # they are kept out of the state dict: a phase-2 run loading phase-1 state sets its own.
        self._masks: dict[torch.Tensor, torch.Tensor] = {}
        self._feedback: ErrorFeedback | None = None
        self._flat: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self.last_trust_ratios: torch.Tensor | None = None
        self.last_factors: torch.Tensor | None = None
        self.last_compression_error: torch.Tensor | None = None
        self.last_step_bytes = 0
        self.bytes_sent = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_deepspeed_config(
        cls,
        params: Iterable,
        config: dict[str, Any],
        comm: Communicator | None = None,
        bucket_numel: int | None = None,
    ) -> OneBitLamb:
        """Build from the ``params`` of a DeepSpeed ``{"type": "OneBitLamb"}`` optimizer
        (see :func:`onebit_bert.optim.deepspeed.onebit_lamb_kwargs` for what is accepted)."""
        kwargs = onebit_lamb_kwargs(config)
        return cls(params, comm=comm, bucket_numel=bucket_numel, **kwargs)

    def _check_single_fp32_device(self) -> None:
        devices = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"{NAME} keeps fp32 master weights; got a {p.dtype} parameter of shape "
                        f"{tuple(p.shape)}. Keep parameters in fp32 and use autocast for "
                        f"bf16/fp16 compute"
                    )
                devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(
                f"{NAME} needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        self._device = devices.pop() if devices else torch.device("cpu")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._flat = None  # the momentum layout changed

    # ------------------------------------------------------------------ public state
    @property
    def syncs_internally(self) -> bool:
        """True when the next ``step()`` averages across ranks by itself: the caller must
        then skip its own gradient all-reduce and pass local (micro-batch averaged)
        gradients."""
        return self._step + 1 > self.freeze_step

    @property
    def stage(self) -> str:
        """Stage of the last step taken ("warmup" before the first one)."""
        return "warmup" if self._step <= self.freeze_step else "compression"

    @property
    def step_count(self) -> int:
        return self._step

    def set_momentum_mask(self, param: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Zero the momentum of ``param`` where ``mask`` is 0, after every compressed
        all-reduce (rows that never train, such as position embeddings beyond the
        current sequence length, would otherwise pick up compression noise).
        ``mask`` broadcasts to the parameter's shape; ``None`` removes it. Masks are not
        part of :meth:`state_dict`: set them again after building the optimizer."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("set_momentum_mask: the tensor is not a parameter of this optimizer")
        if mask is None:
            self._masks.pop(param, None)
            return
        try:
            fits = torch.broadcast_shapes(mask.shape, param.shape) == param.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"momentum mask of shape {tuple(mask.shape)} does not broadcast to the "
                f"parameter's shape {tuple(param.shape)}"
            )
        mask = mask.detach().to(device=param.device, dtype=torch.float32)
        if not torch.all((mask == 0) | (mask == 1)):
            raise ValueError("a momentum mask holds only 0 (masked) and 1 (kept)")
        self._masks[param] = mask

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly. The part that differs between ranks (this
        rank's compression errors) is under ``"per_rank"``: a checkpoint can store the rest
        once and only that part per rank."""
        state = super().state_dict()
        state["onebit"] = {"step": self._step, "freeze_step": self.freeze_step}
        state["per_rank"] = {
            "error_feedback": None if self._feedback is None else self._feedback.state_dict(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`. Compression errors saved under a
        different world size (or by another rank), or missing, start from zero (with a
        warning when the run is already compressing)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        per_rank = state_dict.pop("per_rank", None) or {}
        if extra is None:
            raise ValueError(
                "this optimizer state has no 1-bit LAMB section; it was saved by another "
                "optimizer (load LAMB states into LAMB)"
            )
        check_state_shapes(self, state_dict)
        super().load_state_dict(state_dict)
        self._step = int(extra["step"])
        self._flat = None
        self._feedback = None
        saved = per_rank.get("error_feedback")
        if saved is None and self._step > self.freeze_step:
            warnings.warn(
                f"1-bit LAMB state at step {self._step} has no compression errors for this "
                f"rank; starting them from zero",
                stacklevel=2,
            )
        if saved is not None:
            self._feedback = ErrorFeedback(
                saved["numel"],
                self.comm.world_size,
                rank=self.comm.rank,
                device=self._device,
                bucket_numel=self.bucket_numel,
            )
            self._feedback.load_state_dict(saved)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_params_and_grads(self, NAME)
        self._step += 1
        if self._step <= self.freeze_step:
            self._warmup_step()
        else:
            self._compression_step()
        return loss

    def _warmup_step(self) -> None:
        ratios = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["lamb_coeff"] = torch.zeros((), device=p.device)
            r = lamb_group_update(
                group, params, [self.state[p] for p in params], self._step, bias_correction=False
            )
            coeffs = [self.state[p]["lamb_coeff"] for p in params]
            c = torch.stack(coeffs)
            cb = group["coeff_beta"]
            torch._foreach_copy_(coeffs, list(torch.where(r != 1.0, cb * c + (1 - cb) * r, c)))
            if self._step == self.freeze_step:
                for p in params:
                    self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()
            ratios.append(r)
        self.last_trust_ratios = torch.cat(ratios) if ratios else None
        self.last_factors = None
        self.last_compression_error = None
        self.last_step_bytes = 0

    def _layout(self) -> list[tuple[dict, list[torch.Tensor]]]:
        """Per group, the parameters that take part in the compressed all-reduce: every
        parameter that has optimizer state (the same set on every rank)."""
        layout = []
        for group in self.param_groups:
            members = []
            for p in group["params"]:
                if "exp_avg" in self.state[p]:
                    members.append(p)
                elif p.grad is not None:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(p.shape)} received its first gradient "
                        f"after freeze_step={self.freeze_step}; every trained parameter must "
                        f"receive gradients during the warmup stage"
                    )
            layout.append((group, members))
        return layout

    def _flat_momentum(self, params: list[torch.Tensor]) -> torch.Tensor:
        """One zero-padded fp32 buffer whose slices are the ``exp_avg`` states, so the
        compressed all-reduce works in place. Rebuilt after loading a state dict."""
        numel = sum(p.numel() for p in params)
        flat = self._flat
        if flat is not None:
            offset = 0
            for p in params:
                m = self.state[p]["exp_avg"]
                if m.data_ptr() != flat.data_ptr() + 4 * offset:
                    flat = None
                    break
                offset += p.numel()
            if offset != numel:
                flat = None
        if flat is None:
            flat = torch.zeros(padded_size(numel, self.comm.world_size), device=self._device)
            for p, view in zip(params, self._views(flat, params, 0), strict=True):
                view.copy_(self.state[p]["exp_avg"])
                self.state[p]["exp_avg"] = view
            self._flat = flat
            self._scratch = torch.empty_like(flat)
        if self._feedback is None:
            self._feedback = ErrorFeedback(
                numel,
                self.comm.world_size,
                rank=self.comm.rank,
                device=self._device,
                bucket_numel=self.bucket_numel,
            )
        elif self._feedback.numel != numel:
            raise ValueError(
                f"saved compression errors cover {self._feedback.numel} elements but the "
                f"momentum has {numel}: the optimizer state belongs to a different model"
            )
        return flat

    @staticmethod
    def _views(buffer: torch.Tensor, params: list[torch.Tensor], start: int) -> list:
        """Slices of ``buffer`` from ``start`` on, shaped like ``params`` one after another."""
        views, offset = [], start
        for p in params:
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _compression_step(self) -> None:
        layout = self._layout()
        members = [p for _, ps in layout for p in ps]
        if not members:
            return
        flat = self._flat_momentum(members)
        for p in members:
            st = self.state[p]
            if "exp_avg_sq_fresh" not in st:  # freeze_step moved past a saved run's step
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
        if "scaling_coeff" not in self.state[members[0]]:
            self._set_scaling_coefficients(members)

        previous = self._scratch
        previous.copy_(flat)
        for group, params in layout:
            if not params:
                continue
            beta1 = group["betas"][0]
            momenta = [self.state[p]["exp_avg"] for p in params]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            torch._foreach_mul_(momenta, beta1)
            torch._foreach_add_(momenta, grads, alpha=1.0 - beta1)
            torch._foreach_mul_(momenta, [self.state[p]["scaling_coeff"] for p in params])

        momentum_norm = torch.linalg.vector_norm(flat)
        before = self.comm.snapshot()
        with self.comm.traffic("momentum"):
            self.comm.compressed_all_reduce(flat, self._feedback)
        # What 1-bit rounding left out on this rank, relative to what it was asked to send.
        self.last_compression_error = torch.linalg.vector_norm(
            self._feedback.worker_error
        ) / momentum_norm.clamp_min(1e-30)
        self.last_step_bytes = (self.comm.snapshot() - before).bytes_sent
        self.bytes_sent += self.last_step_bytes

        ratios, factors, offset = [], [], 0
        for group, params in layout:
            if not params:
                continue
            factor, trust = self._compressed_update(group, params, previous, offset)
            factors.append(factor)
            ratios.append(trust)
            offset += sum(p.numel() for p in params)
        self.last_factors = torch.cat(factors)
        self.last_trust_ratios = torch.cat(ratios)

    def _set_scaling_coefficients(self, params: list[torch.Tensor]) -> None:
        # Momenta are identical on all ranks here (warmup averaged the gradients), so every
        # rank derives the same scales without communicating. A layer with zero momentum
        # gets scale 1 instead of inf.
        rms = torch.stack(
            [
                torch.linalg.vector_norm(self.state[p]["exp_avg"]) / math.sqrt(p.numel())
                for p in params
            ]
        )
        scales = torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))
        for p, s in zip(params, scales.unbind(0), strict=True):
            self.state[p]["scaling_coeff"] = s.clone()
            self.state[p].setdefault("last_factor", torch.ones((), device=p.device))

    def _compressed_update(self, group, params, previous, offset):
        beta1, beta2 = group["betas"]
        eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
        states = [self.state[p] for p in params]
        momenta = [st["exp_avg"] for st in states]
        torch._foreach_div_(momenta, [st["scaling_coeff"] for st in states])
        for p, st in zip(params, states, strict=True):
            mask = self._masks.get(p)
            if mask is not None:
                st["exp_avg"].mul_(mask)
        # Reconstructed global gradient g~ = (m - β1·m_prev) / (1-β1), in the scratch buffer.
        grad_est = self._views(previous, params, offset)
        torch._foreach_mul_(grad_est, -beta1)
        torch._foreach_add_(grad_est, momenta)
        torch._foreach_div_(grad_est, 1.0 - beta1)
        fresh = [st["exp_avg_sq_fresh"] for st in states]
        torch._foreach_mul_(fresh, beta2)
        torch._foreach_addcmul_(fresh, grad_est, grad_est, value=1.0 - beta2)

        denom = torch._foreach_sqrt([st["exp_avg_sq"] for st in states])
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(momenta, denom)
        denom_fresh = torch._foreach_sqrt(fresh)
        torch._foreach_add_(denom_fresh, eps)
        torch._foreach_div_(denom, denom_fresh)  # denom now holds the per-element drift
        del denom_fresh
        factor = torch.stack(torch._foreach_max(denom)).float()
        del denom
        if wd != 0.0:
            norm_plain = torch.stack(torch._foreach_norm(update)).float()
            torch._foreach_add_(update, params, alpha=wd)
            norm_decayed = torch.stack(torch._foreach_norm(update)).float()
            rho = torch.where(
                norm_decayed > 0,
                (norm_plain / norm_decayed).clamp(max=1.0),
                torch.ones_like(norm_plain),
            )
            factor = factor * rho + (1.0 - rho)
        factor = factor.clamp(group["factor_min"], group["factor_max"])
        last = torch.stack([st["last_factor"] for st in states])
        threshold = group["factor_threshold"]
        factor = torch.minimum(
            torch.maximum(factor, last * (1.0 - threshold)), last * (1.0 + threshold)
        )
        torch._foreach_copy_([st["last_factor"] for st in states], list(factor.unbind(0)))
        trust = torch.stack([st["lamb_coeff"] for st in states]) * factor
        torch._foreach_mul_(update, list((trust * -lr).unbind(0)))
        torch._foreach_add_(params, update)
        return factor, trust
