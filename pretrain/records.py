"""What one training step reports: :class:`StepRecord` and the metrics and progress line
made from it; :class:`LossSpikeWatch`, which tells a finite blow-up from a noisy step."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

from onebit_bert.distributed.comm import CommStats
from onebit_bert.distributed.netdev import InterfaceBytes

STAT_KEYS = (
    "mlm_loss_sum",
    "mlm_tokens",
    "mlm_correct",
    "nsp_loss_sum",
    "nsp_examples",
    "nsp_correct",
)
"""Sums a forward pass returns, added over micro-batches and ranks before dividing."""

STEP_TOTALS = (*STAT_KEYS, "tokens", "bad_step", "stop_requested")
"""What one training step sums over ranks in a single all-reduce: the statistics, then the
tokens seen, whether any rank's gradients were bad, and whether any rank was asked to stop.
Index it by name (``STEP_TOTALS.index("tokens")``), never by position from the end."""
TOKENS, BAD_STEP, STOP_REQUESTED = (STEP_TOTALS.index(k) for k in STEP_TOTALS[-3:])


@dataclass
class StepRecord:
    """One optimizer step: statistics summed over ranks (:data:`STAT_KEYS`, then the
    tokens seen), the gradient norm before clipping (NaN when not clipped or skipped),
    wall-clock marks, this rank's communication and network-interface deltas, and whether
    any rank asked to stop, and what (if anything) made the step numerically bad."""

    stats: dict[str, float]
    tokens: float
    grad_norm: float
    t_start: float
    t_backward_done: float
    t_sync_done: float
    t_end: float
    comm: CommStats
    net: InterfaceBytes | None
    preempted: bool
    bad: str | None = None
    """Why the step is bad (non-finite loss or gradient norm, fp16 overflow at scale 1)."""
    grad_sync: str | None = None
    """What happened to the step's gradients (the strategy's ``gradient_sync()``)."""
    intra_node_bytes: int = 0
    """Bytes sent inside this rank's node under ``comm.hierarchy: node`` (not in
    ``comm``)."""

    @property
    def mlm_loss(self) -> float:
        return self.stats["mlm_loss_sum"] / max(self.stats["mlm_tokens"], 1)

    @property
    def loss(self) -> float:
        """MLM loss per masked token plus NSP loss per labelled row (the logged ``loss``)."""
        s = self.stats
        nsp = s["nsp_loss_sum"] / s["nsp_examples"] if s["nsp_examples"] else 0.0
        return self.mlm_loss + nsp

    def metrics(self, lr: float, global_batch: int, extra: dict) -> dict:
        """The step's log record; ``extra``: the precision and strategy figures."""
        s = self.stats
        step_s = self.t_end - self.t_start
        metrics = {
            "loss": self.loss,
            "mlm_loss": self.mlm_loss,
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_tokens"], 1),
            "lr": lr,
            "grad_norm": self.grad_norm,
            "samples_per_s": global_batch / step_s,
            "tokens_per_s": self.tokens / step_s,
            "step_seconds": step_s,
            "forward_backward_seconds": self.t_backward_done - self.t_start,
            "grad_sync_seconds": self.t_sync_done - self.t_backward_done,
            "optimizer_seconds": self.t_end - self.t_sync_done,
            "comm_bytes": self.comm.bytes_sent,
            "comm_seconds": self.comm.seconds,
        }
        if self.grad_sync is not None:
            metrics["grad_sync"] = self.grad_sync
        if self.intra_node_bytes:
            metrics["comm_bytes_intra_node"] = self.intra_node_bytes
        for kind, (nbytes, seconds, _calls) in sorted(self.comm.by_kind.items()):
            metrics[f"comm_bytes_{kind}"] = nbytes
            metrics[f"comm_seconds_{kind}"] = seconds
        metrics.update(extra)
        if self.net is not None:
            metrics.update(net_tx_bytes=self.net.tx, net_rx_bytes=self.net.rx)
        if s["nsp_examples"]:
            metrics["nsp_loss"] = s["nsp_loss_sum"] / s["nsp_examples"]
            metrics["nsp_accuracy"] = s["nsp_correct"] / s["nsp_examples"]
        return metrics


def progress_line(
    record: StepRecord,
    step: int,
    start_step: int,
    max_steps: int,
    started: float,
    tokens_per_step: int,
) -> str:
    """``step 50/200  mlm_loss 6.1  0.9 steps/s  3.6k tok/s  eta 0:02:47``."""
    elapsed = time.perf_counter() - started
    rate = (step - start_step) / elapsed if elapsed > 0 else 0.0
    eta = (max_steps - step) / rate if rate > 0 else math.inf
    return (
        f"step {step}/{max_steps}  mlm_loss {record.mlm_loss:.4f}  {rate:.3f} steps/s  "
        f"{rate * tokens_per_step / 1e3:.1f}k tok/s  eta {hms(eta)}"
    )


def hms(seconds: float) -> str:
    """``H:MM:SS``, or ``?`` for an unknown time."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class LossSpikeWatch:
    """A finite blow-up: a step whose loss is more than ``factor`` times the median of the
    last ``window`` steps' losses (every rank sees the same summed loss, so all agree).

    The median, not the mean, so that one earlier spike does not raise the bar; a spike
    is not added to the history. ``factor`` 0 turns the check off."""

    def __init__(self, factor: float, window: int):
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> str | None:
        """Why ``loss`` is a blow-up, or None (then it joins the history)."""
        if not math.isfinite(loss):
            return None  # the bad-step count handles non-finite losses
        if self.factor > 0 and self.recent:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                return (
                    f"loss {loss:.4g} is more than {self.factor:g}x the median {median:.4g} "
                    f"of the last {len(self.recent)} steps (divergence.loss_spike_factor)"
                )
        self.recent.append(loss)
        return None
