"""What packing saves on a prepared corpus: the padding share of its rows and the rows a
micro-batch needs packed (``data.packing``, :func:`pretrain.packing.pack_order`).

``python -m bench.packing --prepared DIR`` reads the first ``--sequences`` rows of the
training shards of every ``seq<N>`` folder under ``DIR`` (a data stage output) and prints
one JSON object: per sequence length, the mean tokens per row, the padding share, and the
mean rows per packed micro-batch (of ``--batch-size`` sequences at length 128, as many
tokens at other lengths, as bench-gpu sizes them). The model's work per step scales with
the rows, so ``1 - rows / micro-batch`` is the share of the encoder's work packing
removes; what that is in samples/s is ``bench.gpu --packing both``'s figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def padding_figures(lengths: np.ndarray, seq_length: int, micro_batch: int) -> dict:
    """The padding share of rows of ``lengths`` tokens at ``seq_length``, and the rows each
    whole micro-batch of ``micro_batch`` consecutive rows packs into."""
    from pretrain.packing import pack_order

    lengths = np.asarray(lengths, dtype=np.int64)
    rows = [len(pack_order(lengths[i : i + micro_batch], seq_length))
            for i in range(0, len(lengths) - micro_batch + 1, micro_batch)]  # fmt: skip
    packed = float(np.mean(rows)) if rows else None
    return {
        "sequences": int(len(lengths)),
        "mean_tokens": round(float(lengths.mean()), 2),
        "padding_share": round(1 - float(lengths.mean()) / seq_length, 4),
        "micro_batch": micro_batch,
        "packed_rows_per_micro_batch": None if packed is None else round(packed, 2),
        "rows_saved_share": None if packed is None else round(1 - packed / micro_batch, 4),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__)
    parser.add_argument("--prepared", type=Path, required=True, help="a data stage output")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences at length 128")
    parser.add_argument(
        "--sequences",
        type=int,
        default=65536,
        help="training sequences read from the start of each length's shards (default "
        "65,536: enough for the shares, without reading a whole corpus)",
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.sequences < 1:
        parser.error("--batch-size and --sequences must be >= 1")
    from onebit_bert.shards import PretrainingShards

    folders = sorted(args.prepared.glob("seq*"), key=lambda p: int(p.name[3:] or 0))
    if not folders:
        parser.error(f"--prepared {args.prepared}: no seq<N> folder (a data stage output)")
    out = {"prepared": str(args.prepared), "lengths": {}}
    for folder in folders:
        shards = PretrainingShards(folder, "train")
        lengths = shards.rows(np.arange(min(len(shards), args.sequences)))["length"]
        micro = max(1, args.batch_size * 128 // shards.seq_length)
        out["lengths"][str(shards.seq_length)] = padding_figures(lengths, shards.seq_length, micro)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
