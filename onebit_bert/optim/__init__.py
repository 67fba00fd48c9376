"""Optimizers. Each exposes ``syncs_internally``: when True for the next step, the
optimizer averages across ranks itself and the caller must not all-reduce gradients."""

from onebit_bert.optim.lamb import Lamb
from onebit_bert.optim.onebit_adam import OneBitAdam
from onebit_bert.optim.onebit_lamb import OneBitLamb
from onebit_bert.optim.sgd import MomentumSGD
from onebit_bert.optim.zero_one_adam import ZeroOneAdam

__all__ = ["Lamb", "MomentumSGD", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
