"""Source text quality (undecodable bytes, control characters, encodings) and the bounds on
document size (data_prep.sources)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from data_prep import sources
from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare
from data_prep.sources import RawDocument, SourceError, TextQuality, read_source
from onebit_bert.config import from_dict
from tests.helpers.corpus import write_corpus, write_vocab


def _config(tmp: Path, source: dict, **overrides) -> DataPrepConfig:
    items = {
        "output": str(tmp / "out"),
        "sources": [{"name": "src", "kind": "text", **source}],
        "tokenizer": {"vocab_file": str(write_vocab(tmp / "vocab.txt"))},
        "instances": {"seq_lengths": [32]},
        "sequences_per_shard": 16,
        "unit_bytes": 3000,
        "validation_fraction": 0.0,
        "workers": 1,
        "progress": False,
        **overrides,
    }
    return from_dict(DataPrepConfig, items)


def _documents(cfg: DataPrepConfig) -> tuple[list[str], TextQuality]:
    quality = TextQuality()
    texts = [d.text for d in read_source(cfg, cfg.sources[0], [0], quality)]
    return texts, quality


def test_random_bytes_are_refused_before_any_shard(tmp_path):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(random.Random(0).randbytes(200_000))
    cfg = _config(tmp_path, {"name": "noise", "paths": [str(noise)]})
    with pytest.raises(SourceError, match=r"source 'noise': \d+\.\d+% of its \d+ characters"):
        prepare(cfg)
    assert not list((tmp_path / "out").glob("seq*/*.npy"))


def test_latin1_text_needs_its_encoding(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("Le café est bon.\nUn autre café.\n\nLa suite.\n".encode("latin-1") * 50)
    # As UTF-8, each é is one undecodable byte: counted, no longer silently dropped.
    cfg = _config(tmp_path, {"paths": [str(path)]}, max_bad_char_fraction=1.0)
    texts, quality = _documents(cfg)
    assert "caf\ufffd" in texts[0]
    assert quality.undecodable == 100 and quality.control == 0
    with pytest.raises(SourceError, match=r"source 'src': .*\(100 undecodable.*encoding"):
        _documents(_config(tmp_path, {"paths": [str(path)]}))
    texts, quality = _documents(_config(tmp_path, {"paths": [str(path)], "encoding": "latin-1"}))
    assert texts[0] == "Le café est bon.\nUn autre café.\n"
    assert quality.undecodable == 0 and quality.bad_fraction == 0.0


def test_unknown_encoding_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="unknown encoding 'no-such-codec'"):
        _config(tmp_path, {"paths": ["x.txt"], "encoding": "no-such-codec"})


def test_control_characters_are_counted_in_jsonl(tmp_path):
    path = tmp_path / "c.jsonl"
    records = [{"text": "Bell \x07 here.\tTab kept."}, {"text": "Null \x00 and \x1b escape."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = _config(tmp_path, {"kind": "jsonl", "paths": [str(path)]}, max_bad_char_fraction=1.0)
    _, quality = _documents(cfg)
    assert quality.control == 3 and quality.undecodable == 0


def test_manifest_records_the_quality_of_each_source(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", n_docs=120)
    text = corpus["text"].read_text()
    corpus["text"].write_text(text.replace("Bird", "B\x01ird", 3))
    cfg = _config(tmp_path, {"paths": [str(corpus["text"])]})
    manifest = prepare(cfg)[32]
    assert manifest["sources"]["src"][0]["sha256"]  # the existing section is unchanged
    quality = manifest["source_quality"]["src"]
    assert quality["control"] == 3 and quality["undecodable"] == 0
    assert quality["characters"] == len(text) + 3 - text.count("\n\n")
    assert 0 < quality["bad_fraction"] < 0.01


def test_giant_documents_are_cut_into_bounded_pieces(tmp_path, monkeypatch):
    words = " ".join(f"Word{i % 89}." for i in range(30_000))
    pieces = list(sources.bounded_documents(RawDocument(words, "lines"), limit=1000))
    assert max(len(p.text) for p in pieces) <= 1000
    assert "".join(p.text for p in pieces) == words  # cut at spaces, nothing lost
    assert all(p.text.endswith(" ") for p in pieces[:-1])
    lines = "\n".join(["line of text"] * 500)
    pieces = list(sources.bounded_documents(RawDocument(lines, "lines"), limit=100))
    assert all(p.text.endswith("\n") for p in pieces[:-1])  # at line breaks first
    small = RawDocument("short", "lines")
    assert list(sources.bounded_documents(small, limit=100)) == [small]
    # Through the reader: one file that is a single line becomes many bounded documents.
    path = tmp_path / "one_line.txt"
    path.write_text(words)
    monkeypatch.setattr(sources, "MAX_DOCUMENT_CHARS", 5000)
    texts, quality = _documents(_config(tmp_path, {"paths": [str(path)]}))
    assert len(texts) > 1 and max(map(len, texts)) <= 5000
    assert quality.characters == len(words)
