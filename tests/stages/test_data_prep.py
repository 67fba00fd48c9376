"""The data preparation stage end to end, on corpora the tests write themselves (and on
the shared real-data folder when it is present)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.config import DataPrepConfig
from data_prep.prepare import OutputConflictError, prepare, token_rate
from data_prep.sources import SourceError
from data_prep.tokenizer import TokenizerError
from onebit_bert.config import ConfigError, load_config
from onebit_bert.shards import PretrainingShards
from tests.helpers.corpus import WORDS, write_corpus
from tests.helpers.paths import REPO, SHARED_DATA

SHARED = SHARED_DATA


def config(tmp: Path, corpus: dict[str, Path], **overrides) -> DataPrepConfig:
    items = {
        "output": str(tmp / "out"),
        "sources": [{"name": "text", "kind": "text", "paths": [str(corpus["text"])]}],
        "tokenizer": {"vocab_file": str(corpus["vocab"])},
        "instances": {"seq_lengths": [32, 64]},
        "sequences_per_shard": 64,
        "shuffle_buffer": 100,
        "unit_bytes": 3000,
        "validation_fraction": 0.1,
        "workers": 2,
        "progress": False,
    }
    items.update(overrides)
    from onebit_bert.config import from_dict

    return from_dict(DataPrepConfig, items)


def shard_digest(out: Path) -> dict[str, str]:
    """Hashes of every output file; manifests without the run-specific config section
    (output path, worker count)."""
    digest = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file() or "work" in p.relative_to(out).parts:
            continue
        data = p.read_bytes()
        if p.name == "manifest.json":
            manifest = json.loads(data)
            manifest.pop("config")
            data = json.dumps(manifest, sort_keys=True).encode()
        digest[str(p.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return digest


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("run")
    cfg = config(tmp, corpus)
    return cfg, prepare(cfg)


# ----------------------------------------------------------------------------- format


def test_format_round_trip(finished):
    cfg, manifests = finished
    for seq_length, manifest in manifests.items():
        directory = Path(cfg.output) / f"seq{seq_length}"
        train = PretrainingShards(directory, "train")
        assert len(train) == manifest["splits"]["train"]["sequences"] > 0
        assert set(train.shard_sizes) == {cfg.sequences_per_shard}  # equal work per shard
        val = PretrainingShards(directory, "validation")
        assert len(val) == manifest["splits"]["validation"]["sequences"] > 0
        rows = train.rows(np.arange(len(train)))
        n = np.arange(len(rows))
        cls, sep = 2, 3  # ids in the test vocabulary
        assert np.all(rows["input_ids"][:, 0] == cls)
        assert np.all(rows["input_ids"][n, rows["sep"]] == sep)
        assert np.all(rows["input_ids"][n, rows["length"] - 1] == sep)
        assert np.all(rows["length"] <= seq_length) and np.all(rows["sep"] >= 2)
        pad = np.arange(seq_length)[None, :] >= rows["length"][:, None]
        assert np.all(rows["input_ids"][pad] == 0)
        assert int(rows["length"].astype(np.int64).sum()) == manifest["splits"]["train"]["tokens"]
        batch = train.batch([0, len(train) - 1])
        assert batch["input_ids"].shape == (2, seq_length)
        assert set(np.unique(batch["next_sentence_label"])) <= {0, 1}
        assert train.tokenizer_dir == (Path(cfg.output) / "tokenizer").resolve()
        assert manifest["format_version"] == 1 and manifest["tokenizer"]["sha256"]
        assert manifest["sources"]["text"][0]["sha256"]
        assert manifest["config"]["seed"] == cfg.seed


def test_nsp_labels_are_balanced(finished):
    cfg, _ = finished
    rows = PretrainingShards(Path(cfg.output) / "seq64", "train").rows(np.arange(64 * 3))
    share = float((rows["nsp"] == 1).mean())
    assert 0.4 < share < 0.75


def _decoded_words(out: Path) -> set[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    row = PretrainingShards(out / "seq64").rows([0])[0]
    text = tok.decode(row["input_ids"][1 : row["sep"]])
    return set(text.replace(".", " ").replace("!", " ").replace("?", " ").split())


def test_tokenizer_is_saved_in_hf_format(finished):
    cfg, manifests = finished
    vocab_lines = Path(cfg.sources[0].paths[0]).with_name("vocab.txt").read_text().split()
    assert manifests[32]["tokenizer"]["vocab_size"] == len(vocab_lines)
    assert _decoded_words(Path(cfg.output)) <= set(WORDS)


def test_trained_vocabulary_is_saved_and_reused(tmp_path, corpus):
    # A trained vocabulary is made once, saved with the shards, and reused on resume.
    cfg = config(tmp_path, corpus, tokenizer={"train": True, "vocab_size": 1000}, keep_work=True)
    prepare(cfg)
    tokenizer_json = Path(cfg.output) / "tokenizer" / "tokenizer.json"
    saved = tokenizer_json.read_bytes()
    (Path(cfg.output) / "seq32" / "manifest.json").unlink()
    prepare(cfg)
    assert tokenizer_json.read_bytes() == saved
    assert _decoded_words(Path(cfg.output)) <= set(WORDS)


# ----------------------------------------------------------------------------- determinism


_TRAIN_IN_A_FRESH_PROCESS = """
import json, sys
from data_prep.tokenizer import train_vocabulary
texts = json.loads(sys.stdin.read())
vocab = train_vocabulary(texts, 2000, True)
print(json.dumps(vocab, sort_keys=True))
"""


def test_a_trained_vocabulary_is_the_same_in_every_process():
    # Every two-character word of 36 characters equally often: 1,296 equally frequent
    # merges for 959 slots; and 1,200 rare characters of one count each for the alphabet's
    # 1,000 places (with 36 frequent ones). The trainer alone breaks both kinds of tie in
    # hash-map order, which changes from process to process; each process here gets its own
    # hash seed.
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    words = [a + b for a in chars for b in chars]
    texts = [" ".join(words)] * 5 + [" ".join(chr(0x4E00 + i) for i in range(1200))]
    runs = [
        subprocess.run(
            [sys.executable, "-c", _TRAIN_IN_A_FRESH_PROCESS],
            input=json.dumps(texts),
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]
    vocab = json.loads(runs[0])
    assert len(vocab) == 2000 and sorted(vocab.values()) == list(range(2000))
    # the alphabet's cut: the frequent characters, then the rare ones by code point
    alphabet = [t for t in vocab if len(t) == 1]
    assert len(alphabet) == 1000 and set(chars) <= set(alphabet)
    assert sorted(set(alphabet) - set(chars)) == [chr(0x4E00 + i) for i in range(964)]
    assert sum(len(t) == 2 for t in vocab) == 2000 - 5 - 1000 - 36  # every slot a merge


def test_same_bytes_whatever_the_worker_count(tmp_path, corpus, finished):
    cfg, _ = finished
    other = config(tmp_path, corpus, workers=1)
    prepare(other)
    assert shard_digest(Path(other.output)) == shard_digest(Path(cfg.output))


def test_rerun_is_a_no_op_and_other_settings_are_refused(finished, corpus, tmp_path):
    cfg, _ = finished
    before = {p: p.stat().st_mtime_ns for p in Path(cfg.output).rglob("*") if p.is_file()}
    start = time.perf_counter()
    prepare(cfg)
    assert time.perf_counter() - start < 5
    after = {p: p.stat().st_mtime_ns for p in Path(cfg.output).rglob("*") if p.is_file()}
    assert before == after
    changed = config(Path(cfg.output).parent, corpus, seed=99)
    with pytest.raises(OutputConflictError, match="other settings"):
        prepare(changed)


# ----------------------------------------------------------------------------- resume


def _run_in_subprocess(cfg_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "data_prep", "--config", str(cfg_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_resume_after_a_kill_gives_the_same_bytes(tmp_path, corpus, finished):
    cfg, _ = finished
    killed = config(tmp_path, corpus, keep_work=True)
    from onebit_bert.config import save_config

    cfg_path = tmp_path / "cfg.yaml"
    save_config(killed, cfg_path)
    # Small units make many of them; kill the whole process group once some are done.
    proc = _run_in_subprocess(cfg_path)
    done = Path(killed.output) / "work" / "done"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if done.is_dir() and len(list(done.iterdir())) >= 3:
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.returncode == 0:
        pytest.skip("the run finished before it could be killed")
    assert not (Path(killed.output) / "seq32" / "manifest.json").exists()
    # (a marker the kill caught half-written is a temporary file the rerun removes)
    stamps = {p: p.stat().st_mtime_ns for p in done.iterdir() if not p.name.endswith(".tmp")}
    assert stamps
    prepare(killed)
    # Finished units were reused, not redone: their markers were not rewritten.
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert shard_digest(Path(killed.output)) == shard_digest(Path(cfg.output))


def test_interrupted_shard_writing_reuses_finished_shards(tmp_path, corpus, finished):
    cfg, _ = finished
    run = config(tmp_path, corpus, keep_work=True)
    prepare(run)
    seq = Path(run.output) / "seq32"
    (seq / "manifest.json").unlink()  # as if killed before the manifest was written
    shards = sorted(seq.glob("train-*.npy"))
    shards[-1].unlink()  # and before the last shard was renamed into place
    (seq / ".train-00001.npy.abc.tmp").write_bytes(b"half a shard")
    kept = {p: p.stat().st_mtime_ns for p in shards[:-1]}
    prepare(run)
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert shards[-1].exists()
    digest = {
        k: v for k, v in shard_digest(Path(run.output)).items() if not k.startswith("seq32/.")
    }
    assert digest == shard_digest(Path(cfg.output))


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("kind", ["wiki", "jsonl", "parquet"])
def test_every_reader_gives_the_same_documents(tmp_path, corpus, finished, kind):
    cfg, manifests = finished
    source = {
        "wiki": {"kind": "wikiextractor"},
        "jsonl": {"kind": "jsonl"},
        "parquet": {"kind": "parquet"},
    }[kind]
    other = config(
        tmp_path, corpus, sources=[{"name": "text", "paths": [str(corpus[kind])], **source}]
    )
    got = prepare(other)
    assert got[32]["documents"] == manifests[32]["documents"]
    assert got[32]["corpus_tokens"] == manifests[32]["corpus_tokens"]


def test_weights_and_mixing(tmp_path, corpus):
    cfg = config(
        tmp_path,
        corpus,
        sources=[
            {"name": "a", "kind": "text", "paths": [str(corpus["text"])], "weight": 2.0},
            {"name": "b", "kind": "jsonl", "paths": [str(corpus["jsonl"])], "weight": 0.5},
        ],
        validation_fraction=0.0,
    )
    docs = prepare(cfg)[32]["documents"]["train"]
    assert 2 * 240 + 90 < docs < 2 * 240 + 150  # twice the first, about half the second


def test_full_sentences_mode(tmp_path, corpus):
    cfg = config(tmp_path, corpus, instances={"seq_lengths": [64], "mode": "full_sentences"})
    prepare(cfg)
    rows = PretrainingShards(Path(cfg.output) / "seq64").rows(np.arange(64))
    assert np.all(rows["nsp"] == -1) and np.all(rows["sep"] == rows["length"] - 1)
    assert rows["length"].mean() > 55  # packed nearly full


# ----------------------------------------------------------------------------- bad input


def _bad_gzip(path: Path) -> Path:
    path.write_bytes(b"\x1f\x8b\x08\x00 this is not gzip data")
    return path


@pytest.mark.parametrize(
    "make_source,match",
    [
        (lambda d: {"kind": "text", "paths": [str(d / "missing.txt")]}, "no file matches"),
        (lambda d: {"kind": "text", "paths": [str(d / "*.nothing")]}, "no file matches"),
        (lambda d: {"kind": "text", "paths": [str(_touch(d / "empty.txt"))]}, "is empty"),
        (lambda d: {"kind": "text", "paths": [str(_bad_gzip(d / "bad.txt.gz"))]}, "cannot read"),
        (
            lambda d: {"kind": "wikiextractor", "paths": [str(_write(d / "w.txt", "plain\n"))]},
            "does not look like WikiExtractor",
        ),
        (
            lambda d: {"kind": "jsonl", "paths": [str(_write(d / "b.jsonl", "{oops\n"))]},
            "line 1 is not JSON",
        ),
        (
            lambda d: {"kind": "jsonl", "paths": [str(_write(d / "k.jsonl", '{"body": "x"}\n'))]},
            "no key 'text'",
        ),
        (
            lambda d: {"kind": "parquet", "paths": [str(_parquet(d / "p.parquet"))]},
            "no column 'text'",
        ),
        (
            lambda d: {"kind": "text", "paths": [str(_write(d / "ws.txt", "  \n\n \n"))]},
            "holds no text",
        ),
    ],
)
def test_bad_sources_fail_early_naming_the_file(tmp_path, corpus, make_source, match):
    cfg = config(tmp_path, corpus, sources=[{"name": "bad", **make_source(tmp_path)}])
    with pytest.raises(SourceError, match=match):
        prepare(cfg)
    assert not (tmp_path / "out" / "tokenizer").exists()  # nothing expensive started


@pytest.mark.slow
def test_unreachable_hub_dataset_is_one_clear_error(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = config(
        tmp_path,
        corpus,
        sources=[
            {
                "name": "wiki",
                "kind": "hub",
                "hub_id": "wikimedia/wikipedia",
                "hub_config": "20231101.en",
            }
        ],
    )
    with pytest.raises(SourceError, match="cannot stream hub dataset 'wikimedia/wikipedia'"):
        prepare(cfg)


def test_missing_vocab_file(tmp_path, corpus):
    cfg = config(tmp_path, corpus, tokenizer={"vocab_file": str(tmp_path / "nope.txt")})
    with pytest.raises(TokenizerError, match="missing or empty"):
        prepare(cfg)


def test_too_few_sequences_for_one_shard(tmp_path, corpus):
    cfg = config(tmp_path, corpus, sequences_per_shard=10**6)
    with pytest.raises(ValueError, match="lower sequences_per_shard"):
        prepare(cfg)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["sources=[]"], "sources is empty"),
        (["sequences_per_shard=0"], "must be >= 1"),
        (["instances.seq_lengths=[4]"], "outside"),
        (["instances.mode=mlm"], "must be one of"),
        (["tokenizer.train=true"], "exactly one of"),
        (["tokenzier.train=true"], "unknown key"),
        (["validation_fraction=abc"], "must be a number"),
        (["sources=[{name: x, kind: text}]"], "needs paths"),
    ],
)
def test_bad_config_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DataPrepConfig, REPO / "configs" / "data" / "sample.yaml", overrides)


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "data").glob("*.yaml")))
def test_shipped_configs_load(path):
    cfg = load_config(DataPrepConfig, path)
    assert cfg.sources and cfg.instances.seq_lengths


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), path)
    return path


# ----------------------------------------------------------------------------- real data


@pytest.mark.skipif(not (SHARED / "bert_vocab").is_dir(), reason=f"no shared data at {SHARED}")
def test_shared_sample_with_the_bert_vocabulary(tmp_path):
    cfg = load_config(
        DataPrepConfig,
        REPO / "configs" / "data" / "sample.yaml",
        [
            f"output={tmp_path / 'out'}",
            f"data_root={SHARED}",
            "sequences_per_shard=256",
            "progress=false",
            "sources=[{name: wikipedia, kind: wikiextractor, "
            "paths: [enwiki_wikiextractor_sample/*.txt.gz], max_documents: 400}, "
            "{name: books, kind: text, documents: file, "
            "paths: [gutenberg_nltk/austen-emma.txt.gz]}]",
        ],
    )
    manifests = prepare(cfg)
    assert manifests[128]["tokenizer"]["vocab_size"] == 30522
    train = PretrainingShards(tmp_path / "out" / "seq128")
    rows = train.rows(np.arange(len(train)))
    assert rows["input_ids"].max() < 30522 and np.all(rows["input_ids"][:, 0] == 101)
    assert 0.4 < float((rows["nsp"] == 1).mean()) < 0.7
    assert rows["length"].mean() > 100  # seq 128 rows are mostly full


def test_the_progress_rate_keeps_its_digits_at_any_speed():
    # a small corpus tokenizes thousands of tokens a second, not 0.00M
    assert token_rate(3_600, 2.0) == "1.8k tok/s"
    assert token_rate(850, 1.0) == "850 tok/s"
    assert token_rate(123_456_789, 10.0) == "12.3M tok/s"
    assert token_rate(4_560_000, 1.0) == "4.56M tok/s"
    assert token_rate(250_000, 1.0) == "250k tok/s"
    assert token_rate(0, 0.0) == "0 tok/s"


def test_a_huge_document_without_punctuation_keeps_its_tokens(tmp_path, caplog):
    """One 200 kB line without sentence punctuation: the text step cuts it into
    10,000-character "sentences", each longer than a pair; they are cut into half-pair
    pieces, so nearly every token reaches a row and half the pairs are true next pairs
    (before: 1-2 % of the tokens, every pair a random next)."""
    import logging
    import random

    from data_prep.prepare import _warn_about_losses, kept_fraction
    from onebit_bert.config import from_dict
    from tests.helpers.corpus import write_vocab

    rng = random.Random(3)
    corpus = tmp_path / "huge.txt"
    corpus.write_text(" ".join(rng.choice(WORDS) for _ in range(32000)) + "\n")
    items = {
        "output": str(tmp_path / "out"),
        "sources": [{"name": "huge", "kind": "text", "paths": [str(corpus)]}],
        "tokenizer": {"vocab_file": str(write_vocab(tmp_path / "vocab.txt"))},
        "instances": {"seq_lengths": [32]},
        "sequences_per_shard": 64,
        "validation_fraction": 0.0,
        "workers": 1,
        "progress": False,
    }
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifest = prepare(from_dict(DataPrepConfig, items))[32]
    splits = manifest["splits"]
    assert kept_fraction("nsp", splits, manifest["corpus_tokens"]) > 0.8
    train = splits["train"]
    assert train["random_next_rows_before_drop"] < 0.7 * (
        train["sequences"] + train["dropped_sequences"]
    )
    assert "the rows hold" not in caplog.text
    # a loss (as before the cut: 1.25 % kept) is warned about with the share kept
    lossy = {**splits, "train": {**train, "tokens": train["tokens"] // 20}}
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        _warn_about_losses(from_dict(DataPrepConfig, items), 32, lossy, manifest["corpus_tokens"])
    assert "data_prep: seq 32: the rows hold " in caplog.text


def test_an_empty_file_among_others_is_skipped_with_a_warning(tmp_path, corpus, caplog):
    import logging

    empty = tmp_path / "part-0002.txt"
    empty.write_text("")
    blank = tmp_path / "part-0003.txt"
    blank.write_text("\n  \n")
    paths = [str(corpus["text"]), str(empty), str(blank)]
    source = {"name": "text", "kind": "text", "paths": paths}
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifests = prepare(config(tmp_path / "a", corpus, sources=[source], workers=1))
    assert manifests[32]["splits"]["train"]["sequences"] > 0
    assert "source 'text': 2 of its 3 files hold no text and add nothing" in caplog.text
    assert str(empty) in caplog.text
    only_empty = {**source, "paths": [str(empty), str(blank)]}
    with pytest.raises(SourceError, match=r"part-0002.txt is empty \(and so are the other 1"):
        prepare(config(tmp_path / "b", corpus, sources=[only_empty]))


def test_sigterm_stops_data_prep_with_one_line(tmp_path):
    from onebit_bert.config import save_config

    many = write_corpus(tmp_path / "corpus", n_docs=3000)
    cfg = config(tmp_path, many, keep_work=True, unit_bytes=2000)
    save_config(cfg, tmp_path / "cfg.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep", "--config", str(tmp_path / "cfg.yaml")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    done = Path(cfg.output) / "work" / "done"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if done.is_dir() and len(list(done.iterdir())) >= 3:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)  # the main process only, as a scheduler's kill may
    out, _ = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the run finished before it could be stopped")
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "Traceback" not in out and "BrokenPipeError" not in out, out
    assert "data_prep: stopped by SIGTERM; run the same command again to resume" in out
    assert not (Path(cfg.output) / "run.lock").exists()  # released on the way out
