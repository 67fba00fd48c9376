"""DeepSpeed optimizer configs → this project's optimizer arguments (same names; keys that
only steer DeepSpeed's engine are dropped, options it does not implement are refused)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

ADAM_KEYS = frozenset({"lr", "betas", "eps", "weight_decay"})

ONEBIT_LAMB_KEYS = ADAM_KEYS | {
    "freeze_step",
    "max_coeff",
    "min_coeff",
    "coeff_beta",
    "factor_max",
    "factor_min",
    "factor_threshold",
}
"""DeepSpeed ``OnebitLamb`` parameters, taken one to one."""

ONEBIT_ADAM_KEYS = ADAM_KEYS | {"freeze_step"}
"""DeepSpeed ``OnebitAdam`` parameters, taken one to one."""

ZERO_ONE_ADAM_KEYS = ADAM_KEYS | {
    "var_freeze_step",
    "var_update_scaler",
    "local_step_scaler",
    "local_step_clipper",
}
"""DeepSpeed ``ZeroOneAdam`` parameters, taken one to one."""

ENGINE_ONLY_KEYS = ("cuda_aware", "comm_backend_name", "bias_correction")
"""Accepted and ignored: the communicator decides the transport, and DeepSpeed's 1-bit
optimizers ignore ``bias_correction`` too (none of them corrects the bias)."""


def _kwargs(config: dict[str, Any], name: str, keys: frozenset[str]) -> dict[str, Any]:
    config = dict(config)
    for key in ENGINE_ONLY_KEYS:
        config.pop(key, None)
    if config.pop("amsgrad", False):
        raise ValueError(f"{name} has no AMSGrad variant; remove amsgrad from the config")
    if config.pop("eps_inside_sqrt", False):
        raise ValueError(f"{name} adds eps outside the square root; remove eps_inside_sqrt")
    if config.pop("max_grad_norm", 0.0):
        raise ValueError(
            "clip gradients in the trainer (its gradient-clipping setting), "
            "not through the optimizer's max_grad_norm"
        )
    unknown = set(config) - keys
    if unknown:
        raise ValueError(f"unknown {name} option(s) {sorted(unknown)}; known: {sorted(keys)}")
    if "betas" in config:
        config["betas"] = tuple(config["betas"])
    return config


def onebit_lamb_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`~onebit_bert.optim.onebit_lamb.OneBitLamb` from the
    ``params`` of a DeepSpeed ``{"type": "OneBitLamb"}`` optimizer; keys left out take the
    defaults of :mod:`onebit_bert.optim.defaults` (DeepSpeed's)."""
    return _kwargs(config, "1-bit LAMB", ONEBIT_LAMB_KEYS)


def onebit_adam_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`~onebit_bert.optim.onebit_adam.OneBitAdam` from the
    ``params`` of a DeepSpeed ``{"type": "OneBitAdam"}`` optimizer (DeepSpeed's defaults
    for the keys left out)."""
    return _kwargs(config, "1-bit Adam", ONEBIT_ADAM_KEYS)


def zero_one_adam_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`~onebit_bert.optim.zero_one_adam.ZeroOneAdam` from the
    ``params`` of a DeepSpeed ``{"type": "ZeroOneAdam"}`` optimizer (DeepSpeed's defaults
    for the keys left out)."""
    return _kwargs(config, "0/1 Adam", ZERO_ONE_ADAM_KEYS)


class FromDeepSpeed:
    """``from_deepspeed_config`` for an optimizer whose :attr:`deepspeed_kwargs` (one of
    the functions above) maps a DeepSpeed optimizer's ``params`` to its own arguments."""

    deepspeed_kwargs: Callable[[dict[str, Any]], dict[str, Any]]

    @classmethod
    def from_deepspeed_config(
        cls, params: Iterable, config: dict[str, Any], comm=None, bucket_numel=None
    ):
        """Build from the ``params`` of the DeepSpeed optimizer's config (its
        :attr:`deepspeed_kwargs` says what is accepted), over ``comm``'s ranks."""
        return cls(params, comm=comm, bucket_numel=bucket_numel, **cls.deepspeed_kwargs(config))
