"""A small generated corpus and vocabulary for tests (no third-party text)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

WORDS = (  # noqa: SIM905
    "the a river stone light house quiet north garden small old new bright cold warm "
    "window letter road market bridge island forest winter summer music paper city "
    "village mountain valley school teacher student morning evening story question answer "
    "water fire wind cloud table chair door street friend family dog cat bird ship train"
).split()  # a sentence is easier to read and edit than a list


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "!", "?"])


def write_corpus(directory: Path, n_docs: int = 240, seed: int = 0) -> dict[str, Path]:
    """Plain text (Google format), WikiExtractor (.gz), JSONL and Parquet versions."""
    rng = random.Random(seed)
    docs = [[sentence(rng) for _ in range(rng.randint(1, 12))] for _ in range(n_docs)]
    directory.mkdir(parents=True, exist_ok=True)
    paths = {
        "text": directory / "corpus.txt",
        "wiki": directory / "wiki_00.gz",
        "jsonl": directory / "corpus.jsonl",
        "parquet": directory / "corpus.parquet",
    }
    paths["text"].write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    with gzip.open(paths["wiki"], "wt") as f:
        for i, d in enumerate(docs):
            f.write(
                f'<doc id="{i}" url="x" title="T{i}">\nTitle {i}\n\n' + "\n".join(d) + "\n</doc>\n"
            )
    paths["jsonl"].write_text("".join(json.dumps({"text": "\n".join(d)}) + "\n" for d in docs))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": ["\n".join(d) for d in docs]}), paths["parquet"], row_group_size=50
    )
    paths["vocab"] = write_vocab(directory / "vocab.txt")
    return paths


def write_vocab(path: Path) -> Path:
    """A WordPiece vocabulary in which every corpus word is one token."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        ".",
        "!",
        "?",
        *sorted(set(WORDS)),
        *letters,
        *("##" + c for c in letters),
    ]
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return path


def prepare_corpus(directory: Path, seq_length: int = 64, n_docs: int = 600) -> Path:
    """A prepared (data_prep) corpus of generated text; returns its seq<N> directory."""
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare
    from onebit_bert.config import from_dict

    paths = write_corpus(directory / "corpus", n_docs=n_docs)
    cfg = from_dict(
        DataPrepConfig,
        {
            "output": str(directory / "prepared"),
            "sources": [{"name": "text", "kind": "text", "paths": [str(paths["text"])]}],
            "tokenizer": {"vocab_file": str(paths["vocab"])},
            "instances": {"seq_lengths": [seq_length]},
            "sequences_per_shard": 128,
            "validation_fraction": 0.05,
            "unit_bytes": 20000,
            "workers": 1,
            "progress": False,
        },
    )
    prepare(cfg)
    return directory / "prepared" / f"seq{seq_length}"
