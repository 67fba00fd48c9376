"""Optimizer settings and the one place that turns them into an optimizer.

Trainers call :func:`build_optimizer` and then only use the optimizer's generic surface
(``step``, ``zero_grad``, ``state_dict``, ``syncs_internally``), so the training loop never
branches on which optimizer it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim.lamb import Lamb
from onebit_bert.optim.onebit_lamb import OneBitLamb

NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight")


@dataclass
class OptimizerConfig:
    """Which optimizer, and its hyperparameters (DeepSpeed's names for 1-bit LAMB)."""

    name: Literal["lamb", "onebit_lamb", "adamw"] = "lamb"
    lr: float = 1e-3
    """Peak learning rate (the schedule scales it)."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    """Decoupled weight decay, not applied to biases and LayerNorm weights."""
    max_coeff: float = 0.3
    """LAMB trust-ratio bounds (BERT recipes: 0.3 / 0.01)."""
    min_coeff: float = 0.01
    bias_correction: bool = False
    """LAMB and AdamW only; 1-bit LAMB has none."""
    freeze_step: int = 1000
    """1-bit LAMB: last step of the full-precision warmup stage."""
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
    bucket_numel: int | None = None
    """1-bit LAMB: compress momentum in buckets of at most this many elements."""

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1, got {self.freeze_step}")


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
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters.

    ``momentum_masks`` (parameter name → 0/1 mask) marks rows that cannot train (for
    example position embeddings beyond the sequence length); 1-bit LAMB keeps their
    compressed momentum at zero, the other optimizers need nothing (their gradient there
    is exactly zero).
    """
    groups = weight_decay_groups(model.named_parameters(), cfg.weight_decay)
    common = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "lamb":
        return Lamb(
            groups,
            **common,
            max_coeff=cfg.max_coeff,
            min_coeff=cfg.min_coeff,
            bias_correction=cfg.bias_correction,
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, **common)
    opt = OneBitLamb(
        groups,
        **common,
        freeze_step=cfg.freeze_step,
        max_coeff=cfg.max_coeff,
        min_coeff=cfg.min_coeff,
        coeff_beta=cfg.coeff_beta,
        factor_max=cfg.factor_max,
        factor_min=cfg.factor_min,
        factor_threshold=cfg.factor_threshold,
        comm=comm,
        bucket_numel=cfg.bucket_numel,
    )
    params = dict(model.named_parameters())
    for name, mask in (momentum_masks or {}).items():
        opt.set_momentum_mask(params[name], mask)
    return opt


def syncs_internally(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's next step averages across ranks by itself (torch's own
    optimizers never do)."""
    return bool(getattr(optimizer, "syncs_internally", False))
