"""Compressed (1-bit, error-compensated) all-reduce vs fp32 all-reduce on p gloo ranks.

Prints one JSON object as its last line:

- ``bytes_per_rank_*``: bytes one rank sends per call, from the communicator's counters
  (the tensors handed to each collective under NCCL's/gloo's ring algorithms);
- ``wire_bytes_per_rank_*``: the same measured by the kernel, from the loopback interface's
  transmit counter (all ranks share ``lo``, so its delta is divided by p; it includes TCP/IP
  headers and any other loopback traffic on the machine);
- ``seconds_*``: wall time per call (slowest rank, median over iterations). On one machine
  over loopback the network is nearly free, so these show the compute cost of compression;
  the bandwidth-limited comparison is the end-to-end network benchmark's job;
- ``pack_gbps`` / ``unpack_gbps``: sign packing and unpacking throughput on this CPU, in GB
  of fp32 values consumed (pack) or produced (unpack) per second.

Usage: ``python -m bench.comm --world-size 4 --numel 25000000``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import at_least, init_gloo, run_gloo_ranks
from onebit_bert.distributed import Communicator, ErrorFeedback
from onebit_bert.distributed.codecs import compressed_all_reduce
from onebit_bert.distributed.codecs.packing import pack_signs, sign_table, unpack_signs
from onebit_bert.distributed.netdev import read_interfaces


def loopback_tx_bytes() -> int:
    return read_interfaces()["lo"].tx


def _timed_calls(comm, fill, call, iters):
    """Per-call seconds (slowest rank), loopback bytes per rank, counted bytes per rank."""
    seconds, wire = [], 0
    counted_before = comm.stats.bytes_sent
    for _ in range(iters):
        fill()
        comm.barrier()
        tx0 = loopback_tx_bytes() if comm.rank == 0 else 0
        start = time.perf_counter()
        call()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        comm.barrier()
        if comm.rank == 0:
            wire += loopback_tx_bytes() - tx0
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds.append(elapsed.item())
    counted = (comm.stats.bytes_sent - counted_before) / iters
    return statistics.median(seconds), wire / iters / comm.world_size, counted


def _rank_main(rank, world_size, store, out_path, numel, iters, warmup, bucket):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_gloo(rank, world_size, store)
    try:
        comm = Communicator(dist.group.WORLD)
        feedback = ErrorFeedback(numel, world_size, rank=rank, bucket_numel=bucket)
        source = torch.randn(feedback.padded_numel, generator=torch.Generator().manual_seed(rank))
        source[numel:] = 0
        buffer = torch.empty_like(source)

        def fill():
            buffer.copy_(source)

        def plain():
            comm.all_reduce(buffer)

        def compressed():
            compressed_all_reduce(comm, buffer, feedback)

        for fn in (plain, compressed):  # warm up connections and allocator
            for _ in range(warmup):
                fill()
                fn()
        ar = _timed_calls(comm, fill, plain, iters)
        cp = _timed_calls(comm, fill, compressed, iters)
        if rank == 0:
            torch.save({"allreduce": ar, "compressed": cp}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def packing_throughput(numel: int, repeats: int = 5) -> tuple[float, float]:
    numel = numel // 8 * 8
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    table = sign_table(x.device)
    out = torch.empty(numel)
    packed = pack_signs(x)
    unpack_signs(packed, 1.0, out=out, table=table)

    def best(fn):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    pack_s = best(lambda: pack_signs(x))
    unpack_s = best(lambda: unpack_signs(packed, 1.0, out=out, table=table))
    return 4 * numel / pack_s / 1e9, 4 * numel / unpack_s / 1e9


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="compressed vs fp32 all-reduce on gloo ranks")
    parser.add_argument("--world-size", type=at_least(2, "one rank sends nothing"), default=4)
    parser.add_argument("--numel", type=at_least(1), default=25_000_000)
    parser.add_argument("--iters", type=at_least(1), default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-numel", type=int, default=None)
    args = parser.parse_args(argv)

    pack_gbps, unpack_gbps = packing_throughput(args.numel)
    res = run_gloo_ranks(
        _rank_main, args.world_size, args.numel, args.iters, args.warmup, args.bucket_numel
    )
    (ar_s, ar_wire, ar_bytes), (cp_s, cp_wire, cp_bytes) = res["allreduce"], res["compressed"]
    summary = {
        "world_size": args.world_size,
        "numel": args.numel,
        "iters": args.iters,
        "bucket_numel": args.bucket_numel,
        "bytes_per_rank_allreduce": ar_bytes,
        "bytes_per_rank_compressed": cp_bytes,
        "bytes_ratio": ar_bytes / cp_bytes,
        "wire_bytes_per_rank_allreduce": ar_wire,
        "wire_bytes_per_rank_compressed": cp_wire,
        "wire_bytes_ratio": ar_wire / cp_wire if cp_wire else None,
        "counted_vs_wire_allreduce": ar_bytes / ar_wire if ar_wire else None,
        "counted_vs_wire_compressed": cp_bytes / cp_wire if cp_wire else None,
        "seconds_allreduce": ar_s,
        "seconds_compressed": cp_s,
        "seconds_ratio": ar_s / cp_s,
        "pack_gbps": pack_gbps,
        "unpack_gbps": unpack_gbps,
        "torch_threads": torch.get_num_threads(),
        "note": "single machine over loopback: seconds measure compute, not a network",
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
