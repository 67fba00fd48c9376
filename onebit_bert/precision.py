"""Mixed precision: autocast for compute, fp32 master weights, fp16 loss scaling.

``bf16`` (the default on GPUs that support it) needs no loss scaling. ``fp16`` scales the
loss dynamically; whether any rank's gradients overflowed is all-reduced (MAX) before the
optimizer step, so every rank skips the same steps even when gradients are local (1-bit
LAMB's compression stage). ``fp32`` is the CPU path.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

from onebit_bert.distributed.comm import Communicator

Mode = Literal["auto", "fp32", "bf16", "fp16"]


def resolve_precision(mode: Mode, device: torch.device) -> str:
    """``auto``: bf16 on a GPU that has it, fp16 on an older GPU, fp32 on CPU."""
    if mode != "auto":
        if mode in ("bf16", "fp16") and device.type != "cuda":
            raise ValueError(f"precision {mode} needs a GPU; use fp32 (or auto) on {device.type}")
        return mode
    if device.type != "cuda":
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scale for fp16 (a no-op with scale 1 for bf16/fp32).

    Usage per step: ``scaled(loss).backward()``; after gradients are complete,
    ``ok = unscale_and_check(params)``; step only if ``ok``; then ``update(ok)``.
    """

    def __init__(
        self,
        precision: str,
        comm: Communicator,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
    ):
        self.enabled = precision == "fp16"
        if self.enabled and not init_scale >= 1.0:
            raise ValueError(f"the initial loss scale must be >= 1, got {init_scale}")
        self.comm = comm
        self.scale = init_scale if self.enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped_steps = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale_and_check(self, params: list[torch.Tensor]) -> bool:
        """Divide gradients by the scale; True if every rank's gradients are finite."""
        if not self.enabled:
            return True
        grads = [p.grad for p in params if p.grad is not None]
        bad = torch.zeros(1, device=grads[0].device if grads else self.comm.device)
        if grads:
            # One fused pass (torch.amp's own kernel) multiplies by 1/scale and flags any
            # inf/NaN: a few kernels for all gradients instead of three per tensor. The
            # product is the one torch._foreach_mul_ gives (both round x * float32(1/scale)
            # once); the flag looks at the gradients before the multiply, the same verdict
            # because the scale stays >= 1 (so a finite gradient stays finite).
            inv_scale = torch.full((1,), 1.0 / self.scale, device=bad.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, bad, inv_scale)
        bad = bad.to(self.comm.device)
        self.comm.all_reduce(bad, op="max")
        return bad.item() == 0.0

    def update(self, ok: bool) -> None:
        if not self.enabled:
            return
        if ok:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.skipped_steps += 1
            self.good_steps = 0
            self.scale = max(self.scale / 2.0, 1.0)

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]
