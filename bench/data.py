"""Data preparation throughput: our ``data_prep`` vs the HF ``run_mlm.py``-style pipeline.

Both run in the same invocation on the Wikipedia sample of a shared data folder
(``$DATA_ROOT/enwiki_wikiextractor_sample``), with the same BERT uncased vocabulary, at
sequence length 128:

- ours: ``python -m data_prep`` (NSP pairs, sentence segmentation, shards, manifest), timed
  as a whole process: interpreter start, source checksums, tokenizer, workers, shard
  writing; ``tokens`` counts corpus tokens without special tokens;
- baseline: ``datasets.load_dataset("text")`` + batched ``map`` tokenisation + ``group_texts``
  with 2 processes on the same articles' text (extracted to a plain file first, untimed);
  its ``tokens`` include the ``[CLS]``/``[SEP]`` it adds to every line.

Peak RSS is the summed resident memory of each pipeline's process tree (our workers are
spawned, so nothing is shared; the baseline's forked workers share pages, which the sum
counts more than once).

Prints one JSON object as its last line. Usage: ``python -m bench.data --data-root DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import WIKI, add_data_root, data_prep_command, shared_data_root
from bench.hf_mlm_baseline import run_hf_mlm_baseline
from bench.rss import PeakRSS
from data_prep.outputs import read_manifest, tokenizer_dir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def extract_bodies(data_root: Path, out: Path) -> int:
    """The articles' lines without the <doc> markup, as a plain text file."""
    n = 0
    with out.open("w") as dst:
        for path in sorted(data_root.glob(WIKI)):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as src:
                for line in src:
                    if not line.startswith(("<doc ", "</doc>")):
                        dst.write(line)
                        n += 1
    return n


def run_ours(data_root: Path, output: Path, seq_length: int, workers: int) -> dict:
    command = data_prep_command(
        data_root, output, f"workers={workers}", f"instances.seq_lengths=[{seq_length}]"
    )
    with PeakRSS() as rss:
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"data_prep failed:\n{done.stdout}\n{done.stderr}")
    manifest = read_manifest(output, seq_length)
    tokens = manifest["corpus_tokens"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_rss_mb": rss.peak_mb,
        "train_sequences": manifest["splits"]["train"]["sequences"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_root(parser)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    data_root = shared_data_root(parser, args, vocab=False)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ours = run_ours(data_root, tmp / "ours", args.seq_length, args.workers)
        text_file = tmp / "bodies.txt"
        extract_bodies(data_root, text_file)
        baseline = run_hf_mlm_baseline(
            str(text_file),
            str(tokenizer_dir(tmp / "ours")),
            block_size=args.seq_length,
            num_proc=args.workers,
        )
    summary = {
        "seq_length": args.seq_length,
        "workers": args.workers,
        "tokens": ours["tokens"],
        "seconds": ours["seconds"],
        "tokens_per_s": ours["tokens_per_s"],
        "peak_rss_mb": ours["peak_rss_mb"],
        "train_sequences": ours["train_sequences"],
        "baseline_tokens": baseline["tokens"],
        "baseline_seconds": baseline["seconds"],
        "baseline_tokens_per_s": baseline["tokens_per_s"],
        "baseline_peak_rss_mb": baseline["peak_rss_mb"],
        "speedup": ours["tokens_per_s"] / baseline["tokens_per_s"],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
