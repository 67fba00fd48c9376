"""Checkpoint save and load time of a BERT-Large-sized state, per rank, on this machine.

What one rank of a 1-bit LAMB BERT-Large run writes: the shared part (rank 0: the model and
LAMB's two moments, fp32) and its own part (the error feedback of the compressed
all-reduce, about 1.35 GB per rank at BERT-Large's 336 M parameters, and its RNG). The
checkpoint manager writes, hashes (sha256) and renames; a load reads and verifies the
hashes. Printed as JSON with the sizes, the seconds and the rates::

    python -m bench.checkpoint_io [--scale 1.0] [--dir /tmp/ckpt_bench] [--repeats 2]

``--scale`` multiplies every tensor's size (0.1 for a quick run). The preemption lead a
cluster job needs is at least the save time of the slowest rank (rank 0 writes the shared
part too) plus one training step; docs/guide/clusters.md gives the rule.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from onebit_bert.checkpoint import CheckpointManager
from onebit_bert.distributed.comm import Communicator

BERT_LARGE_PARAMS = 336_226_108
"""BertForPreTraining at bert-large-uncased's shape (vocabulary 30,522), MLM and NSP heads."""
ERROR_FEEDBACK_BYTES = 1.35e9
"""1-bit LAMB's per-rank compression state for BERT-Large (worker and server errors)."""


def state(scale: float) -> tuple[dict, dict]:
    """(shared, per_rank) with BERT-Large's sizes times ``scale`` (random fp32 values)."""
    params = int(BERT_LARGE_PARAMS * scale)
    shared = {
        "model": {"weights": torch.randn(params)},
        "optimizer": {"exp_avg": torch.randn(params), "exp_avg_sq": torch.rand(params)},
        "step": 1000,
    }
    per_rank = {
        "optimizer": {"error": torch.randn(int(ERROR_FEEDBACK_BYTES * scale) // 4)},
        "rng": torch.get_rng_state(),
    }
    return shared, per_rank


def measure(directory: Path, scale: float, repeats: int) -> dict:
    shared, per_rank = state(scale)
    nbytes = {
        "shared": sum(
            t.numel() * 4 for part in ("model", "optimizer") for t in shared[part].values()
        ),
        "per_rank": per_rank["optimizer"]["error"].numel() * 4,
    }
    manager = CheckpointManager(directory, Communicator(None), keep_last=1)
    saves, loads = [], []
    for step in range(1, repeats + 1):
        start = time.perf_counter()
        manager.save(step, shared, per_rank)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = manager.load_latest()
        loads.append(time.perf_counter() - start)
        assert found is not None and found[0] == step
    total = nbytes["shared"] + nbytes["per_rank"]
    return {
        "scale": scale,
        "bytes": {**nbytes, "total": total},
        "save_seconds": saves,
        "load_seconds": loads,
        "save_gb_per_s": total / min(saves) / 1e9,
        "load_gb_per_s": total / min(loads) / 1e9,
        "note": "one process writes the shared and its own part (rank 0's load); the save "
        "includes the sha256 of every file, the load its verification",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_io", description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 4 or args.repeats < 1:
        parser.error("--scale in (0, 4], --repeats >= 1")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="ckpt_bench_"))
    try:
        print(json.dumps(measure(directory, args.scale, args.repeats), indent=2))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
