"""The 1-bit average of a model's tensors three ways, on p gloo ranks.

- ``fused``: every tensor in one buffer, one scale per chunk (codec ``onebit``);
- ``per_tensor``: each tensor its own scales and errors, all tensors in one all-to-all and
  one all-gather (codec ``onebit_tensor``);
- ``one_by_one``: each tensor its own scales and errors and its own two collectives, as
  DeepSpeed's 1-bit optimizers issue them (the loop over parameters).

``per_tensor`` and ``one_by_one`` give the same numbers bit for bit (checked here on every
call: ``identical``); they differ in the number of collectives, 2 against 2 per tensor,
which on a real network costs a latency each. Over loopback on one machine the seconds
measure compute and collective overheads, not a network.

Prints one JSON object as its last line: per way the median seconds per call (slowest
rank), the bytes one rank sends per call (the communicator's count) and the collectives
per call.

Usage: ``python -m bench.onebit_tensor --model bert-tiny --world-size 4``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import BertForPreTraining

from bench.common import at_least, init_gloo, run_gloo_ranks
from onebit_bert.distributed import Communicator, ErrorFeedback
from onebit_bert.distributed.codecs import compressed_all_reduce, compressed_all_reduce_many
from pretrain.config import ModelConfig
from pretrain.model import PRESET_SHAPES, bert_config

WAYS = ("fused", "per_tensor", "one_by_one")


def tensor_sizes(preset: str, vocab_size: int) -> list[int]:
    """Element counts of the parameters of ``preset`` (built on the meta device)."""
    with torch.device("meta"):
        model = BertForPreTraining(bert_config(ModelConfig(preset=preset), vocab_size))
    return [p.numel() for p in model.parameters()]


def _rank_main(rank, world_size, store, out_path, sizes, iters, warmup):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_gloo(rank, world_size, store)
    try:
        comm = Communicator(dist.group.WORLD)
        gen = torch.Generator().manual_seed(rank)
        sources = [torch.randn(n, generator=gen) * 10.0 ** (i % 3 - 1) for i, n in
                   enumerate(sizes)]  # fmt: skip

        def padded(tensors):
            numel = sum(t.numel() for t in tensors)
            fb = ErrorFeedback(numel, world_size, rank=rank)
            buffer = torch.zeros(fb.padded_numel)
            return buffer, fb, numel

        fused = padded(sources)
        singles = [padded([t]) for t in sources]
        twins = [padded([t]) for t in sources]

        def fill(pairs, groups):
            for (buffer, _, numel), group in zip(pairs, groups, strict=True):
                buffer[:numel] = torch.cat([t.reshape(-1) for t in group])

        calls = {
            "fused": (lambda: fill([fused], [sources]),
                      lambda: compressed_all_reduce(comm, fused[0], fused[1])),
            "per_tensor": (lambda: fill(singles, [[t] for t in sources]),
                           lambda: compressed_all_reduce_many(comm,
                               [(b, fb) for b, fb, _ in singles])),
            "one_by_one": (lambda: fill(twins, [[t] for t in sources]),
                           lambda: [compressed_all_reduce(comm, b, fb) for b, fb, _ in twins]),
        }  # fmt: skip
        issued = [0]
        for name in ("all_to_all_async", "all_gather_async"):
            original = getattr(comm, name)

            def counted(*args, _original=original):
                issued[0] += 1
                return _original(*args)

            setattr(comm, name, counted)
        for fill_fn, call in calls.values():  # warm up connections and the allocator
            for _ in range(warmup):
                fill_fn()
                call()
        result, identical = {}, True
        for _ in range(iters):
            for way, (fill_fn, call) in calls.items():
                fill_fn()
                comm.barrier()
                issued[0], before = 0, comm.stats.bytes_sent
                start = time.perf_counter()
                call()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                entry = result.setdefault(way, {"seconds": [], "bytes": 0, "collectives": 0})
                entry["seconds"].append(elapsed.item())
                entry["bytes"] = comm.stats.bytes_sent - before
                entry["collectives"] = issued[0]
            for (a, _, _), (b, _, _) in zip(singles, twins, strict=True):
                identical = identical and torch.equal(a, b)
        if rank == 0:
            torch.save({"result": result, "identical": identical}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="1-bit average of a model's tensors, 3 ways")
    parser.add_argument("--model", choices=sorted(PRESET_SHAPES), default="bert-tiny")
    parser.add_argument("--vocab-size", type=at_least(1), default=30522)
    parser.add_argument("--world-size", type=at_least(2, "one rank sends nothing"), default=4)
    parser.add_argument("--iters", type=at_least(1), default=10)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    args = parser.parse_args(argv)
    sizes = tensor_sizes(args.model, args.vocab_size)
    saved = run_gloo_ranks(_rank_main, args.world_size, sizes, args.iters, args.warmup)
    summary = {
        "model": args.model,
        "vocab_size": args.vocab_size,
        "world_size": args.world_size,
        "tensors": len(sizes),
        "elements": sum(sizes),
        "iters": args.iters,
        "identical": saved["identical"],
    }
    for way in WAYS:
        entry = saved["result"][way]
        summary[f"seconds_{way}"] = statistics.median(entry["seconds"])
        summary[f"bytes_per_rank_{way}"] = entry["bytes"]
        summary[f"collectives_{way}"] = entry["collectives"]
    summary["one_by_one_over_per_tensor"] = (
        summary["seconds_one_by_one"] / summary["seconds_per_tensor"]
    )
    summary["per_tensor_over_fused"] = summary["seconds_per_tensor"] / summary["seconds_fused"]
    summary["torch_threads"] = torch.get_num_threads()
    summary["note"] = "one machine over loopback: seconds measure compute, not a network"
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
