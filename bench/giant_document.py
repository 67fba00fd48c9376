"""Data preparation on one pathological document: a single line of ``--mb`` megabytes of
generated sentences, one worker, sequence length 128. Prints wall seconds, train rows and
the peak RSS of the main process and of its workers as one JSON object (last line).

Usage: ``python -m bench.giant_document --mb 50``
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

WORDS = (  # noqa: SIM905 (a sentence is easier to edit than a list)
    "the a river stone light house quiet north garden small old new bright cold warm window "
    "letter road market bridge island forest winter summer music paper city village mountain"
).split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def write_inputs(directory: Path, megabytes: float, seed: int = 0) -> tuple[Path, Path]:
    """The one-line document and a WordPiece vocabulary covering its words."""
    rng = random.Random(seed)
    target, size, parts = int(megabytes * 1e6), 0, []
    while size < target:
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        parts.append(" ".join(words).capitalize() + ".")
        size += len(parts[-1]) + 1
    text = directory / "giant.txt"
    text.write_text(" ".join(parts))
    vocab = directory / "vocab.txt"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *sorted(set(WORDS))]
    tokens += [*LETTERS, *("##" + c for c in LETTERS)]
    vocab.write_text("\n".join(dict.fromkeys(tokens)) + "\n")
    return text, vocab


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.giant_document", description=__doc__)
    parser.add_argument("--mb", type=float, default=50.0, help="document size in megabytes")
    args = parser.parse_args(argv)
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare
    from onebit_bert.config import from_dict

    with tempfile.TemporaryDirectory() as tmp:
        text, vocab = write_inputs(Path(tmp), args.mb)
        cfg = from_dict(
            DataPrepConfig,
            {
                "output": str(Path(tmp) / "out"),
                "sources": [{"name": "giant", "kind": "text", "paths": [str(text)]}],
                "tokenizer": {"vocab_file": str(vocab)},
                "instances": {"seq_lengths": [128]},
                "sequences_per_shard": 256,
                "validation_fraction": 0.0,
                "workers": 1,
                "progress": False,
            },
        )
        start = time.perf_counter()
        manifests = prepare(cfg)
        seconds = time.perf_counter() - start
    result = {
        "megabytes": args.mb,
        "seconds": round(seconds, 1),
        "train_rows": manifests[128]["splits"]["train"]["sequences"],
        "peak_rss_main_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_rss_workers_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
