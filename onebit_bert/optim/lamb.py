"""LAMB (You et al., 2019) in the form 1-bit LAMB's warmup stage uses.

Per parameter tensor ("layer") ``w`` with gradient ``g``::

    m = β1·m + (1-β1)·g
    v = β2·v + (1-β2)·g²
    u = m / (sqrt(v) + eps) + wd·w          (m/(1-β1^t), v/(1-β2^t) with bias correction)
    r = clamp(‖w‖ / ‖u‖, min_coeff, max_coeff)   (r = 1 if either norm is 0)
    w = w - lr·r·u

Bias correction is off by default, as in the BERT recipes and in 1-bit LAMB.

The step is multi-tensor either way: the reference (:func:`lamb_update`) is a dozen
``torch._foreach_*`` calls, one stacked trust-ratio computation and no per-tensor Python
loop; on CUDA (``kernels``: :mod:`onebit_bert.kernels`) the fused kernels of
:func:`onebit_bert.kernels.multi_tensor.lamb_step` do the same arithmetic in two passes
over memory.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
from torch.optim import Optimizer

from onebit_bert.kernels import check_kernels, use_fused
from onebit_bert.optim import defaults


def group_by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped so each group can go through one ``torch._foreach_*``."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype)].append(i)
    return list(groups.values())


def adam_hyperparameters(
    lr: float = defaults.LR,
    betas: tuple[float, float] = defaults.BETAS,
    eps: float = defaults.EPS,
    weight_decay: float = defaults.WEIGHT_DECAY,
    **unknown,
) -> dict:
    """The Adam-type hyperparameters every optimizer here takes (as keywords), with their
    defaults, as a param group's defaults; one clear error per bad one, before any state
    is allocated."""
    if unknown:
        raise TypeError(f"unknown optimizer argument(s): {', '.join(sorted(unknown))}")
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {tuple(betas)}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def lamb_hyperparameters(
    max_coeff: float = defaults.MAX_COEFF, min_coeff: float = defaults.MIN_COEFF, **adam
) -> dict:
    """:func:`adam_hyperparameters` and LAMB's trust-ratio bounds, checked the same way."""
    hyperparameters = adam_hyperparameters(**adam)
    if not 0.0 < min_coeff <= max_coeff:
        raise ValueError(
            f"trust-ratio bounds need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, "
            f"max_coeff={max_coeff}"
        )
    return dict(hyperparameters, max_coeff=max_coeff, min_coeff=min_coeff)


def check_params_and_grads(optimizer: Optimizer, name: str) -> None:
    """Reject parameters and gradients the optimizer cannot handle, naming the fix."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(
                    f"{name} optimises floating-point parameters only; got a {p.dtype} tensor "
                    f"of shape {tuple(p.shape)}: leave it out of the parameter list"
                )
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(
                    f"{name} does not support sparse gradients (parameter of shape "
                    f"{tuple(p.shape)}); build the embedding with sparse=False"
                )


def begin_step(optimizer: Optimizer, closure, name: str):
    """What every ``step`` here starts with: the loss of ``closure`` (evaluated with
    gradients on; None without one), then :func:`check_params_and_grads`."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    check_params_and_grads(optimizer, name)
    return loss


def groups_with_grads(optimizer: Optimizer) -> Iterator[tuple[dict, list[torch.Tensor]]]:
    """Each param group with parameters that have a gradient, and those parameters."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if params:
            yield group, params


def zero_moments(state: dict, p: torch.Tensor, *extra: str) -> bool:
    """Adam's moments ``exp_avg`` and ``exp_avg_sq`` (and each of ``extra``) at zero in
    ``state`` where it has none yet; whether it had none."""
    if "exp_avg" in state:
        return False
    for key in ("exp_avg", "exp_avg_sq", *extra):
        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def check_state_shapes(optimizer: Optimizer, state_dict: dict) -> None:
    """Refuse optimizer state whose tensors do not fit the parameters they are for
    (torch's own check compares only parameter counts)."""
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        return  # torch's load_state_dict names this mismatch itself
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        for index, param in zip(saved["params"], group["params"], strict=False):
            for key, value in state_dict["state"].get(index, {}).items():
                if key in ("exp_avg", "exp_avg_sq") and value.shape != param.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {index} has shape "
                        f"{tuple(value.shape)} but the parameter has shape "
                        f"{tuple(param.shape)}: the state belongs to a different model"
                    )


