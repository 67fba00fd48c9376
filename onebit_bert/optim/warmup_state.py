"""The checkpoint of an optimizer with a full-precision warmup that ends at
``freeze_step`` and a compression stage after it (1-bit LAMB, 1-bit Adam)."""

from __future__ import annotations

from typing import Any

from onebit_bert.optim.lamb import check_state_shapes


class WarmupCheckpoint:
    """``state_dict`` and ``load_state_dict`` of a
    :class:`~onebit_bert.optim.compressed.WarmupThenCompress` subclass (listed before it
    among the bases): the step count and the freeze decision under :attr:`SECTION`, and
    this rank's compression errors under ``"per_rank"``, so that a checkpoint can store
    the rest once and only that part per rank."""

    SECTION: str
    """The key of the optimizer's own entries in its state dict."""
    OTHER_STATE_HINT = "resume with the optimizer that wrote it"
    """The fix named when a state without :attr:`SECTION` is loaded."""
    compresses = True
    """Whether the compression stage runs the 1-bit all-reduce."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly."""
        state = super().state_dict()
        state[self.SECTION] = self._freeze_state()
        state["per_rank"] = self._per_rank_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`. Compression errors saved under a
        different world size (or by another rank), or missing, start from zero (with a
        warning when the run is already compressing)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(self.SECTION, None)
        per_rank = state_dict.pop("per_rank", None) or {}
        if extra is None:
            raise ValueError(
                f"this optimizer state has no {self.NAME} section; it was saved by another "
                f"optimizer ({self.OTHER_STATE_HINT})"
            )
        check_state_shapes(self, state_dict)
        super().load_state_dict(state_dict)
        self._load_freeze_state(extra)
        compressing = self.freeze_step is not None and self._step > self.freeze_step
        self._load_per_rank_state(per_rank, compressing and self.compresses)
