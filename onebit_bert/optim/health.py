"""A cheap health check after every optimizer step, for scripts that have no divergence
guard of their own (the pretraining loop has one: ``divergence.max_bad_steps``).

:func:`watch_health` registers a step post-hook on any ``torch.optim.Optimizer`` (LAMB,
AdamW, the 1-bit ones) that, after each step, checks

- that the parameters are finite (a non-finite update makes them so, and they stay so):
  one fused norm over the parameters and one read of it on the host per step;
- for an optimizer that reports ``last_compression_error`` (‖this rank's worker error‖ /
  ‖what it compressed‖; 1-bit LAMB, 1-bit Adam, 0/1 Adam), that it has not stayed above
  ``max_compression_error`` for ``patience`` steps in a row: the compressed all-reduce
  has stopped tracking what it sends. Sign compression with a mean-magnitude scale
  leaves out less than what it compresses (``√(1 − 2/π) ≈ 0.6`` of a Gaussian vector;
  0.7–0.9 in the tiny BERT runs of the tests), but the error it carries is measured
  against the momentum alone: a carried error larger than the momentum, step after step,
  is error feedback outgrowing what it corrects.

On a problem it warns (``action="warn"``, once per run of bad steps) or raises
:class:`OptimizerHealthError` (``action="raise"``). The check reads only this rank's
numbers: ranks may disagree about the compression error; a non-finite parameter is on
every rank within a step in data parallel training.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

ACTIONS = ("warn", "raise")


class OptimizerHealthError(RuntimeError):
    """Raised by :func:`watch_health` with ``action="raise"``."""


@dataclass
class HealthConfig:
    """What :func:`watch_health` checks after each step and what it does about a problem."""

    max_compression_error: float = 1.0
    """The largest healthy ``last_compression_error`` (‖worker error‖ / ‖momentum‖; 0.6
    to 0.9 in healthy 1-bit runs); None: not checked."""
    patience: int = 10
    """How many consecutive steps above ``max_compression_error`` make a problem (a
    non-finite parameter is one at once)."""
    check_finite: bool = True
    """Check that the parameters are finite after every step."""
    action: str = "warn"
    """``warn``: a warning per run of bad steps; ``raise``: :class:`OptimizerHealthError`."""

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"health action must be one of {ACTIONS}, got {self.action!r}")
        if self.patience < 1:
            raise ValueError(f"health patience must be >= 1 step, got {self.patience}")
        bound = self.max_compression_error
        if bound is not None and not (math.isfinite(bound) and bound > 0):
            raise ValueError(
                f"max_compression_error must be a positive number (or None to skip the "
                f"check), got {bound}"
            )


class HealthCheck:
    """The check :func:`watch_health` registered: ``steps`` checked, ``bad_steps`` (the
    current run of steps over the compression-error bound), ``problems`` (every problem
    found, in order); :meth:`remove` unregisters it."""

    def __init__(self, optimizer, config: HealthConfig):
        self.optimizer = optimizer
        self.config = config
        self.steps = 0
        self.bad_steps = 0
        self.problems: list[str] = []
        self._reported_nonfinite = False
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def remove(self) -> None:
        self._handle.remove()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _after_step(self, *_args) -> None:
        self.steps += 1
        step = getattr(self.optimizer, "step_count", self.steps)
        cfg = self.config
        name = getattr(self.optimizer, "NAME", type(self.optimizer).__name__)
        if cfg.check_finite and not self._reported_nonfinite:
            params = self._params()
            norms = [n.to(params[0].device) for n in torch._foreach_norm(params)]
            norm = torch.linalg.vector_norm(torch.stack(norms))
            if not torch.isfinite(norm).item():
                self._reported_nonfinite = True  # they stay non-finite: report once
                self._problem(
                    f"{name}: non-finite parameters after step {step} (the update was "
                    f"inf or NaN); lower the learning rate, or check the loss and gradients "
                    f"for inf/NaN before the step"
                )
        error = getattr(self.optimizer, "last_compression_error", None)
        if cfg.max_compression_error is None or error is None:
            self.bad_steps = 0
            return
        value = float(error)
        if value > cfg.max_compression_error or not math.isfinite(value):
            self.bad_steps += 1
        else:
            self.bad_steps = 0
        if self.bad_steps == cfg.patience:
            self._problem(
                f"{name}: compression error {value:.3g} above {cfg.max_compression_error} "
                f"for {cfg.patience} steps in a row (step {step}); the compressed "
                f"all-reduce no longer tracks the momentum: lower the learning rate or "
                f"start compressing later (a larger freeze_step)"
            )

    def _problem(self, message: str) -> None:
        self.problems.append(message)
        if self.config.action == "raise":
            raise OptimizerHealthError(message)
        warnings.warn(message, stacklevel=4)


def watch_health(optimizer, config: HealthConfig | None = None) -> HealthCheck:
    """Check ``optimizer`` after each of its steps (module docstring); returns the check,
    whose :meth:`HealthCheck.remove` stops it."""
    return HealthCheck(optimizer, config or HealthConfig())
