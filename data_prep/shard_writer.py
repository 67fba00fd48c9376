"""Step 2 of data preparation: work units → train and validation shards of one sequence
length (a seeded shuffle buffer; exactly ``sequences_per_shard`` rows per train shard;
shards finished by an interrupted run are reused)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from data_prep.config import DataPrepConfig
from data_prep.outputs import seq_dir
from onebit_bert.io import sha256_file
from onebit_bert.shards import row_dtype, shard_name, write_shard

log = logging.getLogger("data_prep")


def unit_path(work: Path, seq_length: int, split: str, index: int) -> Path:
    """Rows of work unit ``index`` for one sequence length and split."""
    return seq_dir(work, seq_length) / split / f"{index:07d}.npy"


class ShardWriter:
    """Cuts a stream of rows into shards of ``size`` rows, optionally through a seeded
    shuffle buffer; an existing shard file (from an interrupted run) is not rewritten."""

    def __init__(
        self,
        directory: Path,
        split: str,
        size: int,
        dtype,
        shuffle: int | None,
        rng: np.random.Generator | None,
    ):
        self.directory, self.split, self.size, self.dtype = directory, split, size, dtype
        self.shuffle, self.rng = shuffle, rng
        self.pool: list[np.ndarray] = []
        self.pool_rows = 0
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.shards: list[dict] = []

    def add(self, rows: np.ndarray) -> None:
        if self.shuffle is None:
            self._emit(rows)
            return
        self.pool.append(rows)
        self.pool_rows += len(rows)
        if self.pool_rows >= 2 * self.shuffle:
            pool = np.concatenate(self.pool)[self.rng.permutation(self.pool_rows)]
            self._emit(pool[: -self.shuffle])
            self.pool, self.pool_rows = [pool[-self.shuffle :]], self.shuffle

    def finish(self, keep_remainder: bool) -> int:
        """Flush everything; returns the rows dropped (train: the last partial shard)."""
        if self.pool_rows:
            pool = np.concatenate(self.pool)
            if self.rng is not None:
                pool = pool[self.rng.permutation(len(pool))]
            self._emit(pool)
            self.pool, self.pool_rows = [], 0
        dropped = self.pending_rows
        if keep_remainder and self.pending_rows:
            self._write(np.concatenate(self.pending))
            dropped = 0
        self.pending, self.pending_rows = [], 0
        return dropped

    def _emit(self, rows: np.ndarray) -> None:
        self.pending.append(rows)
        self.pending_rows += len(rows)
        if self.pending_rows >= self.size:
            stream = np.concatenate(self.pending)
            whole = len(stream) // self.size * self.size
            for start in range(0, whole, self.size):
                self._write(stream[start : start + self.size])
            self.pending = [stream[whole:]]
            self.pending_rows = len(stream) - whole

    def _write(self, rows: np.ndarray) -> None:
        name = shard_name(self.split, len(self.shards))
        path = self.directory / name
        if path.exists():
            integrity = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        else:
            integrity = write_shard(path, rows)
        self.shards.append(
            {
                "file": name,
                "sequences": int(len(rows)),
                "tokens": int(rows["length"].astype(np.int64).sum()),
                **integrity,
            }
        )


def write_shards(cfg: DataPrepConfig, work: Path, seq_length: int, num_units: int) -> dict:
    directory = seq_dir(cfg.output, seq_length)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = row_dtype(seq_length)
    out = {}
    for split in ("train", "validation"):
        is_train = split == "train"
        writer = ShardWriter(
            directory,
            split,
            cfg.sequences_per_shard,
            dtype,
            shuffle=cfg.shuffle_buffer if is_train else None,
            rng=np.random.default_rng([cfg.seed, seq_length]) if is_train else None,
        )
        nsp = 0
        for index in range(num_units):
            rows = np.load(unit_path(work, seq_length, split, index), allow_pickle=False)
            nsp += int((rows["nsp"] == 1).sum())
            writer.add(rows)
        dropped = writer.finish(keep_remainder=not is_train)
        out[split] = {
            "sequences": sum(s["sequences"] for s in writer.shards),
            "tokens": sum(s["tokens"] for s in writer.shards),
            "dropped_sequences": dropped,
            "random_next_rows_before_drop": nsp,
            "shards": writer.shards,
        }
    return out


# ----------------------------------------------------------------------------- the run
