"""The 0/1 Adam strategy: a full-precision gradient average on the optimizer's
variance-update steps only; on every other step the optimizer communicates by itself (1-bit
gradients, or a 1-bit synchronisation after local steps) or not at all.

Between two synchronisations of the local-step stage each rank's parameters, momentum and
accumulator are its own: they are per-rank checkpoint state, so a resume continues exactly.
Validation and export use the parameters of the last synchronisation, which every rank
holds alike (nothing is sent); right after a synchronisation, and throughout the variance
stage, that is the model itself.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from onebit_bert.strategies.data_parallel import SELF_SYNCING, SelfSyncingDataParallel, averaging
from onebit_bert.strategies.flat import AverageModel, FlatParams
from onebit_bert.strategies.registry import StrategySpec, register_strategy


class ZeroOneAdamStrategy(SelfSyncingDataParallel):
    """0/1 Adam (:class:`~onebit_bert.optim.zero_one_adam.ZeroOneAdam`): averaged
    gradients when its next step is a variance step, none otherwise."""

    name = "zero_one_adam"

    @functools.cached_property
    def flat(self) -> FlatParams:
        """The trained parameters as one vector (this rank's, saved between two
        synchronisations)."""
        return FlatParams(self.params)

    @functools.cached_property
    def synced_model(self) -> AverageModel:
        """The model at the last synchronisation, once it differs from the model."""
        return AverageModel(self.model, self.flat)

    def eval_model(self) -> nn.Module:
        """The model at the last synchronisation (the model itself while the ranks agree)."""
        if self.optimizer.replicas_agree:
            return self.model
        key = self.optimizer.step_count
        current = self.synced_model.current(key)
        if current is not None:
            return current
        synced = torch.cat([self.optimizer.synced_parameter(p).reshape(-1) for p in self.params])
        return self.synced_model.set(synced, key)

    def state_dict(self) -> tuple[dict, dict]:
        """The base parts, and between two synchronisations this rank's parameters."""
        shared, per_rank = super().state_dict()
        if not self.optimizer.replicas_agree:
            per_rank["params"] = self.flat.read()
        return shared, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        super().load_state_dict(shared, per_rank, same_run)
        if per_rank is not None and per_rank.get("params") is not None:
            self.flat.write(per_rank["params"])
        self.synced_model.forget()

    def metrics(self) -> dict:
        """The base figures and the two schedules' current intervals."""
        out = super().metrics()
        out["var_interval"] = self.optimizer.var_interval
        out["local_step_interval"] = self.optimizer.local_step_interval
        return out


register_strategy(
    StrategySpec(
        "zero_one_adam",
        averaging(ZeroOneAdamStrategy),
        "0/1 Adam: averaged gradients on variance steps, 1-bit ones and local steps else",
        optimizers=("zero_one_adam",),
        **{**SELF_SYNCING, "hierarchy": False},
    )
)