def lamb_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
    step: int,
    bias_correction: bool,
) -> torch.Tensor:
    """One LAMB step on lists of same-device, same-dtype tensors; returns the trust
    ratios ``r`` (fp32, one per tensor) without a host sync."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if bias_correction:
        torch._foreach_div_(denom, math.sqrt(1.0 - beta2**step))
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    if bias_correction:
        torch._foreach_div_(update, 1.0 - beta1**step)
    if weight_decay != 0.0:
        torch._foreach_add_(update, params, alpha=weight_decay)
    ratios = trust_ratios(params, update, min_coeff, max_coeff)
    torch._foreach_mul_(update, list((ratios * -lr).unbind(0)))
    torch._foreach_add_(params, update)
    return ratios


def lamb_group_update(
    group: dict, params: list[torch.Tensor], states: list[dict], step: int, bias_correction: bool
) -> torch.Tensor:
    """:func:`lamb_update` on ``params`` (with gradients) using their param group's
    hyperparameters and their ``exp_avg``/``exp_avg_sq`` states."""
    beta1, beta2 = group["betas"]
    return lamb_update(
        params,
        [p.grad for p in params],
        [st["exp_avg"] for st in states],
        [st["exp_avg_sq"] for st in states],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        max_coeff=group["max_coeff"],
        min_coeff=group["min_coeff"],
        step=step,
        bias_correction=bias_correction,
    )


def trust_ratios(
    params: list[torch.Tensor], updates: list[torch.Tensor], min_coeff: float, max_coeff: float
) -> torch.Tensor:
    """``clamp(‖w‖/‖u‖, min_coeff, max_coeff)`` per tensor, 1 where either norm is 0."""
    w_norm = torch.stack(torch._foreach_norm(params)).float()
    u_norm = torch.stack(torch._foreach_norm(updates)).float()
    return trust_ratios_from_norms(w_norm, u_norm, min_coeff, max_coeff)


def trust_ratios_from_norms(
    w_norm: torch.Tensor, u_norm: torch.Tensor, min_coeff: float, max_coeff: float
) -> torch.Tensor:
    """:func:`trust_ratios` from the stacked norms ``‖w‖`` and ``‖u‖`` (fp32)."""
    ratio = (w_norm / u_norm).clamp_(min_coeff, max_coeff)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


class Lamb(Optimizer):
    """Layer-wise adaptive large-batch optimizer; gradients must already be averaged.

    ``last_trust_ratios`` holds the previous step's ``r`` for every parameter that had a
    gradient, in parameter order (fp32 tensor, on the parameters' device). ``kernels``:
    the reference or the fused kernels (:mod:`onebit_bert.kernels`; ``auto``: fused on
    CUDA); a group whose tensors are not all contiguous fp32 takes the reference.
    """

    syncs_internally = False  # the caller all-reduces gradients before step()

    def __init__(
        self,
        params: Iterable,
        *,
        bias_correction: bool = defaults.BIAS_CORRECTION,
        kernels: str = "auto",
        **hyperparameters,
    ):
        """``hyperparameters``: lr, betas, eps, weight_decay, max_coeff, min_coeff
        (:func:`lamb_hyperparameters`)."""
        group_defaults = lamb_hyperparameters(**hyperparameters)
        check_kernels(kernels)
        super().__init__(params, dict(group_defaults, bias_correction=bias_correction))
        check_params_and_grads(self, "LAMB")
        self.last_trust_ratios: torch.Tensor | None = None
        self.kernels = kernels
        self._tables = None

    def set_kernels(self, kernels: str) -> None:
        """Take later steps with ``kernels`` (the state is the same for both)."""
        check_kernels(kernels)
        self.kernels = kernels

    def load_state_dict(self, state_dict: dict) -> None:
        check_state_shapes(self, state_dict)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = begin_step(self, closure, "LAMB")
        all_ratios = []
        for group, params in groups_with_grads(self):
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    zero_moments(state, p)
                state["step"] += 1
            subsets = group_by_device_and_dtype(params)
            if len(subsets) == 1:
                # The usual case, without the scatter below: its Python-list index reaches
                # the GPU through a blocking host-to-device copy, a sync on every step.
                all_ratios.append(self._update(group, params))
                continue
            group_ratios = torch.empty(len(params), device=params[0].device)
            for idx in subsets:
                ratios = self._update(group, [params[i] for i in idx])
                group_ratios[idx] = ratios.to(group_ratios.device)
            all_ratios.append(group_ratios)
        if all_ratios:
            self.last_trust_ratios = torch.cat(all_ratios)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor:
        """:func:`lamb_group_update` on same-device, same-dtype ``params`` of ``group``."""
        if use_fused(params[0].device, self.kernels):
            ratios = self._fused_update(group, params)
            if ratios is not None:
                return ratios
        return lamb_group_update(
            group,
            params,
            [self.state[p] for p in params],
            step=self.state[params[0]]["step"],
            bias_correction=group["bias_correction"],
        )

    def _fused_update(self, group: dict, params: list[torch.Tensor]) -> torch.Tensor | None:
        """:meth:`_update` in the fused kernels; None when a tensor does not fit them."""
        from onebit_bert.kernels import multi_tensor

        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [st["exp_avg"] for st in states]
        exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        if not multi_tensor.fits(params, grads, exp_avgs, exp_avg_sqs):
            return None
        if self._tables is None:
            self._tables = multi_tensor.TableCache()
        beta1, beta2 = group["betas"]
        min_coeff, max_coeff = group["min_coeff"], group["max_coeff"]
        return multi_tensor.lamb_step(
            self._tables.table(params),
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=states[0]["step"],
            bias_correction=group["bias_correction"],
            ratios_from_norms=lambda w, u: trust_ratios_from_norms(w, u, min_coeff, max_coeff),
        )
