"""Training-loop throughput and step-time breakdown.

1. Our loop vs Hugging Face ``Trainer`` on the same bert-mini, batch and data, one process
   on the CPU, both with AdamW (so the loops are compared, not the optimizers; our loop's
   LAMB figure is reported too). Both mask dynamically (15 %); ours runs the MLM head on
   masked positions only, HF's on every position. samples/s is the median over steps after
   a warm-up.
2. LAMB vs 1-bit LAMB on 4 gloo ranks (torchrun, one machine): the mean step time split into
   forward/backward, gradient all-reduce and optimizer (1-bit LAMB's compressed momentum
   all-reduce runs inside its optimizer step), with bytes sent per rank per step. For 1-bit
   LAMB only compression-stage steps are averaged.

The data: the Wikipedia sample of ``--data-root`` (3,000 articles), prepared at sequence
length 128 with BERT's uncased vocabulary. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import (
    add_data_root,
    prepare_wikipedia_seq128,
    pretrain_config,
    shared_data_root,
)
from bench.hf_trainer import hf_trainer_step_seconds
from pretrain.outputs import metrics_path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def our_loop(data: Path, tmp: Path, optimizer: str, steps: int, batch: int, warmup: int) -> float:
    """Median samples/s of our loop, in this process."""
    import torch

    from onebit_bert.config import from_dict
    from onebit_bert.distributed import Communicator
    from onebit_bert.distributed.env import DistContext, LaunchEnv
    from onebit_bert.metrics_log import read_metrics
    from pretrain.config import PretrainConfig
    from pretrain.train import train

    cfg = from_dict(
        PretrainConfig,
        pretrain_config(
            data, tmp / f"ours_{optimizer}", optimizer, steps=steps, batch=batch, micro=batch
        ),
    )
    ctx = DistContext(
        LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"), None, torch.device("cpu"), Communicator(None)
    )
    train(cfg, ctx)
    rates = [
        r["samples_per_s"] for r in read_metrics(metrics_path(cfg.run_dir)) if "samples_per_s" in r
    ][warmup:]
    return statistics.median(rates)


def hf_trainer(data: Path, tmp: Path, steps: int, batch: int, warmup: int) -> float:
    """Median samples/s of HF Trainer on the same model, data and batch."""
    step_seconds = hf_trainer_step_seconds(
        data,
        tmp / "hf",
        preset="bert-mini",
        steps=steps,
        batch=batch,
        learning_rate=1e-4,
        use_cpu=True,
    )[warmup:]
    return batch / statistics.median(step_seconds)


def breakdown(
    data: Path,
    tmp: Path,
    optimizer: str,
    ranks: int,
    steps: int,
    batch: int,
    micro: int,
    freeze_step: int,
) -> dict:
    """Mean per-step timings of a torchrun job with ``ranks`` gloo processes."""
    from onebit_bert.config import from_dict, save_config
    from onebit_bert.metrics_log import read_metrics
    from pretrain.config import PretrainConfig

    run_dir = tmp / f"dist_{optimizer}"
    cfg = from_dict(
        PretrainConfig,
        pretrain_config(
            data,
            run_dir,
            optimizer,
            steps=steps,
            batch=batch,
            micro=micro,
            freeze_step=freeze_step,
        ),
    )
    save_config(cfg, tmp / f"{optimizer}.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "pretrain",
            "--config",
            str(tmp / f"{optimizer}.yaml"),
        ],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    records = [r for r in read_metrics(metrics_path(run_dir)) if "step_seconds" in r]
    if optimizer == "onebit_lamb":
        records = [r for r in records if r["stage"] == "compression"]
    records = records[2:]  # warm-up
    mean = lambda key: statistics.fmean(r[key] for r in records)  # noqa: E731
    return {
        "steps_averaged": len(records),
        "step_seconds": mean("step_seconds"),
        "forward_backward_seconds": mean("forward_backward_seconds"),
        "grad_allreduce_seconds": mean("grad_sync_seconds"),
        "optimizer_seconds": mean("optimizer_seconds"),
        "comm_seconds": mean("comm_seconds"),
        "comm_bytes_per_rank": mean("comm_bytes"),
        "samples_per_s": mean("samples_per_s"),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_root(parser)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    data_root = shared_data_root(parser, args)
    warmup = 5
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = prepare_wikipedia_seq128(data_root, tmp / "data")
        ours = our_loop(data, tmp, "adamw", args.steps, args.batch, warmup)
        ours_lamb = our_loop(data, tmp, "lamb", args.steps, args.batch, warmup)
        hf = hf_trainer(data, tmp, args.steps, args.batch, warmup)
        dist = {
            opt: breakdown(
                data, tmp, opt, args.ranks, 20, args.batch * args.ranks, args.batch, freeze_step=5
            )
            for opt in ("lamb", "onebit_lamb")
        }
    summary = {
        "model": "bert-mini",
        "seq_length": 128,
        "batch": args.batch,
        "samples_per_s": ours,
        "samples_per_s_lamb": ours_lamb,
        "hf_trainer_samples_per_s": hf,
        "ratio": ours / hf,
        "breakdown_ranks": args.ranks,
        "breakdown": dist,
        "comm_bytes_ratio": dist["lamb"]["comm_bytes_per_rank"]
        / dist["onebit_lamb"]["comm_bytes_per_rank"],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
