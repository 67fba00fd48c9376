"""Settings of the data preparation stage (one dataclass per section)."""

from __future__ import annotations

import codecs
import os
from dataclasses import dataclass, field
from typing import Literal

SOURCE_KINDS = ("wikiextractor", "text", "jsonl", "parquet", "hub")


@dataclass
class SourceConfig:
    """One corpus and how to read it."""

    name: str
    """Label of the source in the manifest (e.g. ``wikipedia``)."""
    kind: Literal["wikiextractor", "text", "jsonl", "parquet", "hub"]
    """``wikiextractor``: WikiExtractor output (``<doc ...>`` records, plain/.gz/.bz2);
    ``text``: plain text; ``jsonl`` / ``parquet``: one document per record;
    ``hub``: a Hugging Face hub dataset, streamed."""
    paths: list[str] = field(default_factory=list)
    """Local files or glob patterns, relative to ``data_root`` unless absolute."""
    documents: Literal["blank_line", "file"] = "blank_line"
    """``text`` only: documents separated by blank lines, one paragraph (or sentence) per
    line (Google BERT's format); or ``file``: each file is one document whose paragraphs are
    separated by blank lines (books with hard-wrapped lines)."""
    text_column: str = "text"
    """Column holding the document text (jsonl, parquet, hub)."""
    encoding: str = "utf-8"
    """Character encoding of the files (text, wikiextractor, jsonl), any Python codec name,
    e.g. ``latin-1`` or ``cp1252``; bytes it cannot decode are counted as undecodable."""
    hub_id: str | None = None
    """Hub dataset id, e.g. ``wikimedia/wikipedia``."""
    hub_config: str | None = None
    """Hub dataset configuration, e.g. ``20231101.en``."""
    hub_split: str = "train"
    weight: float = 1.0
    """Sampling rate: each document is used ``floor(weight)`` times, plus once more with
    probability ``frac(weight)`` (0.5 keeps half the documents, 2 uses each twice)."""
    max_documents: int | None = None
    """Stop after this many documents of this source (debugging, quick runs)."""

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"source {self.name!r}: weight must be > 0, got {self.weight}")
        if self.kind == "hub":
            if not self.hub_id:
                raise ValueError(f"source {self.name!r}: kind hub needs hub_id")
        elif not self.paths:
            raise ValueError(f"source {self.name!r}: kind {self.kind} needs paths")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(f"source {self.name!r}: max_documents must be >= 1")
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise ValueError(f"source {self.name!r}: unknown encoding {self.encoding!r}") from None


@dataclass
class TokenizerConfig:
    """Where the WordPiece vocabulary comes from: exactly one of the three."""

    vocab_file: str | None = None
    """A WordPiece ``vocab.txt`` (relative to ``data_root`` unless absolute)."""
    hub_name: str | None = None
    """A hub tokenizer, e.g. ``google-bert/bert-base-uncased`` (needs network)."""
    train: bool = False
    """Train a WordPiece vocabulary on the corpus with ``tokenizers``."""
    vocab_size: int = 30522
    """Size of a trained vocabulary (BERT's is 30,522); must fit uint16."""
    lowercase: bool = True
    train_max_bytes: int = 100_000_000
    """Text read (from the start of the sources) to train a vocabulary."""

    def __post_init__(self):
        chosen = [bool(self.vocab_file), bool(self.hub_name), self.train]
        if sum(chosen) != 1:
            raise ValueError(
                "set exactly one of tokenizer.vocab_file, tokenizer.hub_name, tokenizer.train"
            )
        if not 1000 <= self.vocab_size <= 65535:
            raise ValueError(
                f"tokenizer.vocab_size must be in [1000, 65535], got {self.vocab_size}"
            )


@dataclass
class InstanceConfig:
    """How token streams become training sequences (Google BERT semantics)."""

    seq_lengths: list[int] = field(default_factory=lambda: [128, 512])
    """One prepared corpus per length (phase 1: 128, phase 2: 512)."""
    mode: Literal["nsp", "full_sentences"] = "nsp"
    """``nsp``: sentence pairs A/B with a next-sentence label; ``full_sentences``: MLM-only
    packing of consecutive sentences (across documents) up to the length."""
    short_seq_prob: float = 0.1
    """Probability of a shorter target length, so the model also sees short inputs."""
    random_next_prob: float = 0.5
    """Probability that segment B comes from another document (drawn from the documents
    of the same work unit, which keeps memory bounded while streaming)."""

    def __post_init__(self):
        if not self.seq_lengths:
            raise ValueError("instances.seq_lengths is empty")
        for n in self.seq_lengths:
            if not 8 <= n <= 65535:
                raise ValueError(f"instances.seq_lengths: {n} is outside [8, 65535]")
        if len(set(self.seq_lengths)) != len(self.seq_lengths):
            raise ValueError("instances.seq_lengths has duplicates")
        for name in ("short_seq_prob", "random_next_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"instances.{name} must be in [0, 1]")


@dataclass
class DataPrepConfig:
    """The whole data preparation run."""

    sources: list[SourceConfig]
    tokenizer: TokenizerConfig
    output: str = "data/prepared"
    """Output directory: ``tokenizer/``, ``seq<N>/`` per length, ``work/`` while running."""
    data_root: str = "."
    """Base directory for relative source and vocabulary paths."""
    instances: InstanceConfig = field(default_factory=InstanceConfig)
    max_bad_char_fraction: float = 0.01
    """Largest share of undecodable bytes and control characters (other than tab, newline
    and carriage return) in a source's text; a source above it is refused, naming it and
    its share, before any shard is written (a binary file, a wrong ``encoding``)."""
    validation_fraction: float = 0.005
    """Share of documents held out for validation (chosen by a hash of the document)."""
    sequences_per_shard: int = 65536
    """Rows per train shard; every train shard has exactly this many (the remainder of
    the last one is dropped and counted in the manifest)."""
    shuffle_buffer: int = 100_000
    """Rows mixed at once when writing shards (memory: 2 x buffer x row bytes)."""
    unit_bytes: int = 4_000_000
    """Text per work unit (at least two documents): the grain of parallelism and of
    resuming, and the pool random-next segments are drawn from."""
    workers: int = 0
    """Worker processes; 0 = one per CPU core."""
    seed: int = 12345
    keep_work: bool = False
    """Keep the per-unit intermediate files after the shards are written."""
    progress: bool = True

    def __post_init__(self):
        if not self.sources:
            raise ValueError("sources is empty: name at least one corpus")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        if not 0.0 <= self.max_bad_char_fraction <= 1.0:
            raise ValueError("max_bad_char_fraction must be in [0, 1]")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError("validation_fraction must be in [0, 1)")
        if self.sequences_per_shard < 1 or self.shuffle_buffer < 1 or self.unit_bytes < 1:
            raise ValueError("sequences_per_shard, shuffle_buffer and unit_bytes must be >= 1")
        if self.workers < 0:
            raise ValueError("workers must be >= 0")

    @property
    def num_workers(self) -> int:
        return self.workers or (os.cpu_count() or 1)

    def resolve(self, path: str) -> str:
        """A path from the config, relative to ``data_root`` unless absolute."""
        return path if os.path.isabs(path) else os.path.join(self.data_root, path)
