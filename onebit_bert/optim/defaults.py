"""LAMB's, 1-bit LAMB's, 1-bit Adam's and 0/1 Adam's hyperparameter defaults: the one
place they are set.

:class:`~onebit_bert.optim.lamb.Lamb`, :class:`~onebit_bert.optim.onebit_lamb.OneBitLamb`,
:class:`~onebit_bert.optim.onebit_adam.OneBitAdam`,
:class:`~onebit_bert.optim.zero_one_adam.ZeroOneAdam` and the pretraining config's
``optimizer`` section all take their defaults from here. They are DeepSpeed's
(``OnebitLamb``, ``OnebitAdam``, ``ZeroOneAdam``: lr, betas, eps, weight decay and
freeze_step agree among the three), so a DeepSpeed JSON config that leaves a key out means
the same thing here. BERT recipes override several of them (eps 1e-6, weight
decay 0.01, trust-ratio bounds 0.3 / 0.01, freeze_step 15-25 % of the steps); the shipped
configs state those values explicitly (``configs/pretrain/bert_large_seq128_base.yaml``).
"""

from __future__ import annotations

LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
"""Added to sqrt(v) (outside the square root)."""
WEIGHT_DECAY = 0.0
"""Decoupled weight decay."""
MAX_COEFF = 10.0
MIN_COEFF = 0.01
"""Bounds of the LAMB trust ratio (warmup stage for 1-bit LAMB)."""
BIAS_CORRECTION = False
"""LAMB only; 1-bit LAMB has none (as DeepSpeed's)."""
FREEZE_STEP = 100000
"""1-bit LAMB and 1-bit Adam: last step of the full-precision warmup stage."""
COEFF_BETA = 0.9
"""1-bit LAMB: EMA rate of the recorded trust ratio."""
FACTOR_MAX = 4.0
FACTOR_MIN = 0.5
"""1-bit LAMB: bounds of the compression-stage scaling factor."""
FACTOR_THRESHOLD = 0.1
"""1-bit LAMB: largest relative change of the factor from one step to the next."""
VAR_FREEZE_STEP = 100000
"""0/1 Adam: last step that may update the variance (after it, local steps)."""
VAR_UPDATE_SCALER = 16
"""0/1 Adam: variance updates per interval before the interval doubles (kappa)."""
LOCAL_STEP_SCALER = 32678
"""0/1 Adam: steps after the variance freeze between two doublings of the local-step
interval (DeepSpeed's value, as written there)."""
LOCAL_STEP_CLIPPER = 16
"""0/1 Adam: largest local-step interval (H)."""
