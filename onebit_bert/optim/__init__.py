"""Optimizers. Each exposes ``syncs_internally``: when True for the next step, the
optimizer averages across ranks itself and the caller must not all-reduce gradients."""

from onebit_bert.optim.lamb import Lamb
from onebit_bert.optim.onebit_lamb import OneBitLamb
from onebit_bert.optim.sgd import MomentumSGD

__all__ = ["Lamb", "MomentumSGD", "OneBitLamb"]
