"""Corpus readers: every source becomes a stream of raw documents.

A :class:`RawDocument` carries its text and how its paragraphs are laid out: ``lines``
(one paragraph, or sentence, per line: WikiExtractor, Google's text format, JSONL/Parquet
records) or ``blocks`` (paragraphs separated by blank lines, lines hard-wrapped: books).
Cleaning and sentence splitting happen later, in the workers.

:func:`check_sources` opens every local file before any expensive work and fails with
one clear error naming a file that is missing, empty or unreadable; an empty file among
others that hold text is skipped with a warning (it adds no documents).

:func:`read_source` counts, per source, the characters read, the undecodable bytes (each
becomes one U+FFFD) and the control characters other than tab, newline and carriage
return (:class:`TextQuality`), and refuses a source whose share of such characters is above
``max_bad_char_fraction`` once it has been read to its end. It also cuts a document longer
than :data:`MAX_DOCUMENT_CHARS` into several documents, so that the work on one document
(and the memory it needs) stays bounded whatever the input.
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import io
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from data_prep.config import DataPrepConfig, SourceConfig
from onebit_bert.io import sha256_file

log = logging.getLogger("data_prep")

PROBE_BYTES = 1 << 16

MAX_DOCUMENT_CHARS = 4_000_000
"""Longest document passed on whole; a longer one (a book of more than about 4 MB, a file
that is one giant line) is cut into documents of at most this many characters, at a blank
line, else a line break, else a space, else anywhere."""

# Undecodable input bytes become one U+FFFD each (Python's "replace" handler gives one per
# invalid sequence), so counting U+FFFD in the text counts the bytes.
_REPLACE_BYTES = "data_prep.replace_bytes"
codecs.register_error(_REPLACE_BYTES, lambda err: ("\ufffd" * (err.end - err.start), err.end))

# C0 and C1 controls and DEL, except tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class SourceError(ValueError):
    """A corpus that cannot be read; the message names the file or dataset and the fix."""


@dataclass(frozen=True)
class RawDocument:
    """One document read from a source, before sentence splitting. ``layout`` says how its
    paragraphs are separated: ``"lines"``, one paragraph per line; ``"blocks"``, blank
    lines between paragraphs."""

    text: str
    layout: str  # "lines" or "blocks"


@dataclass
class TextQuality:
    """What one source's documents are made of: characters read, undecodable bytes (and
    U+FFFD already in the text) and control characters other than tab, newline and CR."""

    characters: int = 0
    undecodable: int = 0
    control: int = 0

    def add(self, text: str) -> None:
        self.characters += len(text)
        self.undecodable += text.count("\ufffd")
        if _CONTROL.search(text) is not None:
            self.control += sum(1 for _ in _CONTROL.finditer(text))

    @property
    def bad_fraction(self) -> float:
        return (self.undecodable + self.control) / max(1, self.characters)

    def as_dict(self) -> dict:
        return {
            "characters": self.characters,
            "undecodable": self.undecodable,
            "control": self.control,
            "bad_fraction": round(self.bad_fraction, 6),
        }


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


def open_text(
    path: str, counter: list[int] | None = None, encoding: str = "utf-8"
) -> io.TextIOBase:
    """Open plain, .gz or .bz2 text (undecodable bytes become one U+FFFD each)."""
    raw = open(path, "rb")  # noqa: SIM115 - closed through the returned wrapper
    if counter is not None:
        raw = io.BufferedReader(CountingReader(raw, counter), 1 << 20)
    if path.endswith(".gz"):
        raw = gzip.GzipFile(fileobj=raw)
    elif path.endswith(".bz2"):
        raw = bz2.BZ2File(raw)
    return io.TextIOWrapper(raw, encoding=encoding, errors=_REPLACE_BYTES, newline=None)


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


def _holds_no_text(source: SourceConfig, path: str) -> bool:
    """Whether ``path`` is empty: no bytes, or (plain text sources) nothing but
    whitespace in its first :data:`PROBE_BYTES` of a file no longer than that."""
    size = os.path.getsize(path)
    if size == 0:
        return True
    if source.kind != "text" or size > PROBE_BYTES or path.endswith((".gz", ".bz2")):
        return False
    try:
        with open(path, "rb") as f:
            return not f.read().strip()
    except OSError:
        return False  # the probe names the error


def _and_others(paths: list[str]) -> str:
    return f" (and so are the other {len(paths) - 1} files of the source)" if len(paths) > 1 else ""


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
        with open_text(path, encoding=source.encoding) as f:
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
        empty = [p for p in files if _holds_no_text(source, p)]
        if len(empty) == len(files):
            what = "is empty" if os.path.getsize(empty[0]) == 0 else "holds no text"
            raise SourceError(f"source {source.name!r}: {empty[0]} {what}" + _and_others(empty))
        if empty:
            # one empty file of many (an interrupted export, a placeholder) is no reason to
            # refuse the rest: it adds no documents
            log.warning(
                "data_prep: source %r: %d of its %d files hold no text and add nothing: %s",
                source.name,
                len(empty),
                len(files),
                ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else ""),
            )
        for path in files:
            if path not in empty:
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


def _wikiextractor(path: str, source: SourceConfig, counter) -> Iterator[RawDocument]:
    lines: list[str] | None = None
    with open_text(path, counter, source.encoding) as f:
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
    with open_text(path, counter, source.encoding) as f:
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
    with open_text(path, counter, source.encoding) as f:
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
    cfg: DataPrepConfig,
    source: SourceConfig,
    counter: list[int],
    quality: TextQuality | None = None,
) -> Iterator[RawDocument]:
    """All documents of one source, in file order, with its weight and document cap applied
    and documents longer than :data:`MAX_DOCUMENT_CHARS` cut up. ``counter[0]`` advances by
    the input bytes consumed (for progress); ``quality`` (when given) counts the characters
    read. Raises :class:`SourceError` at the end of the source when its share of bad
    characters is above ``cfg.max_bad_char_fraction``."""
    quality = quality if quality is not None else TextQuality()
    if source.kind == "hub":
        docs: Iterator[RawDocument] = _hub(source)
    else:
        docs = _file_documents(cfg, source, counter)
    for emitted, doc in enumerate(docs, start=1):
        quality.add(doc.text)
        for piece in bounded_documents(doc):
            for _ in range(copies(piece.text, source.weight, source.name)):
                yield piece
        if source.max_documents is not None and emitted >= source.max_documents:
            break
    check_quality(cfg, source, quality)


def check_quality(cfg: DataPrepConfig, source: SourceConfig, quality: TextQuality) -> None:
    """Refuse a source whose share of undecodable and control characters is too high."""
    if quality.bad_fraction > cfg.max_bad_char_fraction:
        hint = (
            f"; set encoding (now {source.encoding!r}) if the files are not in it"
            if source.kind in ("text", "wikiextractor", "jsonl")
            else ""
        )
        raise SourceError(
            f"source {source.name!r}: {quality.bad_fraction:.2%} of its {quality.characters} "
            f"characters are bad ({quality.undecodable} undecodable, {quality.control} control "
            f"characters), above max_bad_char_fraction={cfg.max_bad_char_fraction}{hint}"
        )


def bounded_documents(doc: RawDocument, limit: int | None = None) -> Iterator[RawDocument]:
    """``doc`` itself, or, when longer than ``limit`` (default :data:`MAX_DOCUMENT_CHARS`),
    consecutive pieces of at most ``limit`` characters cut at the last paragraph break, line
    break or space before the limit (whitespace-only pieces are dropped)."""
    limit = MAX_DOCUMENT_CHARS if limit is None else limit
    text = doc.text
    if len(text) <= limit:
        yield doc
        return
    start = 0
    while start < len(text):
        end = start + limit
        if end < len(text):
            for sep in ("\n\n", "\n", " "):
                cut = text.rfind(sep, start + 1, end)
                if cut != -1:
                    end = cut + len(sep)
                    break
        piece = text[start:end]
        if piece.strip():
            yield RawDocument(piece, doc.layout)
        start = end


def _file_documents(cfg, source, counter) -> Iterator[RawDocument]:
    for path in expand_paths(cfg, source):
        if _holds_no_text(source, path):
            continue  # warned about by check_sources
        if source.kind == "wikiextractor":
            yield from _wikiextractor(path, source, counter)
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
