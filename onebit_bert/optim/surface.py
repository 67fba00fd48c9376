"""The optional optimizer surface the strategies read, as protocols.

A plain ``torch.optim.Optimizer`` is enough for strategy ``data_parallel`` and the
local-step strategies. An optimizer that reports per-step figures provides
:class:`ReportingOptimizer` (each attribute may be absent: ``Strategy.metrics`` reports what
is there); one that communicates by itself (``compressed`` in the registry) provides
:class:`SelfSyncingOptimizer`, which its strategy calls.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ReportingOptimizer(Protocol):
    """Per-step figures of the last step (:meth:`onebit_bert.strategies.Strategy.metrics`)."""

    stage: str
    """The stage of the last step taken (full, warmup or compression; 0/1 Adam: its step
    kind): what the logged ``stage`` metric shows. The 1-bit optimizers also say which
    stage the next step will run (``next_stage``)."""
    last_trust_ratios: torch.Tensor | None
    """One trust ratio per layer (LAMB's r; 1-bit LAMB's c·f in compression)."""
    last_factors: torch.Tensor | None
    """1-bit LAMB's compression-stage factors f (None in warmup)."""
    last_compression_error: torch.Tensor | None
    """‖this rank's worker error‖ / ‖what it compressed‖ (None where nothing was)."""


@runtime_checkable
class SelfSyncingOptimizer(Protocol):
    """An optimizer whose step all-reduces what it needs on some steps."""

    bucket_numel: int | None
    """Compress in buckets of at most this many elements (None: one bucket per step)."""

    @property
    def syncs_internally(self) -> bool:
        """True when the next step communicates by itself (its gradients stay local);
        False when the caller must average them first (a warmup or variance step)."""
        ...

    def set_momentum_mask(self, param: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Keep ``param``'s momentum at zero where ``mask`` is 0 (rows that cannot train)."""
        ...

    def set_codec(self, codec) -> None:
        """All-reduce the compressed state through ``codec`` (``comm.compression``)."""
        ...


@runtime_checkable
class OverlappingOptimizer(SelfSyncingOptimizer, Protocol):
    """A self-syncing optimizer that can start its all-reduces during the backward pass
    (``comm.overlap``)."""

    def enable_overlap(self, comm, bucket_numel: int | None = None) -> None:
        """Use side communicator ``comm`` for the overlapped all-reduces, in buckets of
        ``bucket_numel`` elements where the optimizer was built without a size."""
        ...

    def begin_overlap(self, clip=None) -> bool:
        """Before the last micro-batch's backward: whether this step overlaps; ``clip`` (an
        :class:`~onebit_bert.optim.compressed.OverlapClip`) clips its gradients bucket by
        bucket."""
        ...
