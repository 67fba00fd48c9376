"""Integrity of prepared shards (sizes, sha256, token ids, ``data_prep verify``) and honest
I/O errors (full device, an output path that is a file, stale temporary files)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep.__main__ import main as data_prep_main
from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare
from onebit_bert.config import from_dict
from onebit_bert.io import NoSpaceError, atomic_write_bytes, atomic_write_json, sha256_file
from onebit_bert.shards import PretrainingShards, ShardFormatError, row_dtype, write_shard
from tests.helpers.corpus import write_corpus


def config(output: Path, corpus: dict[str, Path], **overrides) -> DataPrepConfig:
    items = {
        "output": str(output),
        "sources": [{"name": "text", "kind": "text", "paths": [str(corpus["text"])]}],
        "tokenizer": {"vocab_file": str(corpus["vocab"])},
        "instances": {"seq_lengths": [32]},
        "sequences_per_shard": 64,
        "shuffle_buffer": 100,
        "unit_bytes": 6000,
        "validation_fraction": 0.1,
        "workers": 1,
        "keep_work": True,
        "progress": False,
    }
    items.update(overrides)
    return from_dict(DataPrepConfig, items)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), n_docs=120)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "out"
    prepare(config(out, corpus))
    return out


@pytest.fixture
def copy(prepared, tmp_path) -> Path:
    """A copy of the prepared output that a test may damage."""
    return Path(shutil.copytree(prepared, tmp_path / "out"))


def _manifest(seq: Path) -> dict:
    return json.loads((seq / "manifest.json").read_text())


def _first_train_shard(seq: Path) -> Path:
    return seq / _manifest(seq)["splits"]["train"]["shards"][0]["file"]


# ----------------------------------------------------------------------------- sizes, sha256


def test_manifest_records_shard_size_and_sha256(prepared):
    seq = prepared / "seq32"
    manifest = _manifest(seq)
    for split in ("train", "validation"):
        entries = manifest["splits"][split]["shards"]
        assert entries
        for entry in entries:
            path = seq / entry["file"]
            assert {"file", "sequences", "tokens"} <= set(entry)  # the keys pretraining reads
            assert entry["bytes"] == path.stat().st_size
            assert entry["sha256"] == sha256_file(path)


def test_truncated_shard_is_named_when_opening(copy):
    seq = copy / "seq32"
    shard = _first_train_shard(seq)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ShardFormatError) as info:
        PretrainingShards(seq, "train")
    message = str(info.value)
    assert str(shard) in message and f"{size - 100} bytes" in message and str(size) in message
    assert "prepare the data again or restore the file" in message


def test_manifest_without_sizes_still_opens(copy):
    seq = copy / "seq32"
    manifest = _manifest(seq)
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            del entry["bytes"], entry["sha256"]
    (seq / "manifest.json").write_text(json.dumps(manifest))
    shards = PretrainingShards(seq, "train")
    assert shards.batch([0, len(shards) - 1])["input_ids"].shape == (2, 32)


def _damage_token(shard: Path, row: int, value: int = 60000) -> None:
    rows = np.load(shard, mmap_mode="r+", allow_pickle=False)
    rows["input_ids"][row, 1] = value
    rows.flush()
    del rows


def test_out_of_vocabulary_token_is_named_by_batch(copy):
    seq = copy / "seq32"
    _damage_token(_first_train_shard(seq), row=5)
    shards = PretrainingShards(seq, "train")  # same size: opening cannot tell
    shards.batch([0, 1, 2])
    with pytest.raises(ShardFormatError, match=r"train-00000\.npy row 5 holds a token id"):
        shards.batch([3, 5, 7])


def test_random_bytes_shard_is_a_format_error(copy):
    seq = copy / "seq32"
    shard = _first_train_shard(seq)
    shard.write_bytes(os.urandom(shard.stat().st_size))
    shards = PretrainingShards(seq, "train")
    with pytest.raises(ShardFormatError, match="cannot be read as a shard"):
        shards.batch([0])


# ----------------------------------------------------------------------------- verify


def test_verify_passes_on_sound_data(prepared, capsys):
    assert data_prep_main(["verify", str(prepared)]) == 0
    assert data_prep_main(["verify", str(prepared / "seq32")]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2 and "FAIL" not in out


def test_verify_names_the_shard_and_first_bad_row(copy, capsys):
    seq = copy / "seq32"
    shard = _first_train_shard(seq)
    _damage_token(shard, row=7)
    _damage_token(shard, row=9)
    assert data_prep_main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {shard}: sha256 differs" in out
    assert f"FAIL {shard}: row 7 (first bad row) has a token id >= the vocabulary size" in out


def test_verify_reports_a_truncated_shard(copy, capsys):
    seq = copy / "seq32"
    shard = seq / _manifest(seq)["splits"]["validation"]["shards"][0]["file"]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    assert data_prep_main(["verify", str(seq)]) == 1
    assert f"FAIL {shard}: {size - 10} bytes, the manifest says {size}" in capsys.readouterr().out


def test_verify_without_a_manifest(tmp_path, capsys):
    assert data_prep_main(["verify", str(tmp_path)]) == 2
    assert "holds no prepared corpus" in capsys.readouterr().err


def test_help_mentions_verify(capsys):
    with pytest.raises(SystemExit) as exc:
        data_prep_main(["--help"])
    assert exc.value.code == 0
    assert "python -m data_prep verify PATH" in capsys.readouterr().out


# ----------------------------------------------------------------------------- full device


class _FullDisk:
    """A file that takes ``capacity`` bytes, then fails like a full device: with ENOSPC,
    or (``short``) by storing fewer bytes than asked."""

    def __init__(self, f, capacity: int, short: bool):
        self.f, self.capacity, self.short = f, capacity, short

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        room = max(self.capacity, 0)
        if n <= room:
            self.capacity -= n
            return self.f.write(data)
        if self.short:
            self.capacity = 0
            return self.f.write(memoryview(data).cast("B")[:room])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.fixture(params=["enospc", "short"])
def full_disk(request, monkeypatch):
    real = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        return _FullDisk(real(fd, mode, *args, **kwargs), 200, request.param == "short")

    monkeypatch.setattr(os, "fdopen", fdopen)


def _assert_clean(directory: Path, target: Path) -> None:
    assert not target.exists()
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.usefixtures("full_disk")
def test_atomic_writes_on_a_full_device(tmp_path):
    target = tmp_path / "state.json"
    with pytest.raises(NoSpaceError) as info:
        atomic_write_json(target, {"x": "y" * 1000})
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert f"no space left on device while writing {target} (" in message
    assert message.endswith(")") and " MB free on /" in message
    _assert_clean(tmp_path, target)
    with pytest.raises(NoSpaceError, match="no space left on device while writing"):
        atomic_write_bytes(target, b"z" * 1000)
    atomic_write_bytes(target, b"small")  # what fits is written
    assert target.read_bytes() == b"small"


@pytest.mark.usefixtures("full_disk")
def test_shard_writer_on_a_full_device(tmp_path):
    target = tmp_path / "train-00000.npy"
    rows = np.zeros(64, dtype=row_dtype(32))
    with pytest.raises(NoSpaceError) as info:
        write_shard(target, rows)
    assert info.value.errno == errno.ENOSPC
    assert f"no space left on device while writing {target}" in str(info.value)
    _assert_clean(tmp_path, target)


def test_write_shard_bytes_are_those_of_np_save(tmp_path):
    rows = np.zeros(10, dtype=row_dtype(16))
    rows["length"] = np.arange(10)
    got = write_shard(tmp_path / "a.npy", rows)
    np.save(tmp_path / "b.npy", rows, allow_pickle=False)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    assert got == {
        "bytes": (tmp_path / "b.npy").stat().st_size,
        "sha256": sha256_file(tmp_path / "b.npy"),
    }


# ----------------------------------------------------------------------------- output path


def test_output_that_is_a_file_is_refused_before_any_work(tmp_path, corpus):
    output = tmp_path / "prepared"
    output.write_text("not a directory")
    cfg = config(output, corpus, sources=[{"name": "x", "kind": "text", "paths": ["/nope"]}])
    with pytest.raises(ValueError, match=f"{output} is a file, not a directory"):
        prepare(cfg)  # before the sources are opened
    nested = config(output / "sub", corpus)
    with pytest.raises(ValueError, match=f"{output} is a file, not a directory"):
        prepare(nested)
    assert output.read_text() == "not a directory"


def test_output_that_is_a_file_via_the_cli(tmp_path, corpus, capsys):
    from onebit_bert.config import save_config

    output = tmp_path / "prepared"
    output.write_text("x")
    save_config(config(tmp_path / "elsewhere", corpus), tmp_path / "cfg.yaml")
    rc = data_prep_main(["--config", str(tmp_path / "cfg.yaml"), f"output={output}"])
    assert rc == 2
    assert f"{output} is a file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stale temp files


def test_stale_temp_files_are_removed_at_start(copy, corpus, caplog):
    seq = copy / "seq32"
    (seq / "manifest.json").unlink()  # as if killed before finishing
    stale = [
        seq / ".train-00003.npy.k2j_x9a1.tmp",
        seq / ".manifest.json.abc.tmp",
        copy / "work" / "seq32" / "train" / ".0000001.npy.q8r7s6t5.tmp",
        copy / "work" / "done" / ".0000001.json.zz.tmp",
        copy / "tokenizer" / ".tokenizer.json.w1.tmp",
    ]
    kept = [seq / "notes.tmp", seq / ".hidden", copy / "other.tmp"]
    for p in stale + kept:
        p.write_bytes(b"partial")
    with caplog.at_level(logging.INFO, logger="data_prep"):
        prepare(config(copy, corpus))
    assert not [p for p in stale if p.exists()]
    assert all(p.exists() for p in kept)
    assert "removed 5 temporary file(s) left by an interrupted run" in caplog.text
    assert (seq / "manifest.json").is_file()


def test_each_rank_hashes_its_share_of_the_shards(copy):
    from onebit_bert.shards import damage_of, first_damaged_shard

    seq = copy / "seq32"
    splits = [PretrainingShards(seq, "train"), PretrainingShards(seq, "validation")]
    assert [first_damaged_shard(splits, r, 2) for r in (0, 1)] == [None, None]
    last = splits[0].num_shards - 1
    shard = seq / _manifest(seq)["splits"]["train"]["shards"][last]["file"]
    _damage_token(shard, row=0, value=7)  # a valid id: only the sha256 can tell
    found = [first_damaged_shard(splits, r, 2) for r in (0, 1)]
    assert found[last % 2] == last and found[1 - last % 2] is None  # one rank hashed it
    assert damage_of(splits, last).startswith(f"{shard} does not match the sha256")
