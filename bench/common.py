"""Pieces the benchmarks share: the prepared Wikipedia sample they train on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIKI = "enwiki_wikiextractor_sample/*.txt.gz"
VOCAB = "bert_vocab/uncased/vocab.txt"


def shared_data_error(data_root: Path) -> str | None:
    """Why ``data_root`` cannot feed the training benchmarks, or None."""
    if not list(data_root.glob(WIKI)) or not (data_root / VOCAB).is_file():
        return (
            f"{data_root} lacks the Wikipedia sample or the BERT vocabulary; "
            "set --data-root / DATA_ROOT"
        )
    return None


def data_prep_command(
    data_root: Path, out: Path, *overrides: str, max_documents: int | None = None
) -> list[str]:
    """``python -m data_prep`` on the shared sample config, writing to ``out``, with the
    Wikipedia sample (its first ``max_documents`` articles, or all) as the only source."""
    limit = "" if max_documents is None else f", max_documents: {max_documents}"
    return [
        sys.executable,
        "-m",
        "data_prep",
        "--config",
        str(REPO / "configs/data/sample.yaml"),
        f"output={out}",
        f"data_root={data_root}",
        "progress=false",
        f"sources=[{{name: wikipedia, kind: wikiextractor, paths: [{WIKI}]{limit}}}]",
        *overrides,
    ]


def prepare_wikipedia_seq128(data_root: Path, out: Path, max_documents: int = 3000) -> Path:
    """Prepare ``max_documents`` articles of the shared Wikipedia sample at sequence length
    128 with BERT's uncased vocabulary (the data stage's own CLI); returns the shard folder."""
    command = data_prep_command(
        data_root,
        out,
        "instances.seq_lengths=[128]",
        "sequences_per_shard=1024",
        max_documents=max_documents,
    )
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return out / "seq128"
