"""``freeze_step: auto``: leave the full-precision warmup once the second moment has settled.

1-bit LAMB and 1-bit Adam freeze the second moment ``v`` at ``freeze_step`` and use it as a
fixed preconditioner from then on, so the warmup has to last until ``v`` describes the
gradients well. Both papers motivate the warmup this way (Tang et al., arXiv 2102.02888,
Sec. 3: the variance becomes stable after a number of steps; Li et al., arXiv 2104.06069);
the recipes pick a fixed share of the run (DeepSpeed's tutorial: 15-25 % of the steps).
:class:`FreezeDetector` decides instead from ``v`` itself:

* every ``window`` steps it takes the L2 norm of every layer's bias-corrected second moment
  ``v / (1 - beta2^t)`` (the optimizers apply no bias correction, but without it ``v``
  grows from zero like ``1 - beta2^t`` for gradients of constant size, and with beta2 =
  0.999 no layer could look settled before about step 1,170 of any run), and the statistic
  ``max over layers of |‖v_l‖ - ‖v_l‖ one window earlier| / ‖v_l‖ one window earlier``;
* a check whose statistic is below ``threshold`` is *calm*; ``patience`` calm checks in a
  row allow the freeze;
* the freeze happens at the first check that allows it at or after ``min_step``, and at
  ``max_step`` at the latest. The step it happens at is the last warmup step (what a fixed
  ``freeze_step`` would have been).

The decision is the same on every rank without any communication: in the warmup every rank
folds the same all-reduced gradient into ``v`` with the same operations, so ``v`` (and every
norm computed from it) is bit-identical across ranks, as the parameters are. The detector's
state is shared checkpoint state, so a resumed run makes the same decision at the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AUTO = "auto"
"""The ``freeze_step`` value that hands the decision to :class:`FreezeDetector`."""


@dataclass
class AutoFreezeConfig:
    """When ``freeze_step: auto`` ends the warmup (1-bit LAMB and 1-bit Adam).

    The statistic is computed on ``v / (1 - beta2^t)``: it moves when the gradients' size
    moves, not because ``v`` fills up from zero (``bias_corrected: false`` uses ``v``
    itself, which with beta2 = 0.999 changes by more than 5 % per 100 steps until about
    step 1,170 even for gradients of constant size).
    """

    window: int = 100
    """Steps between two checks; the relative change of each layer's ``‖v‖`` is measured
    over this many steps."""
    threshold: float = 0.05
    """A check is calm when every layer's ``‖v‖`` changed by less than this fraction over
    the window."""
    patience: int = 3
    """Calm checks in a row needed before the warmup may end."""
    min_fraction: float = 0.05
    """Never end the warmup before this fraction of ``schedule.max_steps`` (counted in the
    optimizer's own steps)."""
    max_fraction: float = 0.25
    """End the warmup at this fraction of ``schedule.max_steps`` at the latest, calm or
    not (the top of the 15-25 % range the recipes use)."""
    bias_corrected: bool = True
    """Measure ``v / (1 - beta2^t)`` (true) or ``v`` itself (false)."""

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(
                f"auto_freeze.window must be a whole number of steps >= 1, got {self.window!r}"
            )
        if not self.threshold > 0:
            raise ValueError(
                f"auto_freeze.threshold must be > 0 (a relative change, e.g. 0.05), "
                f"got {self.threshold}"
            )
        if isinstance(self.patience, bool) or not isinstance(self.patience, int):
            raise ValueError(f"auto_freeze.patience must be an integer, got {self.patience!r}")
        if self.patience < 1:
            raise ValueError(f"auto_freeze.patience must be >= 1, got {self.patience}")
        if not 0.0 <= self.min_fraction <= self.max_fraction <= 1.0:
            raise ValueError(
                f"auto_freeze needs 0 <= min_fraction <= max_fraction <= 1, got "
                f"min_fraction={self.min_fraction}, max_fraction={self.max_fraction}"
            )

    def detector(self, total_steps: int | None) -> FreezeDetector:
        """A detector for a run of ``total_steps`` optimizer steps."""
        if total_steps is None or total_steps < 1:
            raise ValueError(
                "freeze_step auto needs the run's length to bound the warmup "
                "(build the optimizer with total_steps=schedule.max_steps), or set "
                "freeze_step to a number of steps"
            )
        min_step = max(1, math.ceil(self.min_fraction * total_steps))
        max_step = max(min_step, math.floor(self.max_fraction * total_steps))
        return FreezeDetector(
            self.window, self.threshold, self.patience, min_step, max_step, self.bias_corrected
        )


class FreezeDetector:
    """Chooses the last warmup step from the per-layer norms of ``v`` (module docstring).

    After each :meth:`observe`: ``statistic`` (the last check's largest relative change,
    None before the second check), ``calm`` (calm checks in a row) and ``freeze_step``
    (the chosen step, None until chosen).
    """

    def __init__(
        self,
        window: int,
        threshold: float,
        patience: int,
        min_step: int,
        max_step: int,
        bias_corrected: bool = False,
    ):
        if not 1 <= min_step <= max_step:
            raise ValueError(f"need 1 <= min_step <= max_step, got {min_step}, {max_step}")
        self.window = window
        self.threshold = threshold
        self.patience = patience
        self.min_step = min_step
        self.max_step = max_step
        self.bias_corrected = bias_corrected
        self.previous: torch.Tensor | None = None
        self.statistic: float | None = None
        self.calm = 0
        self.freeze_step: int | None = None

    def observe(self, step: int, exp_avg_sqs: list[torch.Tensor], beta2: float = 0.0) -> bool:
        """Look at ``v`` after warmup step ``step`` (``beta2``: its rate, for the bias
        correction); True when ``step`` is the last warmup step. Costs one host sync every
        ``window`` steps."""
        if self.freeze_step is not None:
            return step == self.freeze_step
        if step % self.window == 0 and exp_avg_sqs:
            norms = torch.stack(torch._foreach_norm(exp_avg_sqs)).float().cpu()
            if self.bias_corrected and 0.0 < beta2 < 1.0:
                norms = norms / (1.0 - beta2**step)
            if self.previous is not None and self.previous.numel() == norms.numel():
                # a layer that stayed at zero did not move; one that left zero moved infinitely
                from_zero = torch.where(norms > 0, math.inf, 0.0)
                change = torch.where(
                    self.previous > 0,
                    (norms - self.previous).abs() / self.previous.clamp_min(1e-38),
                    from_zero,
                )
                self.statistic = float(change.max())
                self.calm = self.calm + 1 if self.statistic < self.threshold else 0
            self.previous = norms
            if self.calm >= self.patience and step >= self.min_step:
                self.freeze_step = step
        if self.freeze_step is None and step >= self.max_step:
            self.freeze_step = step
        return self.freeze_step == step

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "threshold": self.threshold,
            "patience": self.patience,
            "min_step": self.min_step,
            "max_step": self.max_step,
            "bias_corrected": self.bias_corrected,
            "previous": None if self.previous is None else self.previous.clone(),
            "statistic": self.statistic,
            "calm": self.calm,
            "freeze_step": self.freeze_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved detector's history (its norms, calm count and decision).
        The bounds and thresholds stay this run's own."""
        self.previous = state["previous"]
        self.statistic = state["statistic"]
        self.calm = int(state["calm"])
        self.freeze_step = state["freeze_step"]
