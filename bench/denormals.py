"""What subnormal floats cost a CPU's forward and backward pass, and what flushing them
(``flush_denormal: true``) gives back, on a pretraining run's own checkpoint.

``python -m bench.denormals --run RUN_DIR`` loads the run's config and its latest finished
checkpoint (``--step`` for another), takes one micro-batch of its own data, and times the
forward and backward pass ``--repeats`` times without and with
``torch.set_flush_denormal``, alternating the two so that a busy machine slows both alike.
It prints one JSON object: the median seconds of each, their ratio, and, from the last
pass without flushing, how many entries of the modules' outputs and of the parameters'
gradients are subnormal (what the flush sets to zero; intermediate values inside a module
and the backward pass's own are not counted). It runs on one torch thread: the CPU's flag
is per thread, and switching it on the main thread does not reach torch's other threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SMALLEST_NORMAL = {torch.float32: torch.finfo(torch.float32).tiny}


def subnormal_count(tensors) -> int:
    """Entries of fp32 ``tensors`` that are subnormal (non-zero and below the smallest
    normal fp32 value in magnitude)."""
    count = 0
    for t in tensors:
        if t is not None and t.dtype == torch.float32:
            a = t.detach().abs()
            count += int(((a > 0) & (a < SMALLEST_NORMAL[torch.float32])).sum())
    return count


def time_passes(loss_module, batch: dict, repeats: int) -> dict:
    """Median seconds of ``repeats`` forward and backward passes of ``loss_module`` on
    ``batch`` without and with flushing, alternated, and the subnormal module outputs and
    gradients without flushing. Valid on one torch thread (the module docstring)."""
    seconds = {"off": [], "on": []}
    params = [p for p in loss_module.parameters() if p.requires_grad]
    subnormal, outputs = 0, [0]
    counting = [False]

    def count_outputs(_module, _inputs, output):
        if counting[0]:
            found = output if isinstance(output, (tuple, list)) else (output,)
            outputs[0] += subnormal_count(t for t in found if isinstance(t, torch.Tensor))

    hooks = [m.register_forward_hook(count_outputs) for m in loss_module.modules()]
    try:
        for _ in range(repeats):
            for mode in ("off", "on"):
                torch.set_flush_denormal(mode == "on")
                loss_module.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss, _ = loss_module(**batch)
                loss.backward()
                seconds[mode].append(time.perf_counter() - start)
        torch.set_flush_denormal(False)  # one more pass, untimed, to count
        counting[0] = True
        loss_module.zero_grad(set_to_none=True)
        loss, _ = loss_module(**batch)
        loss.backward()
        subnormal = subnormal_count(p.grad for p in params)
    finally:
        torch.set_flush_denormal(False)
        for hook in hooks:
            hook.remove()
    off, on = (statistics.median(seconds[m]) for m in ("off", "on"))
    return {
        "seconds_off": round(off, 6),
        "seconds_on": round(on, 6),
        "speedup": round(off / on, 3) if on > 0 else None,
        "runs_off": [round(s, 6) for s in seconds["off"]],
        "runs_on": [round(s, 6) for s in seconds["on"]],
        "output_subnormal_off": outputs[0],
        "gradient_entries": sum(p.numel() for p in params),
        "gradient_subnormal_off": subnormal,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.denormals", description=__doc__)
    parser.add_argument("--run", type=Path, required=True, help="a pretraining run directory")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from onebit_bert.checkpoint import SHARED, load_file
    from onebit_bert.shards import PretrainingShards
    from pipeline.reports.mechanism import checkpoint_dirs, run_config
    from pretrain.data import BatchSchedule, make_batch
    from pretrain.model import PretrainingLoss, build_model
    from pretrain.train import token_ids

    points = dict(checkpoint_dirs(args.run))
    if not points:
        parser.error(f"--run {args.run}: no finished checkpoint under its checkpoints/")
    step = max(points) if args.step is None else args.step
    if step not in points:
        parser.error(f"--step {step}: no finished checkpoint (have {sorted(points)})")
    if not torch.set_flush_denormal(False):
        parser.error("this CPU cannot flush subnormal floats: nothing to compare")
    torch.set_num_threads(1)
    cfg = run_config(args.run)
    shards = PretrainingShards(cfg.data.path, "train")
    ids = token_ids(shards)
    model = build_model(cfg.model, ids.vocab_size, ids.pad)
    model.load_state_dict(load_file(points[step] / SHARED)["model"])
    model.train()
    micro = cfg.batch.micro_batch_size
    rows = BatchSchedule(len(shards), micro, micro, 1, 1, cfg.seed).global_indices(step)
    batch = make_batch(shards, rows, ids, cfg.data, seed=cfg.seed, step=step, micro=0)
    tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}
    out = {
        "run": str(args.run),
        "step": step,
        "micro_batch": micro,
        "threads": 1,
        "torch": torch.__version__,
        **time_passes(PretrainingLoss(model), tensors, args.repeats),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
