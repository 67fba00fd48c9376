"""Corpus readers: every source becomes a stream of raw documents.

A :class:`RawDocument` carries its text and how its paragraphs are laid out: ``lines``
(one paragraph, or sentence, per line: WikiExtractor, Google's text format, JSONL/Parquet
records) or ``blocks`` (paragraphs separated by blank lines, lines hard-wrapped: books).
Cleaning and sentence splitting happen later, in the workers.

:func:`check_sources` opens every local file before any expensive work and fails with
one clear error naming a file that is missing, empty or unreadable.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from data_prep.config import DataPrepConfig, SourceConfig
from onebit_bert.io import sha256_file

PROBE_BYTES = 1 << 16


class SourceError(ValueError):
    """A corpus that cannot be read; the message names the file or dataset and the fix."""


@dataclass(frozen=True)
class RawDocument:
    """One document read from a source, before sentence splitting. ``layout`` says how its
    paragraphs are separated: ``"lines"``, one paragraph per line; ``"blocks"``, blank
    lines between paragraphs."""

    text: str
    layout: str  # "lines" or "blocks"


class CountingReader(io.RawIOBase):
    """Counts the bytes read from a binary file (progress for compressed inputs)."""

    def __init__(self, raw, counter: list[int]):
        self._raw, self._counter = raw, counter

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        self._counter[0] += n or 0
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_text(path: str, counter: list[int] | None = None) -> io.TextIOBase:
    """Open plain, .gz or .bz2 text as UTF-8 (undecodable bytes become U+FFFD)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed through the returned wrapper
    if counter is not None:
        raw = io.BufferedReader(CountingReader(raw, counter), 1 << 20)
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    elif path.endswith(".bz2"):
        raw = bz2.BZ2File(raw)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline=None)


def expand_paths(cfg: DataPrepConfig, source: SourceConfig) -> list[str]:
    files: list[str] = []
    for pattern in source.paths:
        full = cfg.resolve(pattern)
        matches = sorted(glob.glob(full, recursive=True)) if glob.has_magic(full) else [full]
        matches = [m for m in matches if not os.path.isdir(m)]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise SourceError(
                f"source {source.name!r}: no file matches {full!r} "
                f"(check the path, or set data_root / DATA_ROOT)"
            )
        files.extend(matches)
    return files


def _probe(source: SourceConfig, path: str) -> None:
    """Read the start of ``path`` the way the reader will, to fail early and clearly."""
    if os.path.getsize(path) == 0:
        raise SourceError(f"source {source.name!r}: {path} is empty")
    try:
        if source.kind == "parquet":
            import pyarrow.parquet as pq

            schema = pq.ParquetFile(path).schema_arrow
            if source.text_column not in schema.names:
                raise SourceError(
                    f"source {source.name!r}: {path} has no column {source.text_column!r} "
                    f"(columns: {schema.names}); set text_column"
                )
            return
        with open_text(path) as f:
            head = f.read(PROBE_BYTES)
    except SourceError:
        raise
    except (OSError, EOFError, ValueError, UnicodeError) as err:
        raise SourceError(f"source {source.name!r}: cannot read {path}: {err}") from None
    except Exception as err:  # pyarrow raises its own error types
        raise SourceError(f"source {source.name!r}: cannot read {path}: {err}") from None
    if not head.strip():
        raise SourceError(f"source {source.name!r}: {path} holds no text")
    if source.kind == "wikiextractor" and "<doc" not in head:
        raise SourceError(
            f"source {source.name!r}: {path} does not look like WikiExtractor output "
            f"(no <doc ...> record at its start); use kind: text for plain text"
        )
    if source.kind == "jsonl":
        first = head.split("\n", 1)[0]
        try:
            record = json.loads(first)
        except json.JSONDecodeError as err:
            raise SourceError(
                f"source {source.name!r}: {path} line 1 is not JSON ({err.msg})"
            ) from None
        if not isinstance(record, dict) or source.text_column not in record:
            raise SourceError(
                f"source {source.name!r}: {path} line 1 has no key {source.text_column!r}; "
                f"set text_column"
            )


def check_sources(cfg: DataPrepConfig) -> dict[str, list[dict]]:
    """Resolve and open every source; returns, per source, its files with size and sha256
    (hub sources: the dataset coordinates). Raises :class:`SourceError` on the first bad one."""
    described: dict[str, list[dict]] = {}
    for source in cfg.sources:
        if source.kind == "hub":
            _open_hub(source)  # fails fast when the hub is unreachable
            described[source.name] = [
                {"hub_id": source.hub_id, "config": source.hub_config, "split": source.hub_split}
            ]
            continue
        files = expand_paths(cfg, source)
        for path in files:
            _probe(source, path)
        described[source.name] = [
            {"path": _display_path(cfg, p), "bytes": os.path.getsize(p), "sha256": sha256_file(p)}
            for p in files
        ]
    return described


