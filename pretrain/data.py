"""Which rows each rank trains on at each step, and dynamic masking.

Everything here is a pure function of (seed, step, rank/micro-batch), so a resumed run
draws exactly the batches an uninterrupted one would, without replaying anything:

- each epoch is a seeded permutation of all train rows; global batch ``s`` is the slice
  ``[s*G, (s+1)*G)`` of it (``G`` = global batch; the epoch's last partial batch is
  skipped);
- the global batch is cut into ``world_size x accumulation`` micro-batches; rank ``r``
  takes micro-batches ``r*A .. r*A + A - 1``, so the same samples meet in one step
  whatever the world size;
- masking (Google BERT: 15 % of the non-special tokens, at most ``max_predictions``;
  80 % [MASK], 10 % random token, 10 % unchanged) draws from a generator seeded by (seed,
  step, micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from onebit_bert.shards import PretrainingShards
from pretrain.config import DataConfig
from pretrain.packing import pack_batch


@dataclass(frozen=True)
class TokenIds:
    """The special token ids (``[CLS]``, ``[SEP]``, padding, ``[MASK]``) and the vocabulary
    size that batch building and masking need."""

    cls: int
    sep: int
    pad: int
    mask: int
    vocab_size: int


class BatchSchedule:
    """Row indices for every (step, rank, accumulation step)."""

    def __init__(
        self,
        num_rows: int,
        global_batch: int,
        micro_batch: int,
        accumulation: int,
        world_size: int,
        seed: int,
    ):
        if num_rows < global_batch:
            raise ValueError(
                f"the training split has {num_rows} sequences, fewer than one global batch "
                f"of {global_batch}: prepare more data or lower batch.global_batch_size"
            )
        self.num_rows, self.global_batch = num_rows, global_batch
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.world_size, self.seed = world_size, seed
        self.steps_per_epoch = num_rows // global_batch
        self._epoch, self._order = -1, None

    def global_indices(self, step: int) -> np.ndarray:
        epoch, position = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = rng.permutation(self.num_rows).astype(np.int64)
            self._epoch = epoch
        start = position * self.global_batch
        return self._order[start : start + self.global_batch]

    def micro_indices(self, step: int, rank: int) -> list[tuple[int, np.ndarray]]:
        """(global micro-batch number, row indices) for this rank's micro-batches."""
        rows = self.global_indices(step)
        out = []
        for a in range(self.accumulation):
            k = rank * self.accumulation + a
            out.append((k, rows[k * self.micro_batch : (k + 1) * self.micro_batch]))
        return out


def mask_tokens(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    ids: TokenIds,
    rng: np.random.Generator,
    mlm_probability: float,
    max_predictions: int,
    mask_prob: float = 0.8,
    random_prob: float = 0.1,
) -> tuple[np.ndarray, np.ndarray]:
    """(masked input ids, labels with -100 where nothing is predicted)."""
    candidates = (attention_mask == 1) & (input_ids != ids.cls) & (input_ids != ids.sep)
    n_candidates = candidates.sum(axis=1)
    n_predict = np.minimum(
        max_predictions, np.maximum(1, np.rint(n_candidates * mlm_probability))
    ).astype(np.int64)
    n_predict = np.minimum(n_predict, n_candidates)
    keys = rng.random(input_ids.shape)
    keys[~candidates] = np.inf
    # The n_predict smallest keys of each row: a uniform draw without replacement.
    threshold = np.take_along_axis(
        np.sort(keys, axis=1), np.maximum(n_predict - 1, 0)[:, None], axis=1
    )
    chosen = (keys <= threshold) & candidates & (n_predict[:, None] > 0)
    labels = np.where(chosen, input_ids, -100)
    action = rng.random(input_ids.shape)
    masked = input_ids.copy()
    masked[chosen & (action < mask_prob)] = ids.mask
    random_slots = chosen & (action >= mask_prob) & (action < mask_prob + random_prob)
    masked[random_slots] = rng.integers(0, ids.vocab_size, size=int(random_slots.sum()))
    return masked, labels


def make_batch(
    shards: PretrainingShards,
    rows: np.ndarray,
    ids: TokenIds,
    data: DataConfig,
    *,
    seed: int,
    step: int,
    micro: int,
) -> dict[str, np.ndarray]:
    """Model inputs for micro-batch ``micro`` of ``step`` (-1: validation), masked as
    ``data`` says, deterministically for (seed, step, micro).

    ``mlm_positions`` (the masked tokens' flat indices, row by row) and ``nsp_rows`` (the
    rows with an NSP label) are found here, on the host, so the model selects them by index
    on the device instead of by a boolean mask, which would make the host wait for the
    GPU to learn how many there are. With ``data.packing`` the micro-batch comes packed
    (:func:`pretrain.packing.pack_batch`), after masking, so the same tokens are masked."""
    features = shards.batch(rows)
    rng = np.random.default_rng([seed, step + 1, micro])  # step -1 marks validation
    masked, labels = mask_tokens(
        features["input_ids"],
        features["attention_mask"],
        ids,
        rng,
        data.mlm_probability,
        data.max_predictions(shards.seq_length),
        data.mask_prob,
        data.random_prob,
    )
    nsp_labels = np.where(features["next_sentence_label"] < 0, -1, features["next_sentence_label"])
    batch = {
        "input_ids": masked,
        "token_type_ids": features["token_type_ids"],
        "attention_mask": features["attention_mask"],
        "mlm_labels": labels,
        "nsp_labels": nsp_labels,
        "mlm_positions": np.flatnonzero(labels != -100),
        "nsp_rows": np.flatnonzero(nsp_labels >= 0),
    }
    return pack_batch(batch) if data.packing else batch


def to_device(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """A host batch's arrays as tensors on ``device`` (copied without waiting for it)."""
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in batch.items()}


class Prefetcher:
    """Micro-batches built one ahead on a background thread.

    ``build(*args)`` makes the host arrays of one micro-batch (numpy only: it must not
    touch the device or ``torch.distributed``, so that no collective ever leaves the main
    thread). :meth:`get` returns the micro-batch called ``key`` (built from ``args``) as
    ``(arrays, tensors)`` (CPU tensors sharing the arrays' memory, or pinned copies with
    ``pin``) and starts building ``then = (next key, next args)`` behind it. Without a
    thread (``enabled=False``) every batch is built in :meth:`get`; the batches are the
    same either way. While it lives, only this object may read ``build``'s data source
    (its thread does)."""

    def __init__(self, build: Callable[..., dict], pin: bool, enabled: bool = True):
        self._build, self._pin = build, pin
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="prefetch-batches") if enabled else None
        )
        self._ahead: tuple[Hashable, Future] | None = None

    def _make(self, args: tuple) -> tuple[dict, dict]:
        arrays = self._build(*args)
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        if self._pin:
            tensors = {k: t.pin_memory() for k, t in tensors.items()}
        return arrays, tensors

    def get(
        self, key: Hashable, args: tuple, then: tuple[Hashable, tuple] | None = None
    ) -> tuple[dict, dict]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            made = ahead[1].result()  # its exception, if building failed, is raised here
        else:
            if ahead is not None:
                ahead[1].result()  # a batch nobody wants: let it finish before rebuilding
            made = self._make(args)
        if then is not None and self._pool is not None:
            self._ahead = (then[0], self._pool.submit(self._make, then[1]))
        return made

    def close(self) -> None:
        """Stop the thread (after the batch in progress)."""
        self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
