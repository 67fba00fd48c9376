"""Momentum SGD with decoupled weight decay (``optimizer.name: sgd``).

Per parameter tensor ``w`` with gradient ``g`` (momentum ``beta``, learning rate ``lr``,
weight decay ``wd``)::

    m = beta m + g
    w = w - lr (m + wd w)

Heavy-ball momentum without dampening, as ``torch.optim.SGD`` (``dampening=0``), but with
the weight decay decoupled from the momentum (it does not enter ``m``), as LAMB and AdamW
decay. With ``strategy.name: data_parallel`` the gradients are averaged first: parallel
momentum SGD. The decentralised strategies (``decentlam``, ``dmsgd``) do not call
:meth:`MomentumSGD.step`: they take its learning rate, momentum and per-group weight decay
and apply their own update around a neighbour exchange
(:mod:`onebit_bert.strategies.decentralized`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from onebit_bert.optim.lamb import begin_step, check_params_and_grads, groups_with_grads


class MomentumSGD(Optimizer):
    """Heavy-ball SGD, ``m = beta m + g; w = w - lr (m + wd w)``; gradients must already
    be averaged (or, in a decentralised strategy, are this rank's own)."""

    syncs_internally = False  # the caller all-reduces gradients before step()

    def __init__(
        self, params: Iterable, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
    ):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        check_params_and_grads(self, "momentum SGD")

    @torch.no_grad()
    def step(self, closure=None):
        """One step on every parameter that has a gradient."""
        loss = begin_step(self, closure, "momentum SGD")
        for group, params in groups_with_grads(self):
            buffers = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffers.append(state["momentum_buffer"])
            torch._foreach_mul_(buffers, group["momentum"])
            torch._foreach_add_(buffers, [p.grad for p in params])
            update = torch._foreach_add(buffers, params, alpha=group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-group["lr"])
        return loss