def _display_path(cfg: DataPrepConfig, path: str) -> str:
    """Paths under data_root are recorded relative to it, so manifests move with the data."""
    rel = os.path.relpath(path, cfg.data_root)
    return path if rel.startswith("..") else rel


def _open_hub(source: SourceConfig):
    try:
        import datasets

        stream = datasets.load_dataset(
            source.hub_id, source.hub_config, split=source.hub_split, streaming=True
        )
        iterator = iter(stream)
        first = next(iterator)
    except Exception as err:
        raise SourceError(
            f"source {source.name!r}: cannot stream hub dataset {source.hub_id!r} "
            f"({source.hub_config}, {source.hub_split}): {type(err).__name__}: {err}. Without "
            f"network access, download it elsewhere and point a parquet/jsonl source at the "
            f"files under data_root"
        ) from None
    if source.text_column not in first:
        raise SourceError(
            f"source {source.name!r}: hub dataset {source.hub_id!r} has no column "
            f"{source.text_column!r} (columns: {sorted(first)}); set text_column"
        )
    return stream


# ----------------------------------------------------------------------------- readers


def _wikiextractor(path: str, counter) -> Iterator[RawDocument]:
    lines: list[str] | None = None
    with open_text(path, counter) as f:
        for line in f:
            if line.startswith("<doc "):
                lines = []
            elif line.startswith("</doc>"):
                if lines:
                    # The first line of a record is the article title, not prose.
                    body = "".join(lines[1:]).strip()
                    if body:
                        yield RawDocument(body, "lines")
                lines = None
            elif lines is not None:
                lines.append(line)


def _text(path: str, source: SourceConfig, counter) -> Iterator[RawDocument]:
    with open_text(path, counter) as f:
        if source.documents == "file":
            text = f.read()
            if text.strip():
                yield RawDocument(text, "blocks")
            return
        lines: list[str] = []
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield RawDocument("".join(lines), "lines")
                lines = []
        if lines:
            yield RawDocument("".join(lines), "lines")


def _jsonl(path: str, source: SourceConfig, counter) -> Iterator[RawDocument]:
    with open_text(path, counter) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[source.text_column]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SourceError(
                    f"source {source.name!r}: {path} line {number} is not a JSON object with "
                    f"a {source.text_column!r} key"
                ) from None
            if isinstance(text, str) and text.strip():
                yield RawDocument(text, "lines")


def _parquet(path: str, source: SourceConfig, counter) -> Iterator[RawDocument]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    per_group = os.path.getsize(path) / max(1, pf.num_row_groups)
    for group in range(pf.num_row_groups):
        table = pf.read_row_group(group, columns=[source.text_column])
        for text in table.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield RawDocument(text, "lines")
        counter[0] += int(per_group)


def _hub(source: SourceConfig) -> Iterator[RawDocument]:
    for record in _open_hub(source):
        text = record.get(source.text_column)
        if isinstance(text, str) and text.strip():
            yield RawDocument(text, "lines")


def read_source(
    cfg: DataPrepConfig, source: SourceConfig, counter: list[int]
) -> Iterator[RawDocument]:
    """All documents of one source, in file order, with its weight and document cap applied.
    ``counter[0]`` advances by the input bytes consumed (for progress)."""
    if source.kind == "hub":
        docs: Iterator[RawDocument] = _hub(source)
    else:
        docs = _file_documents(cfg, source, counter)
    for emitted, doc in enumerate(docs, start=1):
        for _ in range(copies(doc.text, source.weight, source.name)):
            yield doc
        if source.max_documents is not None and emitted >= source.max_documents:
            return


def _file_documents(cfg, source, counter) -> Iterator[RawDocument]:
    for path in expand_paths(cfg, source):
        if source.kind == "wikiextractor":
            yield from _wikiextractor(path, counter)
        elif source.kind == "text":
            yield from _text(path, source, counter)
        elif source.kind == "jsonl":
            yield from _jsonl(path, source, counter)
        elif source.kind == "parquet":
            yield from _parquet(path, source, counter)


def copies(text: str, weight: float, salt: str) -> int:
    """How many times a document is used under ``weight`` (a deterministic draw)."""
    whole = int(weight)
    frac = weight - whole
    if frac == 0.0:
        return whole
    u = zlib.crc32(text.encode("utf-8", "replace"), zlib.crc32(salt.encode())) / 2**32
    return whole + (1 if u < frac else 0)


def input_bytes(described: dict[str, list[dict]]) -> int | None:
    """Total input size for progress, or None when a source streams from the hub."""
    total = 0
    for files in described.values():
        for f in files:
            if "bytes" not in f:
                return None
            total += f["bytes"]
    return total
