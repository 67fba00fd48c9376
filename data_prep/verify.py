"""``python -m data_prep verify PATH``: check prepared shards against their manifests.

``PATH`` is a ``seq<N>`` directory or an output directory holding several. For every shard
listed in a manifest: the file exists, its size and sha256 match the manifest (where the
manifest records them), it holds the rows the manifest says, and every row is sound:
token ids in ``[0, vocabulary size)`` (the vocabulary of the ``tokenizer/`` directory next
to the ``seq<N>`` directories), ``length`` at most the sequence length and ``sep`` before
``length``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from data_prep.outputs import prepared_seq_dirs, tokenizer_dir
from onebit_bert.cli import report_error
from onebit_bert.io import sha256_file
from onebit_bert.shards import MANIFEST, SPLITS, row_dtype

CHUNK_ROWS = 8192


def vocab_size(directory: str | Path) -> int:
    """Tokens in the vocabulary of a saved tokenizer directory (added tokens included)."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def first_bad_row(rows: np.ndarray, seq_length: int, vocab: int) -> tuple[int, str] | None:
    """(index, reason) of the first unsound row, scanned in chunks; None when all are sound."""
    for start in range(0, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        ids_max = chunk["input_ids"].max(axis=1)
        length = chunk["length"].astype(np.int64)
        sep = chunk["sep"].astype(np.int64)
        checks = (
            (ids_max >= vocab, f"a token id >= the vocabulary size {vocab}"),
            (length > seq_length, f"length > the sequence length {seq_length}"),
            ((sep >= length) & (length > 0), "sep at or after length"),
        )
        bad = [(int(np.argmax(mask)), reason) for mask, reason in checks if mask.any()]
        if bad:
            index, reason = min(bad)
            return start + index, reason
    return None


def verify_seq_dir(directory: str | Path) -> tuple[list[str], dict]:
    """Problems found in one ``seq<N>`` directory (one line each, naming the file) and a
    summary (shards, rows, vocabulary size)."""
    directory = Path(directory)
    manifest_file = directory / MANIFEST
    manifest = json.loads(manifest_file.read_text())
    seq_length = int(manifest["seq_length"])
    dtype = row_dtype(seq_length)
    problems: list[str] = []
    tok_dir = tokenizer_dir(directory.parent)
    try:
        vocab = vocab_size(tok_dir)
    except Exception as err:  # missing or unreadable tokenizer.json
        problems.append(f"{tok_dir / 'tokenizer.json'}: cannot read the tokenizer ({err})")
        vocab = int(manifest.get("tokenizer", {}).get("vocab_size", 65536))
    recorded = manifest.get("tokenizer", {}).get("vocab_size")
    if recorded is not None and int(recorded) != vocab:
        problems.append(
            f"{tok_dir}: the tokenizer has {vocab} tokens, {manifest_file} says {recorded}"
        )
    summary = {"shards": 0, "rows": 0, "vocab_size": vocab}
    for split in SPLITS:
        for entry in manifest["splits"][split]["shards"]:
            summary["shards"] += 1
            summary["rows"] += int(entry["sequences"])
            problems += _verify_shard(directory / entry["file"], entry, dtype, seq_length, vocab)
    return problems, summary


def _verify_shard(path: Path, entry: dict, dtype: np.dtype, seq_length: int, vocab: int):
    if not path.is_file():
        return [f"{path}: missing"]
    problems = []
    size = path.stat().st_size
    if "bytes" in entry and size != int(entry["bytes"]):
        problems.append(f"{path}: {size} bytes, the manifest says {int(entry['bytes'])}")
    if "sha256" in entry and sha256_file(path) != entry["sha256"]:
        problems.append(f"{path}: sha256 differs from the manifest")
    try:
        rows = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        return [*problems, f"{path}: cannot be read as a shard ({err})"]
    if rows.dtype != dtype or rows.shape != (int(entry["sequences"]),):
        return [
            *problems,
            f"{path}: holds {rows.shape} rows of {rows.dtype}, the manifest says "
            f"{entry['sequences']} rows of seq_length {seq_length}",
        ]
    bad = first_bad_row(rows, seq_length, vocab)
    if bad is not None:
        problems.append(f"{path}: row {bad[0]} (first bad row) has {bad[1]}")
    return problems


def main(argv: list[str]) -> int:
    """Exit status 0: every shard is sound; 1: problems (printed); 2: nothing to check."""
    parser = argparse.ArgumentParser(
        prog="python -m data_prep verify",
        description="Check prepared shards: sizes and sha256 against the manifest, and every "
        "token id within the vocabulary.",
    )
    parser.add_argument("path", help="a seq<N> directory or the output directory holding them")
    args = parser.parse_args(argv)
    seq_dirs = prepared_seq_dirs(args.path)
    if not seq_dirs:
        return report_error(f"{args.path} holds no prepared corpus (no {MANIFEST})", 2)
    failed = False
    for directory in seq_dirs:
        problems, summary = verify_seq_dir(directory)
        for problem in problems:
            print(f"FAIL {problem}")
        if problems:
            failed = True
            print(f"FAIL {directory}: {len(problems)} problem(s); prepare the data again")
        else:
            print(
                f"OK {directory}: {summary['shards']} shards, {summary['rows']} rows, "
                f"token ids < {summary['vocab_size']}"
            )
    return 1 if failed else 0
