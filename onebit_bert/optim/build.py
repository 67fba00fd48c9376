"""Optimizer settings and the one place that turns them into an optimizer.

Sync strategies (:mod:`onebit_bert.strategies`) call :func:`build_optimizer`; the training
loop only talks to the strategy, never to the optimizer's type.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import check_kernels
from onebit_bert.optim import defaults
from onebit_bert.optim.auto_freeze import AUTO, AutoFreezeConfig
from onebit_bert.optim.lamb import Lamb
from onebit_bert.optim.onebit_adam import OneBitAdam
from onebit_bert.optim.onebit_lamb import OneBitLamb
from onebit_bert.optim.registry import (
    OptimizerBuild,
    OptimizerSpec,
    freezing_optimizers,
    optimizer_spec,
    register_optimizer,
)
from onebit_bert.optim.sgd import MomentumSGD
from onebit_bert.optim.surface import SelfSyncingOptimizer
from onebit_bert.optim.zero_one_adam import ZeroOneAdam

NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight")


@dataclass
class OptimizerConfig:
    """Which optimizer, and its hyperparameters (DeepSpeed's names and defaults for 1-bit
    LAMB, 1-bit Adam and 0/1 Adam, from :mod:`onebit_bert.optim.defaults`)."""

    name: str = "lamb"
    """lamb, onebit_lamb (1-bit LAMB), onebit_adam (1-bit Adam), zero_one_adam (0/1 Adam),
    adamw, or sgd: momentum SGD with decoupled weight decay (m = betas[0] m + g; w = w - lr
    (m + weight_decay w)), the base update that strategy.name decentlam and dmsgd
    require. Further optimizers join through the registry
    (:mod:`onebit_bert.optim.registry`), which checks the name."""
    lr: float = defaults.LR
    """Peak learning rate (the schedule scales it)."""
    betas: tuple[float, float] = defaults.BETAS
    """Adam-type moment rates (beta1, beta2); sgd takes its momentum from beta1 and ignores
    beta2."""
    eps: float = defaults.EPS
    """Added outside the square root (BERT recipes: 1e-6)."""
    weight_decay: float = defaults.WEIGHT_DECAY
    """Decoupled weight decay, not applied to biases and LayerNorm weights (BERT: 0.01)."""
    max_coeff: float = defaults.MAX_COEFF
    """LAMB trust-ratio upper bound (BERT recipes: 0.3)."""
    min_coeff: float = defaults.MIN_COEFF
    """LAMB trust-ratio lower bound."""
    bias_correction: bool = defaults.BIAS_CORRECTION
    """LAMB, and 1-bit Adam (Adam's correction, the second moment's frozen at freeze_step:
    a deviation from DeepSpeed that gives its compression stage AdamW's step size at the
    same lr); 1-bit LAMB and 0/1 Adam have none, torch's AdamW always has it."""
    freeze_step: int | Literal["auto"] = defaults.FREEZE_STEP
    """1-bit LAMB and 1-bit Adam: last step of the full-precision warmup stage (recipes:
    15-25 % of the steps), or auto: end it once every layer's second moment has settled
    (optimizer.auto_freeze)."""
    auto_freeze: AutoFreezeConfig = field(default_factory=AutoFreezeConfig)
    """freeze_step auto: how the end of the warmup is detected."""
    coeff_beta: float = defaults.COEFF_BETA
    """1-bit LAMB: EMA rate of the recorded trust ratio."""
    factor_max: float = defaults.FACTOR_MAX
    """1-bit LAMB: upper bound of the compression-stage factor."""
    factor_min: float = defaults.FACTOR_MIN
    """1-bit LAMB: lower bound of the compression-stage factor."""
    factor_threshold: float = defaults.FACTOR_THRESHOLD
    """1-bit LAMB: largest relative change of the factor between steps."""
    coeff_refresh: int = 0
    """1-bit LAMB, beyond the paper (0: never, the authors' algorithm): refresh the frozen
    trust ratio from an exact momentum all-reduce this many steps after the freeze, then at
    intervals that double up to coeff_refresh_max, so that c·f follows LAMB's trust ratio
    (:func:`onebit_bert.optim.onebit_lamb.refresh_due`)."""
    coeff_refresh_max: int = 512
    """1-bit LAMB with coeff_refresh: the longest interval between two refreshes."""
    var_freeze_step: int = defaults.VAR_FREEZE_STEP
    """0/1 Adam: last step that may update the variance; local steps follow (DeepSpeed:
    usually the end of the learning-rate warm-up)."""
    var_update_scaler: int = defaults.VAR_UPDATE_SCALER
    """0/1 Adam: variance updates per interval before the interval doubles (kappa)."""
    local_step_scaler: int = defaults.LOCAL_STEP_SCALER
    """0/1 Adam: local steps between two doublings of the local-step interval."""
    local_step_clipper: int = defaults.LOCAL_STEP_CLIPPER
    """0/1 Adam: largest local-step interval (H)."""
    bucket_numel: int | None = None
    """1-bit LAMB, 1-bit Adam, 0/1 Adam: compress in buckets of at most this many
    elements (None: one bucket). The fused kernels take buckets of at most 2**31 - 8
    elements: a larger one is refused when the optimizer is built."""
    kernels: Literal["auto", "reference", "fused"] = "auto"
    """lamb and onebit_lamb: auto runs the fused Triton kernels on CUDA (fewer passes over
    memory) and the reference elsewhere; reference: plain torch everywhere (what the golden
    trajectories record); fused: the kernels, refused where they cannot run. Both give the
    same numbers within floating-point rounding (onebit_bert.kernels)."""

    def __post_init__(self):
        optimizer_spec(self.name)
        check_kernels(self.kernels)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.freeze_step != AUTO and self.freeze_step < 1:
            raise ValueError(
                f"freeze_step must be >= 1 (the last warmup step) or auto, got {self.freeze_step}"
            )
        if self.freeze_step == AUTO and self.name == "zero_one_adam":
            raise ValueError(
                f"freeze_step auto applies to {' and '.join(freezing_optimizers())}; 0/1 Adam "
                f"ends its variance updates at var_freeze_step: set optimizer.var_freeze_step "
                f"instead"
            )
        for name, what in (
            ("var_freeze_step", "the last step that updates the variance"),
            ("var_update_scaler", "variance updates per interval"),
            ("local_step_scaler", "local steps per doubling of the interval"),
            ("local_step_clipper", "the largest local-step interval"),
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(
                    f"{name} must be an integer >= 1 ({what}), got {value}; "
                    f"DeepSpeed's default is {getattr(defaults, name.upper())}"
                )


def weight_decay_groups(
    named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict]:
    """Two parameter groups, as BERT trains: decay on weight matrices and embeddings, none
    on biases and LayerNorm parameters. Parameters that do not train are left out."""
    decay, no_decay = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(NO_DECAY_SUFFIXES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    cfg: OptimizerConfig,
    model: nn.Module,
    comm: Communicator,
    momentum_masks: dict[str, torch.Tensor] | None = None,
    total_steps: int | None = None,
    force_compression: bool = False,
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters.

    ``momentum_masks`` (parameter name → 0/1 mask) marks rows that cannot train (for
    example position embeddings beyond the sequence length); the compressed optimizers
    keep what their 1-bit all-reduce returns there at zero, the others need nothing (their
    gradient there is exactly zero). ``total_steps`` (the run's length) bounds
    ``freeze_step: auto``. ``force_compression``: 1-bit Adam and 0/1 Adam compress even on
    a world of one.
    """
    groups = weight_decay_groups(model.named_parameters(), cfg.weight_decay)
    spec = optimizer_spec(cfg.name)
    opt = spec.build(OptimizerBuild(cfg, groups, comm, total_steps, force_compression))
    if not spec.compressed:
        return opt
    if not isinstance(opt, SelfSyncingOptimizer):
        raise TypeError(
            f"optimizer {cfg.name} is registered as compressed but {type(opt).__name__} lacks "
            f"the SelfSyncingOptimizer surface (onebit_bert/optim/surface.py)"
        )
    params = dict(model.named_parameters())
    for name, mask in (momentum_masks or {}).items():
        opt.set_momentum_mask(params[name], mask)
    return opt


# ---------------------------------------------------------------------- built-in entries
def _common(cfg: OptimizerConfig) -> dict:
    return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _compressed(b: OptimizerBuild) -> dict:
    return dict(comm=b.comm, bucket_numel=b.cfg.bucket_numel)


def _freeze(b: OptimizerBuild) -> dict:
    cfg = b.cfg
    return dict(freeze_step=cfg.freeze_step, auto_freeze=cfg.auto_freeze, total_steps=b.total_steps)


def _fields(cfg: OptimizerConfig, names: str) -> dict:
    """The config fields named in ``names`` (space-separated), as keyword arguments of the
    same names."""
    return {name: getattr(cfg, name) for name in names.split()}


def _lamb(b: OptimizerBuild):
    fields = _fields(b.cfg, "max_coeff min_coeff bias_correction kernels")
    return Lamb(b.groups, **_common(b.cfg), **fields)


def _adamw(b: OptimizerBuild):
    # On CUDA torch's fused kernel: the whole update in one pass over each tensor (torch's
    # default there, foreach, makes about ten passes). Elsewhere torch's default, the
    # arithmetic the golden trajectories hold.
    on_cuda = all(p.is_cuda for group in b.groups for p in group["params"])
    return torch.optim.AdamW(b.groups, **_common(b.cfg), fused=True if on_cuda else None)


def _sgd(b: OptimizerBuild):
    return MomentumSGD(b.groups, lr=b.cfg.lr, momentum=b.cfg.betas[0])


_ONEBIT_LAMB = (
    "max_coeff min_coeff coeff_beta factor_max factor_min factor_threshold coeff_refresh "
    "coeff_refresh_max kernels"
)
"""The config fields 1-bit LAMB takes under their own names."""


def _onebit_lamb(b: OptimizerBuild):
    fields = _fields(b.cfg, _ONEBIT_LAMB)
    return OneBitLamb(b.groups, **_common(b.cfg), **_compressed(b), **_freeze(b), **fields)


def _onebit_adam(b: OptimizerBuild):
    return OneBitAdam(
        b.groups,
        **_common(b.cfg),
        **_compressed(b),
        **_freeze(b),
        force_compression=b.force_compression,
        bias_correction=b.cfg.bias_correction,
    )


_ZERO_ONE_ADAM = "var_freeze_step var_update_scaler local_step_scaler local_step_clipper"
"""The config fields 0/1 Adam takes under their own names."""


def _zero_one_adam(b: OptimizerBuild):
    fields, force = _fields(b.cfg, _ZERO_ONE_ADAM), b.force_compression
    return ZeroOneAdam(
        b.groups, **_common(b.cfg), **_compressed(b), force_compression=force, **fields
    )


for _spec in (
    OptimizerSpec("lamb", _lamb, "LAMB (layer-wise trust ratio over Adam's update)"),
    OptimizerSpec("onebit_lamb", _onebit_lamb, "1-bit LAMB", True, True, "onebit_lamb"),
    OptimizerSpec("onebit_adam", _onebit_adam, "1-bit Adam", True, True, "onebit_adam"),
    OptimizerSpec("zero_one_adam", _zero_one_adam, "0/1 Adam", True, False, "zero_one_adam"),
    OptimizerSpec("adamw", _adamw, "AdamW (torch's)"),
    OptimizerSpec("sgd", _sgd, "momentum SGD with decoupled weight decay"),
):
    register_optimizer(_spec)
