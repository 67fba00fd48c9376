"""Where the data stage puts its outputs, and how to tell they are finished.

    <output>/
        tokenizer/              the tokenizer every sequence length shares
        seq<N>/                 one prepared corpus per sequence length N
            manifest.json       written last: its presence marks seq<N> as finished
            train-00000.npy ... validation-00000.npy ...
        work/                   work units of an unfinished run (removed when it finishes)

A ``seq<N>`` directory is what pretraining reads (``data.path``); the shard format inside
it is :mod:`onebit_bert.shards`. Files are written atomically through temporary siblings
(:data:`onebit_bert.io.TEMP_FILE`); those a killed run leaves behind are removed when the
next run starts (:func:`remove_stale_temp_files`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from onebit_bert.io import atomic_write_json, read_json_object
from onebit_bert.io import remove_stale_temp_files as _remove_temp_files
from onebit_bert.shards import MANIFEST

TOKENIZER = "tokenizer"
WORK = "work"
_SEQ_DIR = re.compile(r"seq(\d+)")


def seq_dir(output: str | Path, seq_length: int) -> Path:
    """The prepared corpus of one sequence length: ``<output>/seq<N>``."""
    return Path(output) / f"seq{int(seq_length)}"


def manifest_path(output: str | Path, seq_length: int) -> Path:
    """The manifest of one sequence length (its completion marker)."""
    return seq_dir(output, seq_length) / MANIFEST


def tokenizer_dir(output: str | Path) -> Path:
    """The tokenizer shared by every sequence length."""
    return Path(output) / TOKENIZER


def work_dir(output: str | Path) -> Path:
    """Intermediate work units of an unfinished run."""
    return Path(output) / WORK


def seq_lengths_present(output: str | Path) -> list[int]:
    """Sequence lengths with a ``seq<N>`` directory under ``output``, finished or not."""
    output = Path(output)
    if not output.is_dir():
        return []
    found = (_SEQ_DIR.fullmatch(p.name) for p in output.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def is_complete(output: str | Path, seq_lengths: Iterable[int]) -> bool:
    """Every one of ``seq_lengths`` has its manifest (written last, atomically)."""
    return all(manifest_path(output, n).is_file() for n in seq_lengths)


def read_manifest(output: str | Path, seq_length: int) -> dict:
    """The manifest of one sequence length; FileNotFoundError when it is not finished."""
    return read_json_object(
        manifest_path(output, seq_length),
        missing=f"seq {seq_length} of {output} is not prepared (run data_prep)",
        fix=f"prepare seq {seq_length} again",
    )


def write_manifest(output: str | Path, seq_length: int, manifest: dict) -> Path:
    """Write the manifest of one sequence length (last, once its shards are in place)."""
    return atomic_write_json(manifest_path(output, seq_length), manifest)


def check_output_path(output: str | Path) -> None:
    """Raise ValueError when ``output`` (or the nearest existing parent) is not a directory."""
    output = Path(output)
    for path in (output, *output.parents):
        if path.exists():
            if not path.is_dir():
                raise ValueError(
                    f"output {output}: {path} is a file, not a directory; set output to a "
                    f"directory (new or from an earlier run)"
                )
            return


def remove_stale_temp_files(output: str | Path, seq_lengths: Iterable[int]) -> int:
    """Remove the temporary files a killed run left in the directories the data stage
    writes (``output``, ``tokenizer/``, ``seq<N>/`` of ``seq_lengths``, ``work/``);
    returns how many were removed."""
    output = Path(output)
    removed = _remove_temp_files(output) + _remove_temp_files(tokenizer_dir(output))
    for n in seq_lengths:
        removed += _remove_temp_files(seq_dir(output, n))
    return removed + _remove_temp_files(work_dir(output), recursive=True)


def prepared_seq_dirs(path: str | Path) -> list[Path]:
    """The finished ``seq<N>`` directories at ``path``: ``path`` itself when it holds a
    manifest, else those under it (an output directory)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return [path]
    return [seq_dir(path, n) for n in seq_lengths_present(path) if manifest_path(path, n).is_file()]
