"""Baseline: Hugging Face ``run_mlm.py``-style MLM preprocessing of a plain text file.

Mirrors what ``examples/pytorch/language-modeling/run_mlm.py`` does with
``line_by_line=False``, to compare our own data preparation against:

1. ``datasets.load_dataset("text", ...)``: one example per line of the file (empty lines kept);
2. a batched ``map(num_proc=...)`` calling a fast tokenizer on each batch of lines with
   ``return_special_tokens_mask=True`` (so every line gets its own ``[CLS] ... [SEP]``);
3. a second batched ``map(num_proc=...)`` (``group_texts``) concatenating every column within a
   batch (the ``map`` default of 1000 rows) and cutting it into ``block_size`` blocks, dropping
   each batch's remainder.

Because the remainder is dropped per batch (and ``num_proc`` splits the rows into contiguous
shards first), ``blocks`` can be slightly below ``tokens // block_size``: by at most one block
per batch, exactly as in ``run_mlm.py``.

Returns / prints ``{"tokens", "blocks", "seconds", "tokens_per_s", "peak_rss_mb"}``; ``seconds``
is the wall time of load + tokenise + group (tokenizer loading and imports excluded), and
``peak_rss_mb`` the peak summed RSS of this process and its workers (see ``rss.PeakRSS``) over
tokenizer loading and the timed part. A fresh temporary datasets cache is used (and removed)
unless ``cache_dir`` is given, so no earlier run's cache is reused.

Usage: ``python -m bench.hf_mlm_baseline --text-file corpus.txt --tokenizer-dir tok/``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from itertools import chain

from bench.rss import PeakRSS


def _tokenize_and_group(text_file, tokenizer_dir, block_size, num_proc, cache_dir):
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    with PeakRSS() as rss:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if not tokenizer.is_fast:
            raise ValueError(f"{tokenizer_dir} does not load as a fast tokenizer")

        def tokenize_function(examples):
            return tokenizer(examples["text"], return_special_tokens_mask=True)

        def group_texts(examples):
            concatenated = {k: list(chain.from_iterable(v)) for k, v in examples.items()}
            total = len(next(iter(concatenated.values())))
            total = (total // block_size) * block_size
            return {
                k: [t[i : i + block_size] for i in range(0, total, block_size)]
                for k, t in concatenated.items()
            }

        start = time.perf_counter()
        raw = datasets.load_dataset("text", data_files={"train": text_file}, cache_dir=cache_dir)
        tokenized = raw["train"].map(
            tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"]
        )
        grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
        seconds = time.perf_counter() - start

    tokens = pc.sum(pc.list_value_length(tokenized.data.table.column("input_ids"))).as_py() or 0
    return {
        "tokens": tokens,
        "blocks": len(grouped),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "peak_rss_mb": round(rss.peak_mb, 1),
    }


def run_hf_mlm_baseline(
    text_file: str,
    tokenizer_dir: str,
    block_size: int = 128,
    num_proc: int = 2,
    cache_dir: str | None = None,
) -> dict:
    """Run the run_mlm-style load/tokenise/group pipeline on ``text_file`` and time it.

    Args:
        text_file: plain text, one example per line.
        tokenizer_dir: local directory loadable by ``AutoTokenizer.from_pretrained`` (fast).
        block_size: tokens per grouped block.
        num_proc: worker processes for both ``Dataset.map`` calls.
        cache_dir: datasets cache to use (kept); default a fresh temporary one (removed).

    Returns:
        ``{"tokens", "blocks", "seconds", "tokens_per_s", "peak_rss_mb"}`` (see module doc).
    """
    import datasets

    saved_env = os.environ.get("TOKENIZERS_PARALLELISM")
    bars_were_enabled = datasets.is_progress_bar_enabled()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    datasets.disable_progress_bars()
    tmp_cache = tempfile.mkdtemp(prefix="hf_mlm_baseline_") if cache_dir is None else None
    try:
        return _tokenize_and_group(
            text_file, tokenizer_dir, block_size, num_proc, cache_dir or tmp_cache
        )
    finally:
        if tmp_cache is not None:
            shutil.rmtree(tmp_cache, ignore_errors=True)
        if bars_were_enabled:
            datasets.enable_progress_bars()
        if saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved_env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--text-file", required=True)
    parser.add_argument("--tokenizer-dir", required=True)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args(argv)
    result = run_hf_mlm_baseline(
        args.text_file, args.tokenizer_dir, block_size=args.block_size, num_proc=args.num_proc
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
