"""Streaming DiLoCo: DiLoCo whose parameters are synchronised one fragment at a time, each
fragment's average overlapped with the inner steps that follow.

Douillard et al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512);
torchft's ``local_sgd.py`` (``fragment_sync_delay``, ``fragment_update_alpha``). With H the
round length (``strategy.outer_every``), F fragments (``strategy.fragments``, H a multiple
of F), d the sync delay (``strategy.fragment_sync_delay``, below H/F) and alpha the mixing
factor (``strategy.fragment_mix``):

**Fragments.** The trained parameters, in the model's order (embeddings first, then each
layer), are cut into F contiguous runs of whole tensors, each cut at the first tensor
boundary where the running element count reaches k/F of the total (k = 1..F-1), every
fragment holding at least one tensor (:func:`split_fragments`). Consecutive layers go
together, as the paper's "sequential" pattern.

**Schedule.** Fragment k is synchronised at the steps t >= 1 with ``t mod H = (k + 1) H / F
mod H``: once every H steps, fragment F-1 at the multiples of H as DiLoCo, the others
staggered by H/F (:func:`fragments_due`). At step t a due fragment's local values are
averaged over ranks in the background (an asynchronous all-reduce on a process group of its
own, issued from the main thread); the result is applied at step t + d, after d more inner
steps that run while it travels::

    x̄_k = average(x_i,k at step t)               in flight for d steps
    g_k = (x0_k - x̄_k) + wd x0_k                  the fragment's pseudo-gradient
    m_k = beta m_k + g_k;  x0_k = x0_k - lr (g_k + beta m_k)     (DiLoCo's Nesterov SGD)
    x_i,k = alpha x_i,k + (1 - alpha) x0_k        at step t + d (alpha 0: take x0_k)

With F = 1, d = 0 and alpha = 0 this is DiLoCo exactly. A lossy ``comm.compression.outer``
codec sends each rank's progress on the fragment (x_i,k - x0_k) instead of its values, as
for the other local-step strategies, one error-feedback buffer per fragment.

Evaluation and export use the average over ranks of the models after the last inner step
(one all-reduce). Checkpoints hold, besides DiLoCo's state, the averages in flight (waited
for first, which changes no value) and the steps they apply at, so a resume continues the
uninterrupted trajectory bit for bit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from onebit_bert.distributed.codecs import AsyncCodecAllReduce
from onebit_bert.distributed.comm import AsyncAllReduce
from onebit_bert.strategies.base import StrategyConfig
from onebit_bert.strategies.flat import FlatParams
from onebit_bert.strategies.local_steps import (
    DILOCO,
    DILOCO_FIELDS,
    LocalSteps,
    check_local_step_config,
    local_steps_entry,
    outer_codec,
    outer_sgd,
)
from onebit_bert.strategies.registry import register_strategy


def split_fragments(sizes: list[int], count: int) -> list[tuple[int, int]]:
    """[first, end) tensor indices of ``count`` contiguous fragments of tensors of ``sizes``
    elements (the module docstring's rule)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(
            f"strategy.fragments must be between 1 and the number of parameter tensors "
            f"({len(sizes)}), got {count}"
        )
    total = sum(sizes)
    running = list(itertools.accumulate(sizes))  # running[j]: elements of tensors 0..j
    cuts = [0]
    for k in range(1, count):
        lowest, highest = cuts[-1] + 1, len(sizes) - (count - k)
        end = next((j + 1 for j in range(lowest - 1, highest) if running[j] * count >= k * total),
                   highest)  # fmt: skip
        cuts.append(min(max(end, lowest), highest))
    cuts.append(len(sizes))
    return list(itertools.pairwise(cuts))


def fragments_due(step: int, every: int, count: int) -> list[int]:
    """The fragments synchronised at ``step`` (1-based; the schedule of the module
    docstring)."""
    if step < 1:
        return []
    period = every // count
    return [k for k in range(count) if step % every == ((k + 1) * period) % every]


@dataclass
class _InFlight:
    """One fragment's average: issued, applied at ``apply_at``."""

    apply_at: int
    average: torch.Tensor
    handle: AsyncAllReduce | AsyncCodecAllReduce | None
    """None once waited for (``average`` then holds the fragment's mean values)."""


def check_streaming_config(cfg: StrategyConfig) -> None:
    """Value rules of ``streaming_diloco`` (checked when the config is loaded)."""
    count, every = cfg.fragments, cfg.outer_every
    if count < 1 or every % count:
        raise ValueError(
            f"strategy.outer_every ({every}) must be a multiple of strategy.fragments "
            f"({count}): each fragment is synchronised once per round, H/F steps apart"
        )
    if not 0 <= cfg.fragment_sync_delay < every // count:
        raise ValueError(
            f"strategy.fragment_sync_delay must be in [0, outer_every / fragments = "
            f"{every // count}), got {cfg.fragment_sync_delay}: a fragment's average must "
            "land before its next one starts"
        )
    if not 0 <= cfg.fragment_mix < 1:
        raise ValueError(f"strategy.fragment_mix must be in [0, 1), got {cfg.fragment_mix}")
    if cfg.inner_state != "keep":
        raise ValueError("streaming_diloco keeps the inner optimizer's state (inner_state keep)")


