"""The data preparation run: sources → tokenizer → work units → shards + manifests.

Two steps, both resumable:

1. **Units** (parallel). The main process streams documents from the sources (round-robin
   across sources) and cuts them into work units of about ``unit_bytes`` of text. A pool
   of workers cleans, sentence-splits and tokenizes each unit and turns it into training
   rows for every sequence length, drawing random-next segments from the same unit, with
   a random generator seeded by (seed, unit, length, split). A unit's files are renamed
   into place and then its ``.done.json`` marker: a rerun skips units that have a marker,
   and never sees half of one. Rows depend only on the unit, so the output is the same
   whatever the number of workers.
2. **Shards** (sequential, I/O bound). Per sequence length, units are read in order, mixed
   through a seeded shuffle buffer and cut into train shards of exactly
   ``sequences_per_shard`` rows; held-out documents go to validation shards. Shard files
   already present from an interrupted run are reused. The manifest is written last.

A finished output directory with a matching fingerprint is left as it is (idempotent).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import time
import zlib
from collections import deque
from collections.abc import Iterator
from multiprocessing import get_context
from pathlib import Path

from data_prep.config import DataPrepConfig
from data_prep.instances import (
    full_sentence_chunks,
    nsp_pairs,
    rows_from_chunks,
    rows_from_pairs,
)
from data_prep.outputs import (
    TOKENIZER,
    check_output_path,
    manifest_path,
    remove_stale_temp_files,
    seq_dir,
    seq_lengths_present,
    tokenizer_dir,
    work_dir,
    write_manifest,
)
from data_prep.shard_writer import unit_path, write_shards
from data_prep.sources import (
    RawDocument,
    TextQuality,
    check_sources,
    input_bytes,
    read_source,
)
from data_prep.text import document_sentences
from data_prep.tokenizer import build_tokenizer, load_backend, save_tokenizer, tokenizer_hash
from onebit_bert.config import to_dict
from onebit_bert.io import atomic_write_json
from onebit_bert.run_lock import holding_lock
from onebit_bert.shards import FORMAT_VERSION, write_shard

log = logging.getLogger("data_prep")

# Settings that do not change the bytes written (left out of the fingerprint).
_NOT_IN_FINGERPRINT = (
    "output",
    "data_root",
    "workers",
    "keep_work",
    "progress",
    "max_bad_char_fraction",
)


class OutputConflictError(ValueError):
    """The output directory holds data prepared with different settings."""


# ----------------------------------------------------------------------------- units


def iter_units(
    cfg: DataPrepConfig, counter: list[int], quality: dict[str, TextQuality] | None = None
) -> Iterator[list[RawDocument]]:
    """Work units of at least two documents and ``unit_bytes`` of text, taking one unit
    from each source in turn so the sources stay mixed along the output. ``quality``
    (when given) collects the character counts of each source by name."""
    quality = quality if quality is not None else {}
    streams = [
        read_source(cfg, s, counter, quality.setdefault(s.name, TextQuality())) for s in cfg.sources
    ]
    while streams:
        for stream in list(streams):
            unit, size = [], 0
            for doc in stream:
                unit.append(doc)
                size += len(doc.text)
                if size >= cfg.unit_bytes and len(unit) >= 2:
                    break
            else:
                streams.remove(stream)
            if unit:
                yield unit


def is_validation(text: str, fraction: float) -> bool:
    """Documents are held out by a hash of their text: stable, and a duplicated document
    lands on the same side."""
    return fraction > 0 and zlib.crc32(text.encode("utf-8", "replace")) / 2**32 < fraction


_worker: dict = {}


def _init_worker(tokenizer_dir: str, sep_id: int) -> None:
    # The main process handles Ctrl-C and SIGTERM and terminates the pool (SIGTERM's
    # default action ends a worker without a word); a worker raising KeyboardInterrupt
    # itself would only add a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = load_backend(tokenizer_dir)
    _worker["tokenizer"] = tokenizer
    _worker["marker"] = sentence_marker(tokenizer, sep_id)


def sentence_marker(tokenizer, sep_id: int) -> tuple[str, int]:
    """A string the tokenizer always turns into one token of its own, to join sentences.

    The pilcrow (a punctuation mark, so pre-tokenization isolates it, and a whole token of
    BERT's vocabulary) is cheapest; a vocabulary without it falls back to ``[SEP]``, which
    costs a special-token scan of the text (about 20 % slower)."""
    pilcrow = tokenizer.token_to_id("¶")
    if pilcrow is not None:
        probe = tokenizer.encode("a¶b ¶ c", add_special_tokens=False).ids
        if probe.count(pilcrow) == 2 and len(probe) == 5:
            return "¶", pilcrow
    return tokenizer.id_to_token(sep_id), sep_id


def tokenize_documents(
    docs: list[RawDocument], tokenizer, marker: str, marker_id: int
) -> list[tuple[str, list[list[int]]]]:
    """(cleaned text, sentences as token ids) per document that has any tokens. The cleaned
    text (sentences joined by newlines) does not depend on the file format it came from.

    Each document is tokenized in one call, its sentences joined by ``marker`` (see
    :func:`sentence_marker`; the marker is removed from the text first), and cut apart
    again at its id: one long input per document instead of one per sentence is 1.5-1.7x
    faster, and the ids are the same (no WordPiece crosses a sentence boundary).
    """
    sep_id = marker_id
    texts, cleaned = [], []
    for doc in docs:
        text = doc.text if doc.layout == "blocks" else doc.text.replace("\n", "\n\n")
        if marker in text:  # a literal marker in the text would cut a sentence
            text = text.replace(marker, " ")
        sentences = document_sentences(text)
        cleaned.append("\n".join(sentences))
        texts.append(f" {marker} ".join(sentences))
    out = []
    for text, encoding in zip(
        cleaned, tokenizer.encode_batch_fast(texts, add_special_tokens=False), strict=True
    ):
        ids, sentences, begin = encoding.ids, [], 0
        while True:
            try:
                end = ids.index(sep_id, begin)
            except ValueError:
                end = len(ids)
            if end > begin:
                sentences.append(ids[begin:end])
            if end == len(ids):
                break
            begin = end + 1
        if sentences:
            out.append((text, sentences))
    return out


def process_unit(task: tuple) -> dict:
    """Tokenize one unit and write its rows for every length and split (worker side)."""
    index, docs, work, settings = task
    tokens = tokenize_documents(docs, _worker["tokenizer"], *_worker["marker"])
    splits = {"train": [], "validation": []}
    for text, ids in tokens:
        splits[
            "validation" if is_validation(text, settings["validation_fraction"]) else "train"
        ].append(ids)
    stats = {
        "documents": {k: len(v) for k, v in splits.items()},
        "tokens": sum(len(s) for _, ids in tokens for s in ids),
        "sentences": sum(len(ids) for _, ids in tokens),
        "rows": {},
    }
    for seq_length in settings["seq_lengths"]:
        for split, split_docs in splits.items():
            rng = random.Random(f"{settings['seed']}/{index}/{seq_length}/{split}")
            if settings["mode"] == "nsp":
                pairs = nsp_pairs(
                    split_docs,
                    seq_length,
                    settings["short_seq_prob"],
                    settings["random_next_prob"],
                    rng,
                )
                rows = rows_from_pairs(pairs, seq_length, settings["cls"], settings["sep"])
            else:
                chunks = full_sentence_chunks(split_docs, seq_length, settings["sep"])
                rows = rows_from_chunks(chunks, seq_length, settings["cls"], settings["sep"])
            write_shard(unit_path(work, seq_length, split, index), rows)
            stats["rows"][f"{seq_length}/{split}"] = len(rows)
    atomic_write_json(done_path(work, index), stats)
    return stats


def done_path(work: Path, index: int) -> Path:
    return work / "done" / f"{index:07d}.json"


# ----------------------------------------------------------------------------- shards


def fingerprint(cfg: DataPrepConfig, described: dict) -> str:
    settings = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_IN_FINGERPRINT}
    for source in settings["sources"]:  # the default leaves earlier fingerprints unchanged
        if source.get("encoding") == "utf-8":
            del source["encoding"]
    blob = json.dumps(
        {"format": FORMAT_VERSION, "config": settings, "sources": described}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _training_texts(cfg: DataPrepConfig) -> Iterator[str]:
    budget = cfg.tokenizer.train_max_bytes
    for unit in iter_units(cfg, [0]):
        for doc in unit:
            yield doc.text
            budget -= len(doc.text)
            if budget <= 0:
                return


def token_rate(tokens: int, seconds: float) -> str:
    """``tokens`` tokenized in ``seconds``, as the progress bar shows it, in the unit that
    keeps three significant digits: ``850 tok/s``, ``12.3k tok/s``, ``4.56M tok/s``."""
    rate = tokens / max(seconds, 1e-9)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= scale:
            value = rate / scale
            return f"{value:.3g}{suffix} tok/s" if value < 100 else f"{value:.0f}{suffix} tok/s"
    return f"{rate:.0f} tok/s"


def _progress(cfg: DataPrepConfig, total: int | None):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="units", smoothing=0.1)


def prepare(cfg: DataPrepConfig) -> dict[int, dict]:
    """Run (or resume, or confirm) the preparation; returns the manifest per length.
    The output's run lock (``run.lock``) is held throughout: a second preparation of the
    same output stops with :class:`~onebit_bert.run_lock.RunLocked` naming the first."""
    out = Path(cfg.output)
    check_output_path(out)
    described = check_sources(cfg)  # every input opened before any expensive work
    # one writer per output, as pretraining and fine-tuning have per run directory
    with holding_lock(out):
        return _prepare(cfg, out, described)


def _prepare(cfg: DataPrepConfig, out: Path, described: dict) -> dict[int, dict]:
    print_ = log.info
    fp = fingerprint(cfg, described)
    manifests = _finished_manifests(cfg, fp)
    if manifests is not None:
        print_("data_prep: %s is complete and up to date", out)
        return manifests
    work = work_dir(out)
    _claim_work_dir(work, fp, out)
    stale = remove_stale_temp_files(out, cfg.instances.seq_lengths)
    if stale:
        print_("data_prep: removed %d temporary file(s) left by an interrupted run", stale)

    tok_dir = tokenizer_dir(out)
    if not (tok_dir / "tokenizer.json").is_file():
        texts = _training_texts(cfg) if cfg.tokenizer.train else None
        save_tokenizer(build_tokenizer(cfg, texts), tok_dir)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    settings = {
        "seq_lengths": cfg.instances.seq_lengths,
        "mode": cfg.instances.mode,
        "short_seq_prob": cfg.instances.short_seq_prob,
        "random_next_prob": cfg.instances.random_next_prob,
        "validation_fraction": cfg.validation_fraction,
        "seed": cfg.seed,
        "cls": hf_tok.cls_token_id,
        "sep": hf_tok.sep_token_id,
    }

    start = time.perf_counter()
    totals = _run_units(cfg, work, tok_dir, settings, input_bytes(described))
    unit_seconds = time.perf_counter() - start

    manifests = {}
    for seq_length in cfg.instances.seq_lengths:
        splits = write_shards(cfg, work, seq_length, totals["units"])
        if splits["train"]["sequences"] == 0:
            raise ValueError(
                f"seq {seq_length}: the corpus gave {splits['train']['dropped_sequences']} train "
                f"sequences, fewer than one shard of {cfg.sequences_per_shard}; lower "
                f"sequences_per_shard"
            )
        _warn_about_losses(cfg, seq_length, splits, totals["tokens"])
        manifest = {
            "format_version": FORMAT_VERSION,
            "seq_length": seq_length,
            "mode": cfg.instances.mode,
            "sequences_per_shard": cfg.sequences_per_shard,
            "splits": splits,
            "documents": totals["documents"],
            "corpus_tokens": totals["tokens"],
            "sentences": totals["sentences"],
            "units": totals["units"],
            "tokenizer": {
                "path": f"../{TOKENIZER}",
                "sha256": tokenizer_hash(tok_dir),
                "vocab_size": len(hf_tok),
            },
            "sources": described,
            "source_quality": totals["quality"],
            "fingerprint": fp,
            "config": to_dict(cfg),
        }
        write_manifest(out, seq_length, manifest)
        manifests[seq_length] = manifest
    if not cfg.keep_work:
        shutil.rmtree(work)
    print_(
        "data_prep: %d tokens in %.1f s (units step), output in %s",
        totals["tokens"],
        unit_seconds,
        out,
    )
    return manifests


KEPT_WARNING = 0.5
"""Below this share of the corpus's tokens in the shards' rows, data_prep warns."""


def kept_fraction(mode: str, splits: dict, corpus_tokens: int) -> float:
    """The corpus's tokens in the rows of both splits (special tokens not counted) as a
    share of the tokens the corpus has. NSP rows repeat some text (a random B is drawn
    from elsewhere), so a sound corpus comes out near or above 1."""
    specials = 3 if mode == "nsp" else 2
    content = sum(s["tokens"] - specials * s["sequences"] for s in splits.values())
    return content / max(corpus_tokens, 1)


def _warn_about_losses(cfg: DataPrepConfig, seq_length: int, splits: dict, tokens: int) -> None:
    """A warning (not an error: the shards are usable) when most of the text did not make
    it into rows, or the validation split came out empty."""
    kept = kept_fraction(cfg.instances.mode, splits, tokens)
    if kept < KEPT_WARNING:
        log.warning(
            "data_prep: seq %d: the rows hold %.2f %% of the corpus's %d tokens; the rest was "
            "truncated or dropped (%d train rows short of a shard). Check for documents "
            "far longer than a sequence without sentence punctuation, or lower "
            "sequences_per_shard",
            seq_length,
            100 * kept,
            tokens,
            splits["train"]["dropped_sequences"],
        )
    if cfg.validation_fraction > 0 and splits["validation"]["sequences"] == 0:
        log.warning(
            "data_prep: seq %d: the validation split is empty although validation_fraction "
            "is %g: the corpus has too few documents (documents are held out whole)",
            seq_length,
            cfg.validation_fraction,
        )


def _finished_manifests(cfg: DataPrepConfig, fp: str) -> dict[int, dict] | None:
    manifests = {}
    for seq_length in cfg.instances.seq_lengths:
        path = manifest_path(cfg.output, seq_length)
        if not path.is_file():
            return None
        manifest = json.loads(path.read_text())
        if manifest.get("fingerprint") != fp:
            raise OutputConflictError(
                f"{path} was prepared with other settings or inputs; choose another output "
                f"directory or delete {Path(cfg.output)}"
            )
        manifests[seq_length] = manifest
    return manifests


def _claim_work_dir(work: Path, fp: str, out: Path) -> None:
    marker = work / "fingerprint.json"
    if marker.is_file():
        if json.loads(marker.read_text())["fingerprint"] != fp:
            raise OutputConflictError(
                f"{out} holds an unfinished run with other settings or inputs; choose another "
                f"output directory or delete {out}"
            )
        return
    if out.exists() and any(out.iterdir()):
        stale = [seq_dir(out, n).name for n in seq_lengths_present(out)]
        if stale:
            raise OutputConflictError(
                f"{out} already holds {stale} from another run; choose another output "
                f"directory or delete {out}"
            )
    atomic_write_json(marker, {"fingerprint": fp})


def _run_units(cfg, work: Path, tokenizer_dir: Path, settings: dict, total: int | None) -> dict:
    totals = {"units": 0, "tokens": 0, "sentences": 0, "documents": {"train": 0, "validation": 0}}

    tokenized = [0]  # tokens of the units this run processed (not of resumed ones): the rate

    def account(stats: dict, fresh: bool = True) -> None:
        tokenized[0] += stats["tokens"] if fresh else 0
        totals["tokens"] += stats["tokens"]
        totals["sentences"] += stats["sentences"]
        for split, n in stats["documents"].items():
            totals["documents"][split] += n

    counter = [0]
    quality: dict[str, TextQuality] = {}
    bar = _progress(cfg, total)
    ctx = get_context("spawn")
    started = time.perf_counter()
    with ctx.Pool(
        cfg.num_workers, initializer=_init_worker, initargs=(str(tokenizer_dir), settings["sep"])
    ) as pool:
        inflight: deque = deque()
        for index, unit in enumerate(iter_units(cfg, counter, quality)):
            totals["units"] = index + 1
            done = done_path(work, index)
            if done.is_file():
                account(json.loads(done.read_text()), fresh=False)
            else:
                inflight.append(pool.apply_async(process_unit, ((index, unit, work, settings),)))
            while len(inflight) > 2 * cfg.num_workers:  # bounded memory: a few units at once
                account(inflight.popleft().get())
            if bar is not None:
                bar.n = counter[0]
                rate = token_rate(tokenized[0], time.perf_counter() - started)
                bar.set_postfix_str(rate, refresh=False)
                bar.refresh()
        while inflight:
            account(inflight.popleft().get())
    if bar is not None:
        bar.set_postfix_str(token_rate(tokenized[0], time.perf_counter() - started))
        bar.close()
    totals["quality"] = {name: q.as_dict() for name, q in quality.items()}
    return totals
