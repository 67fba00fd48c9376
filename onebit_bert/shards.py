"""The pretraining shard format: written by data_prep, read by pretrain.

A prepared corpus for one sequence length is a directory::

    manifest.json            counts, tokens, tokenizer hash, sources, config, version;
                             per shard: file, sequences, tokens, bytes, sha256
    train-00000.npy ...      every train shard holds exactly ``sequences_per_shard`` rows
    validation-00000.npy ... held-out documents (the last shard may be shorter)

Each shard is one NumPy structured array (memory-mappable with ``np.load(mmap_mode="r")``)
whose rows are :data:`row_dtype` ``(seq_length)``:

- ``input_ids`` uint16[seq_length]: ``[CLS] A [SEP] B [SEP]`` then ``[PAD]`` (id 0);
- ``length`` uint16: tokens before the padding;
- ``sep`` uint16: position of the first ``[SEP]``; segment (token type) ids are 0 up to and
  including it and 1 after it, up to ``length`` (single-segment rows: ``sep = length - 1``);
- ``nsp`` int8: 1 if B was drawn from another document, 0 if B continues A, -1 for rows
  without a next-sentence label (MLM-only packing).

Masking is not stored: pretraining masks dynamically.

Opening a split compares every shard's size with the manifest's ``bytes`` (manifests
written before sizes were recorded are not checked); :meth:`PretrainingShards.damaged`
compares a shard's sha256 with the manifest's (pretraining does so for every shard before
it trains, see :data:`SHA256_SECONDS_PER_GB`); ``python -m data_prep verify`` also checks
the token ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onebit_bert.io import CheckedWriter, atomic_open, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "validation")


def row_dtype(seq_length: int) -> np.dtype:
    return np.dtype(
        [
            ("input_ids", np.uint16, (seq_length,)),
            ("length", np.uint16),
            ("sep", np.uint16),
            ("nsp", np.int8),
        ]
    )


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npy"


def write_shard(path: str | Path, rows: np.ndarray) -> dict:
    """Write one shard atomically (a crash leaves no partial file under ``path``); returns
    its ``bytes`` and ``sha256`` for the manifest. A full device raises
    :class:`onebit_bert.io.NoSpaceError` naming ``path``."""
    with atomic_open(path, "wb") as f:
        out = CheckedWriter(f)
        np.save(out, rows, allow_pickle=False)
    return {"bytes": out.size, "sha256": out.digest.hexdigest()}


_FIX = "prepare the data again or restore the file"

SHA256_SECONDS_PER_GB = 3.2
"""Seconds one process takes to hash 1 GB of shards (from the page cache) with
:func:`onebit_bert.io.sha256_file`: 3.15-3.27 s/GB measured on a 2-core VM with SHA
extensions while another job kept both cores busy (an idle core does about 1.5 s/GB).
BERT-Large's phase-1 data (about 157 M rows of 261 bytes at seq 128, 41 GB) takes about
130 s on one process; pretraining spreads the shards over its ranks, so at 64 ranks each
hashes 0.64 GB (about 2 s, plus the file system's read time)."""


class ShardFormatError(ValueError):
    """A prepared-data directory that cannot be read; the message names the file."""


class PretrainingShards:
    """Random access to one split of a prepared corpus, shard files memory-mapped.

    ``batch(indices)`` returns NumPy arrays ready for ``BertForPreTraining``:
    ``input_ids`` (int64), ``token_type_ids``, ``attention_mask`` and
    ``next_sentence_label`` (-100 where a row has none).
    """

    def __init__(self, directory: str | Path, split: str = "train"):
        self.directory = Path(directory)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        path = self.directory / MANIFEST
        if not path.is_file():
            raise ShardFormatError(
                f"{path} is missing: {self.directory} is not a prepared corpus "
                f"(run data_prep, or point at its seq<N> directory)"
            )
        self.manifest = json.loads(path.read_text())
        version = self.manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise ShardFormatError(
                f"{path} has format version {version}; this code reads version "
                f"{FORMAT_VERSION}: prepare the data again with this version"
            )
        info = self.manifest["splits"][split]
        self.split = split
        self.seq_length = int(self.manifest["seq_length"])
        self.shard_sizes = [int(s["sequences"]) for s in info["shards"]]
        self._offsets = np.cumsum([0] + self.shard_sizes)
        self._files = [self.directory / s["file"] for s in info["shards"]]
        missing = [str(f) for f in self._files if not f.is_file()]
        if missing:
            raise ShardFormatError(f"shard file(s) listed in {path} are missing: {missing[:3]}")
        check_shard_sizes(self._files, info["shards"], path)
        self._maps: dict[int, np.ndarray] = {}
        self._dtype = row_dtype(self.seq_length)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self._files)

    @property
    def tokenizer_dir(self) -> Path:
        return (self.directory / self.manifest["tokenizer"]["path"]).resolve()

    def damaged(self, index: int) -> str | None:
        """Why shard ``index`` differs from the manifest's sha256 (one line naming the file
        and the fix), or None when it matches or the manifest records no sha256."""
        expected = self.manifest["splits"][self.split]["shards"][index].get("sha256")
        if expected is None:
            return None
        actual = sha256_file(self._files[index])
        if actual == expected:
            return None
        return (
            f"{self._files[index]} does not match the sha256 in {self.directory / MANIFEST} "
            f"(the file was changed or damaged after data_prep wrote it): {_FIX}"
        )

    def shard(self, index: int) -> np.ndarray:
        if index not in self._maps:
            try:
                rows = np.load(self._files[index], mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as err:
                raise ShardFormatError(
                    f"{self._files[index]} cannot be read as a shard ({err}): {_FIX}"
                ) from err
            if rows.dtype != self._dtype or len(rows) != self.shard_sizes[index]:
                raise ShardFormatError(
                    f"{self._files[index]} holds {len(rows)} rows of {rows.dtype}; the manifest "
                    f"says {self.shard_sizes[index]} rows of seq_length {self.seq_length}: the "
                    f"file is corrupt or from another run, prepare the data again"
                )
            self._maps[index] = rows
        return self._maps[index]

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Raw rows for global indices (any order)."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)})")
        out = np.empty(len(indices), dtype=self._dtype)
        shard_of = np.searchsorted(self._offsets, indices, side="right") - 1
        for s in np.unique(shard_of):
            where = np.nonzero(shard_of == s)[0]
            out[where] = self.shard(int(s))[indices[where] - self._offsets[s]]
        return out

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Model inputs for global row indices; a token id outside the manifest's
        vocabulary raises :class:`ShardFormatError` naming the shard and row."""
        indices = np.asarray(indices, dtype=np.int64)
        rows = self.rows(indices)
        vocab_size = self.manifest.get("tokenizer", {}).get("vocab_size")
        if vocab_size is not None and len(rows):
            bad = np.nonzero(rows["input_ids"].max(axis=1) >= int(vocab_size))[0]
            if len(bad):
                row = int(indices[bad[0]])
                s = int(np.searchsorted(self._offsets, row, side="right") - 1)
                raise ShardFormatError(
                    f"{self._files[s]} row {row - int(self._offsets[s])} holds a token id >= "
                    f"the vocabulary size {int(vocab_size)}: the shard is damaged; {_FIX}"
                )
        return rows_to_features(rows)


def first_damaged_shard(
    splits: Sequence[PretrainingShards], rank: int, world_size: int
) -> int | None:
    """The first shard whose sha256 differs from the manifest's among those rank ``rank`` of
    ``world_size`` checks (``rank, rank + world_size, ...`` of each split), numbered across
    ``splits`` in order; None when they all match. Every shard is hashed by one rank; the
    cost is :data:`SHA256_SECONDS_PER_GB`."""
    offset = 0
    for rows in splits:
        for index in range(rank, rows.num_shards, world_size):
            if rows.damaged(index) is not None:
                return offset + index
        offset += rows.num_shards
    return None


def damage_of(splits: Sequence[PretrainingShards], number: int) -> str:
    """The message for shard ``number`` as :func:`first_damaged_shard` numbers them."""
    for rows in splits:
        if number < rows.num_shards:
            return rows.damaged(number) or f"{rows._files[number]} changed while it was checked"
        number -= rows.num_shards
    raise IndexError(f"no shard {number} in these splits")


def check_shard_sizes(files: Sequence[Path], entries: Sequence[dict], manifest: Path) -> None:
    """Raise :class:`ShardFormatError` for the first shard whose size differs from the
    manifest's ``bytes`` (entries without ``bytes``, from older manifests, are skipped)."""
    for file, entry in zip(files, entries, strict=True):
        expected = entry.get("bytes")
        if expected is None:
            continue
        actual = file.stat().st_size
        if actual != int(expected):
            raise ShardFormatError(
                f"{file} is {actual} bytes but {manifest} says {int(expected)}: the shard is "
                f"truncated or damaged; {_FIX}"
            )


def rows_to_features(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Model inputs from shard rows (see the module docstring for the layout)."""
    seq_length = rows.dtype["input_ids"].shape[0]
    positions = np.arange(seq_length)[None, :]
    length = rows["length"].astype(np.int64)[:, None]
    sep = rows["sep"].astype(np.int64)[:, None]
    nsp = rows["nsp"].astype(np.int64)
    return {
        "input_ids": rows["input_ids"].astype(np.int64),
        "token_type_ids": ((positions > sep) & (positions < length)).astype(np.int64),
        "attention_mask": (positions < length).astype(np.int64),
        "next_sentence_label": np.where(nsp < 0, -100, nsp),
    }