class StreamingDiLoCo(LocalSteps):
    """``streaming_diloco`` (the module docstring has the update rule and the schedule)."""

    def __init__(self, model, loss_module, optimizer, ctx, cfg: StrategyConfig, policy=None):
        super().__init__(model, loss_module, optimizer, ctx, cfg, "streaming_diloco", policy)
        check_streaming_config(cfg)
        self.count = cfg.fragments
        self.delay = cfg.fragment_sync_delay
        self.mix = cfg.fragment_mix
        bounds = split_fragments(self.flat.sizes, self.count)
        self.fragments = [FlatParams(self.params[a:b]) for a, b in bounds]
        offsets = [0, *itertools.accumulate(f.numel for f in self.fragments)]
        self.ranges = list(itertools.pairwise(offsets))
        # averages in the background, on a group of their own (collective: every rank
        # builds it in this order)
        self.outer_codec = outer_codec(self.comm, policy, in_background=True)
        self.in_flight: dict[int, _InFlight] = {}
        self.syncs = 0

    # ------------------------------------------------------------------ one step
    def after_step(self, step: int) -> None:
        if self.anchor is None:
            return
        for flight in self.in_flight.values():
            if flight.handle is not None:
                flight.handle.advance()  # at the same point of every rank's step
        for k in sorted(self.in_flight):
            if self.in_flight[k].apply_at == step:
                self._apply(k)
        for k in fragments_due(step, self.every, self.count):
            self._start(k, step)
            if self.delay == 0:
                self._apply(k)

    def _start(self, k: int, step: int) -> None:
        if k in self.in_flight:
            raise RuntimeError(f"fragment {k} is still in flight at step {step}")
        a, b = self.ranges[k]
        values = self.fragments[k].read()
        if self.outer_codec.lossy:
            values.sub_(self.anchor[a:b])  # this rank's progress on the fragment
        handle = self.outer_codec.average_async(values, f"outer/{k}", "parameters",
                                                self.comm.stats)  # fmt: skip
        self.in_flight[k] = _InFlight(step + self.delay, values, handle)

    def _wait_for(self, k: int) -> None:
        flight = self.in_flight[k]
        if flight.handle is None:
            return
        self.last_wait = flight.handle.wait()
        self.last_in_flight = flight.handle.in_flight_seconds
        self.total_wait += self.last_wait
        self.waits += 1
        if self.outer_codec.lossy:
            a, b = self.ranges[k]
            flight.average.add_(self.anchor[a:b])  # the anchor moves only when it lands
        flight.handle = None

    def _apply(self, k: int) -> None:
        """The outer step of fragment ``k`` and the merge of the local values."""
        self._wait_for(k)
        average = self.in_flight.pop(k).average
        a, b = self.ranges[k]
        anchor, momentum = self.anchor[a:b], self.momentum[a:b]
        delta = anchor - average
        outer_sgd(anchor, momentum, delta, self.alpha, self.beta, self.nesterov,
                  self.outer_weight_decay)  # fmt: skip
        local = self.fragments[k].read()
        local.mul_(self.mix).add_(anchor, alpha=1 - self.mix)
        self.fragments[k].write(local)
        self.syncs += 1
        if k == self.count - 1:
            self.rounds += 1

    def drain(self) -> None:
        for k in sorted(self.in_flight):
            self._wait_for(k)

    # ------------------------------------------------------------------ state
    def identity(self) -> dict:
        return {**super().identity(), "fragments": self.count,
                "fragment_sync_delay": self.delay}  # fmt: skip

    def state_dict(self) -> tuple[dict, dict]:
        shared, per_rank = super().state_dict()  # drains: every average in flight is in
        shared["streaming"] = {
            "fragments": self.count,
            "fragment_sync_delay": self.delay,
            "syncs": self.syncs,
            "in_flight": {
                k: {"apply_at": f.apply_at, "average": f.average.clone()}
                for k, f in self.in_flight.items()
            },  # fmt: skip
        }
        return shared, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        super().load_state_dict(shared, per_rank, same_run)
        saved = shared.get("streaming")
        if saved is None:
            return
        for key, value in (("fragments", self.count), ("fragment_sync_delay", self.delay)):
            if same_run and saved[key] != value:
                raise ValueError(
                    f"the checkpoint was written with strategy.{key} {saved[key]} and this "
                    f"run sets {value}; resume with the same value (the fragment schedule is "
                    "part of the trajectory)"
                )
        self.syncs = saved["syncs"]
        device = self.flat.device
        self.in_flight = {
            int(k): _InFlight(f["apply_at"], f["average"].to(device), None)
            for k, f in saved["in_flight"].items()
        }

    def metrics(self) -> dict:
        out = super().metrics()
        out["fragment_syncs"] = self.syncs
        return out


def _check(name: str, cfg: StrategyConfig, optimizer_name: str) -> None:
    check_local_step_config(name, cfg, optimizer_name)
    check_streaming_config(cfg)


register_strategy(
    local_steps_entry(
        "streaming_diloco",
        "DiLoCo synchronised one parameter fragment at a time, each average overlapped "
        "with the next inner steps (Streaming DiLoCo)",
        DILOCO,
        build=lambda args: StreamingDiLoCo.build(args, cfg=args.cfg, policy=args.policy),
        fields=(*DILOCO_FIELDS, "fragments", "fragment_sync_delay", "fragment_mix"),
        check=_check,
    )
)
