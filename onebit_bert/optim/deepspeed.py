"""DeepSpeed optimizer configs → this project's optimizer arguments (same names; keys that
only steer DeepSpeed's engine are dropped, options it does not implement are refused)."""

from __future__ import annotations

from typing import Any

ONEBIT_LAMB_KEYS = frozenset(
    {
        "lr",
        "freeze_step",
        "betas",
        "eps",
        "weight_decay",
        "max_coeff",
        "min_coeff",
        "coeff_beta",
        "factor_max",
        "factor_min",
        "factor_threshold",
    }
)
"""DeepSpeed ``OnebitLamb`` parameters, taken one to one."""

ENGINE_ONLY_KEYS = ("cuda_aware", "comm_backend_name", "bias_correction")
"""Accepted and ignored: the communicator decides the transport, and DeepSpeed's 1-bit
LAMB ignores ``bias_correction`` too."""


def onebit_lamb_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`~onebit_bert.optim.onebit_lamb.OneBitLamb` from the
    ``params`` of a DeepSpeed ``{"type": "OneBitLamb"}`` optimizer; keys left out take the
    defaults of :mod:`onebit_bert.optim.defaults` (DeepSpeed's)."""
    config = dict(config)
    for key in ENGINE_ONLY_KEYS:
        config.pop(key, None)
    if config.pop("amsgrad", False):
        raise ValueError("1-bit LAMB has no AMSGrad variant; remove amsgrad from the config")
    if config.pop("eps_inside_sqrt", False):
        raise ValueError("1-bit LAMB adds eps outside the square root; remove eps_inside_sqrt")
    if config.pop("max_grad_norm", 0.0):
        raise ValueError(
            "clip gradients in the trainer (its gradient-clipping setting), "
            "not through the optimizer's max_grad_norm"
        )
    unknown = set(config) - ONEBIT_LAMB_KEYS
    if unknown:
        raise ValueError(
            f"unknown 1-bit LAMB option(s) {sorted(unknown)}; known: {sorted(ONEBIT_LAMB_KEYS)}"
        )
    if "betas" in config:
        config["betas"] = tuple(config["betas"])
    return config
