"""Every collective path of the library on one communicator, with fixed inputs:
:func:`every_collective` runs the communicator's plain and asynchronous collectives in
several dtypes, a side channel, DDP with the communicator's hook, the 1-bit all-reduce
bucket by bucket and as one call, every codec synchronously and the two-phase ones in
flight, and returns the results (on the CPU) with the trace of ``torch.distributed``
calls it made; with more than one rank also a ring exchange. On a one-rank group every
call runs (nothing short-circuits), so a one-rank NCCL group on a GPU must give what a
one-rank gloo group gives on the CPU, the lossy codecs' rounding included."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.distributed import ErrorFeedback
from onebit_bert.distributed.codecs import (
    CODECS,
    AsyncCodecAllReduce,
    TwoPhaseCodec,
    TwoPhaseRun,
    build_codec,
)
from onebit_bert.distributed.codecs.onebit import OneBitBucket, compressed_all_reduce
from onebit_bert.timing import resolve_pending
from tests.helpers.collective_trace import CollectiveTrace

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def _inputs(seed: int, shape, dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    return (x.round() if dtype == torch.int64 else x).to(dtype).to(device)


def _plain(comm, out: dict) -> None:
    p, device = comm.world_size, comm.device
    for i, dtype in enumerate(DTYPES):
        for op in ("sum", "avg", "max", "min") if dtype != torch.int64 else ("sum", "max"):
            x = _inputs(i, (37,), dtype, device)
            comm.all_reduce(x, op=op)
            out[f"all_reduce/{op}/{dtype}"] = x.cpu()
        x = _inputs(10 + i, (p, 24), dtype, device)
        y = torch.empty_like(x)
        comm.all_to_all(y, x)
        out[f"all_to_all/{dtype}"] = y.cpu()
        gathered = torch.empty(p * 24, dtype=dtype, device=device)
        comm.all_gather(gathered, _inputs(20 + i, (24,), dtype, device))
        out[f"all_gather/{dtype}"] = gathered.cpu()
        b = _inputs(30 + i, (5, 3), dtype, device)
        comm.broadcast(b, src=0)
        out[f"broadcast/{dtype}"] = b.cpu()
    tensors = [
        _inputs(40 + i, shape, torch.float32, device) for i, shape in enumerate([(3, 4), (7,)])
    ]
    comm.all_reduce_coalesced(tensors, op="avg")
    out["all_reduce_coalesced"] = [t.cpu() for t in tensors]
    scattered = torch.empty(16, device=device)
    comm.reduce_scatter(scattered, _inputs(50, (p * 16,), torch.float32, device))
    out["reduce_scatter"] = scattered.cpu()
    # asynchronous, several in flight at once, waited in another order than issued
    a, b = _inputs(60, (p, 40), torch.uint8, device), _inputs(61, (40,), torch.uint8, device)
    a_out, b_out = torch.empty_like(a), torch.empty(p * 40, dtype=torch.uint8, device=device)
    first = comm.all_to_all_async(a_out, a)
    second = comm.all_gather_async(b_out, b)
    second.wait()
    first.wait()
    out["all_to_all_async"], out["all_gather_async"] = a_out.cpu(), b_out.cpu()
    side = comm.side_channel()
    x = _inputs(70, (123,), torch.float32, device)
    handle = side.all_reduce_async(x)
    y = _inputs(71, (9,), torch.float32, device)
    comm.all_reduce(y, op="avg")  # runs while the side channel's all-reduce is in flight
    handle.wait()
    out["all_reduce_async"], out["all_reduce_beside_it"] = x.cpu(), y.cpu()
    comm.barrier()


def _ddp(comm, out: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(comm.device)
    data = _inputs(80, (4, 8), torch.float32, comm.device)
    if comm.alone:
        model(data).square().mean().backward()
    else:
        wrapped = DistributedDataParallel(model, process_group=comm.group, bucket_cap_mb=1)
        wrapped.register_comm_hook(None, comm.ddp_comm_hook())
        wrapped(data).square().mean().backward()
    out["ddp_grads"] = [p.grad.cpu() for p in model.parameters()]


def _onebit(comm, out: dict) -> None:
    numel = 5000
    feedback = ErrorFeedback(
        numel, comm.world_size, rank=comm.rank, device=comm.device, bucket_numel=1024
    )
    whole = torch.zeros(feedback.padded_numel, device=comm.device)
    whole[:numel] = _inputs(90, (numel,), torch.float32, comm.device)
    by_bucket = whole.clone()
    compressed_all_reduce(comm, whole, feedback)
    second = ErrorFeedback(
        numel, comm.world_size, rank=comm.rank, device=comm.device, bucket_numel=1024
    )
    runs = [
        TwoPhaseRun(comm, OneBitBucket(comm, by_bucket, second, i))
        for i in range(len(second.buckets))
    ]
    for run in runs:  # every all-to-all in flight before the first all-gather
        run.start()
    for run in runs:
        run.exchange(block=True)
    for run in runs:
        run.finish()
    out["onebit"], out["onebit_by_bucket"] = whole.cpu(), by_bucket.cpu()
    out["onebit_errors"] = feedback.worker_error.cpu()


def _codecs(comm, out: dict) -> None:
    for name in CODECS:
        if name == "powersgd" and comm.device.type == "cpu" and torch.cuda.is_available():
            continue  # refused there: torch's hook would synchronise a CPU "device"
        codec = build_codec(name, comm, int8_block=64, powersgd_start_step=2)
        tensors = [
            _inputs(100 + i, shape, torch.float32, comm.device)
            for i, shape in enumerate([(64, 48), (33,)])
        ]
        for step in range(3):  # PowerSGD compresses the matrix from its third call
            codec.all_reduce(tensors, key="buffer", last=True)
            out[f"codec/{name}/{step}"] = [t.cpu().clone() for t in tensors]
        if isinstance(codec, TwoPhaseCodec):
            tensors = [_inputs(110, (200,), torch.float32, comm.device)]
            handle = AsyncCodecAllReduce(codec, tensors, "other", "parameters", comm.stats)
            handle.advance()
            handle.wait()
            out[f"codec/{name}/async"] = tensors[0].cpu()


def _p2p(comm, out: dict) -> None:
    """A ring exchange (``batch_isend_irecv``); with more than one rank only."""
    p, r = comm.world_size, comm.rank
    if p == 1:
        return
    for dtype in DTYPES:
        x = _inputs(120 + r, (6, 5), dtype, comm.device)
        peers = sorted({(r + 1) % p, (r - 1) % p})
        received = comm.neighbour_exchange(x, send_to=peers, recv_from=peers)
        out[f"neighbour/{dtype}"] = [t.cpu() for t in received]


SECTIONS = {"plain": _plain, "ddp": _ddp, "onebit": _onebit, "codecs": _codecs, "p2p": _p2p}


def every_collective(comm) -> dict:
    """The results by name; ``calls``: the ``torch.distributed`` functions called;
    ``off_main_thread``: per section, the calls issued from another thread;
    ``from_python_threads``: those from a thread Python started."""
    out: dict = {"calls": set(), "off_main_thread": {}, "from_python_threads": {}}
    for section, run in SECTIONS.items():
        with CollectiveTrace() as trace:
            run(comm, out)
            if comm.device.type == "cuda":
                torch.cuda.synchronize(comm.device)
        out["calls"] |= {name for name, _ in trace.calls}
        out["off_main_thread"][section] = trace.off_main_thread
        out["from_python_threads"][section] = trace.from_python_threads
    out["calls"] = sorted(out["calls"])
    resolve_pending()  # CUDA: the collectives' event pairs (the device has synchronised)
    out["comm_seconds"] = comm.stats.seconds
    out["backend"] = dist.get_backend(comm.group) if comm.group is not None else None
    return out
