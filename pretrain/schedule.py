"""Learning-rate schedules as pure functions of the step (multipliers of the peak rate)."""

from __future__ import annotations

from pretrain.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, step: int) -> float:
    """The factor applied to the peak learning rate after ``step`` optimizer steps.

    - ``poly`` (NVIDIA's BERT recipe): linear warmup over ``warmup_proportion`` of the steps,
      then ``(1 - progress) ** power`` down to 0 at ``max_steps``;
    - ``ee`` (DeepSpeed bing_bert's ``warmup_exp_decay_exp``): ``(step / warmup) ** 2``
      during warmup, then ``decay_rate ** ((step - warmup) / decay_step)``;
    - ``le`` (bing_bert's ``warmup_linear_decay_exp``): linear warmup, then the same decay;
    - ``constant``: linear warmup, then 1.
    """
    warmup = cfg.warmup_proportion * cfg.max_steps
    if step < warmup:
        fraction = step / warmup
        return fraction**2 if cfg.name == "ee" else fraction
    if cfg.name == "poly":
        progress = min(step, cfg.max_steps) / cfg.max_steps
        return max(0.0, 1.0 - progress) ** cfg.power
    if cfg.name in ("ee", "le"):
        return cfg.decay_rate ** ((step - warmup) / cfg.decay_step)
    return 1.0
