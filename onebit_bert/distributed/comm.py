"""Every collective the project uses, behind one object.

:class:`Communicator` wraps a process group (or none: world size 1, where every collective
is a no-op) and counts what this rank sends. Counts are taken from the tensors handed to
each collective, under the bandwidth-optimal algorithm NCCL and gloo use for it:

==================  ===============================================================
collective          bytes this rank puts on the wire
==================  ===============================================================
all_reduce          ring: 2·(p-1)/p · tensor bytes
all_gather          ring: (p-1) · bytes of this rank's input
reduce_scatter      ring: (p-1)/p · tensor bytes
all_to_all          every row of the input except the one addressed to itself
broadcast           tensor bytes on every rank except the last of the chain
neighbour_exchange  tensor bytes × number of destinations (point-to-point)
==================  ===============================================================

The benchmark ``bench/comm.py`` checks these counts against the kernel's interface
counters.

Every count is also filed under a *kind of traffic* (:data:`TRAFFIC_KINDS`, defined in
:mod:`onebit_bert.distributed.traffic`): the caller
names it with ``with comm.traffic("momentum"): ...``; collectives outside any such block
count as ``other``. Strategies use this to report bytes and seconds per kind, and a
compression policy can choose a codec per kind.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from onebit_bert.distributed.compat import all_gather_flat, reduce_scatter_flat
from onebit_bert.distributed.traffic import OTHER, TRAFFIC_KINDS
from onebit_bert.timing import PENDING, DeviceClock

__all__ = ["TRAFFIC_KINDS", "AsyncAllReduce", "CommStats", "Communicator", "Issued"]


@dataclass
class CommStats:
    """Running totals for one communicator, overall and per kind of traffic
    (``by_kind[kind] = [bytes, seconds, calls]``); subtract two snapshots for a per-step
    figure."""

    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_kind: dict[str, list] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes_sent += nbytes
        self.seconds += seconds
        self.calls += 1
        entry = self.by_kind.setdefault(kind, [0, 0.0, 0])
        entry[0] += nbytes
        entry[1] += seconds
        entry[2] += 1

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Time spent on a collective already counted (an asynchronous one, waited)."""
        self.seconds += seconds
        self.by_kind.setdefault(kind, [0, 0.0, 0])[1] += seconds

    def copy(self) -> CommStats:
        return CommStats(
            self.bytes_sent,
            self.seconds,
            self.calls,
            {k: list(v) for k, v in self.by_kind.items()},
        )

    def __sub__(self, other: CommStats) -> CommStats:
        by_kind = {}
        for kind, (b, s, c) in self.by_kind.items():
            ob, os_, oc = other.by_kind.get(kind, (0, 0.0, 0))
            if c - oc:
                by_kind[kind] = [b - ob, s - os_, c - oc]
        return CommStats(
            self.bytes_sent - other.bytes_sent,
            self.seconds - other.seconds,
            self.calls - other.calls,
            by_kind,
        )


class AsyncAllReduce:
    """An average over ranks in flight (:meth:`Communicator.all_reduce_async`).

    ``wait()`` blocks until it is done, divides by the world size (once) and returns the
    seconds this call blocked; ``in_flight_seconds`` is how long the collective took from
    launch to completion as the backend reported it (on gloo, measured on its worker
    thread: it progresses while the caller computes)."""

    def __init__(self, comm: Communicator, tensor: torch.Tensor, kind: str, nbytes: int):
        self.comm = comm
        self.tensor = tensor
        self.kind = kind
        self.nbytes = nbytes
        self.work = None
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self.waited = False

    def _finished(self, _future) -> None:
        self.finished_at = time.perf_counter()

    def is_completed(self) -> bool:
        """Whether the collective has finished (never blocks)."""
        return self.work is None or self.work.is_completed()

    def advance(self) -> None:
        """Nothing to issue: one collective (the interface of a two-phase average)."""

    def wait(self) -> float:
        """Block until done; returns the seconds blocked (0 on later calls)."""
        if self.waited:
            return 0.0
        events = self.comm.timed_by_events
        device_start = self.comm._clock.mark() if events else None
        start = time.perf_counter()
        if self.work is not None:
            self.work.wait()
            if self.comm.synchronize_timing and self.comm.device.type == "cuda":
                torch.cuda.synchronize(self.comm.device)
            self.tensor.div_(self.comm.world_size)
        blocked = time.perf_counter() - start
        if self.finished_at is None:
            self.finished_at = time.perf_counter()
        self.waited = True
        if events:  # the stream's stall, filed once the step has waited for the device
            self.comm._device_seconds(self.comm.stats, self.kind, device_start)
        else:
            self.comm.stats.add_seconds(self.kind, blocked)
        return blocked

    @property
    def in_flight_seconds(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started_at


class Communicator:
    """Collectives over ``group`` for tensors on ``device``.

    ``group=None`` means a world of one: nothing is sent and nothing is counted. A process
    group of one rank is not short-circuited: its collectives run (a one-rank NCCL group
    exercises every NCCL path on one GPU); they send nothing, so they count no bytes.
    ``synchronize_timing`` makes CUDA timings exact (a device sync around each collective);
    leave it off in production runs, where it would serialise compute and communication.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        synchronize_timing: bool = False,
    ):
        self.group = group
        self.device = torch.device(device)
        self.synchronize_timing = synchronize_timing
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        self.intra_stats = CommStats()
        """Traffic inside a node under ``comm.hierarchy: node`` (kept out of ``stats``)."""
        self.alone = group is None
        """No process group: every collective returns at once (a copy where it has an
        output)."""
        self.kind = OTHER
        self._clock = DeviceClock(self.device)

    # ------------------------------------------------------------------ bookkeeping
    def snapshot(self) -> CommStats:
        return self.stats.copy()

    @contextmanager
    def traffic(self, kind: str):
        """File the collectives run inside this block under ``kind`` (nests; restores)."""
        if kind not in TRAFFIC_KINDS:
            raise ValueError(f"traffic kind must be one of {TRAFFIC_KINDS}, got {kind!r}")
        previous, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = previous

    @property
    def timed_by_events(self) -> bool:
        """Whether collectives' seconds come from CUDA events (on CUDA, unless
        ``synchronize_timing``), resolved once per step (:mod:`onebit_bert.timing`)."""
        return self.device.type == "cuda" and not self.synchronize_timing

    def _device_seconds(self, stats: CommStats, kind: str, start) -> None:
        """File the seconds from ``start`` (an event) to now, on the current stream."""
        PENDING.add(stats, kind, start, self._clock.mark())

    def _start(self):
        """A mark to time a collective from: a CUDA event, or the host's clock."""
        return self._clock.mark() if self.timed_by_events else time.perf_counter()

    def _file(self, kind: str, nbytes: int, start) -> None:
        """Count ``nbytes`` under ``kind`` with the seconds since ``start`` (from
        :meth:`_start`): on CUDA an event pair resolved once the step has waited."""
        if self.timed_by_events:
            self.stats.add(kind, int(nbytes), 0.0)
            self._device_seconds(self.stats, kind, start)
        else:
            self.stats.add(kind, int(nbytes), time.perf_counter() - start)

    @contextmanager
    def _count(self, nbytes: int):
        if self.timed_by_events:
            start = self._start()
            yield
            self._file(self.kind, nbytes, start)
            return
        sync = self.synchronize_timing and self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if sync:
            torch.cuda.synchronize(self.device)
        self.stats.add(self.kind, int(nbytes), time.perf_counter() - start)

    @contextmanager
    def external(self, nbytes: int):
        """Count, under the current kind, collectives that code outside this class runs
        on this communicator's group inside the block (PyTorch's PowerSGD hook), as
        ``nbytes``."""
        with self._count(nbytes):
            yield

    # ------------------------------------------------------------------ plain collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce. ``op`` is ``sum``, ``avg``, ``max`` or ``min``."""
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, avg, max or min, got {op!r}")
        if self.alone:
            return tensor
        p = self.world_size
        reduce_op = {
            "sum": dist.ReduceOp.SUM,
            "avg": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        with self._count(2 * (p - 1) * tensor.numel() * tensor.element_size() // p):
            dist.all_reduce(tensor, op=reduce_op, group=self.group)
        if op == "avg":
            tensor.div_(p)
        return tensor

    def all_reduce_coalesced(
        self, tensors: list[torch.Tensor], op: str = "avg", bucket_bytes: int = 64 << 20
    ) -> None:
        """All-reduce many tensors as a few flat messages of at most ``bucket_bytes`` (one
        collective per bucket, not one per tensor; the copy stays bounded)."""
        if self.alone or not tensors:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for t in [*tensors, None]:
            if t is not None and (
                not bucket
                or (
                    size + t.numel() * t.element_size() <= bucket_bytes
                    and t.dtype == bucket[0].dtype
                )
            ):
                bucket.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            self.all_reduce(flat, op=op)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            if t is not None:
                bucket, size = [t], t.numel() * t.element_size()

    def ddp_comm_hook(self):
        """A ``DistributedDataParallel`` comm hook that averages each gradient bucket with
        an asynchronous all-reduce and counts its bytes (and its time in flight, which
        overlaps the backward pass) in this communicator's stats, as ``gradients``."""
        p = self.world_size

        def hook(_state, bucket):
            buffer = bucket.buffer()
            start = self._start()
            nbytes = 2 * (p - 1) * buffer.numel() * buffer.element_size() // p
            future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

            def finish(fut):
                # on CUDA this runs with the collective's stream current: the event is its end
                self._file("gradients", nbytes, start)
                return fut.value()[0].div_(p)

            return future.then(finish)

        return hook

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.alone:
            return tensor
        last_of_chain = (src - 1) % self.world_size
        nbytes = 0 if self.rank == last_of_chain else tensor.numel() * tensor.element_size()
        with self._count(nbytes):
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        return tensor

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Gather equal-size tensors from every rank into ``output`` (rank-major)."""
        self.all_gather_async(output, tensor).wait()
        return output

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` (flat, ``world_size`` equal slices) over ranks; this rank's
        slice of the average lands in ``output``."""
        self._check_slices("reduce_scatter input", tensor, output)
        if self.alone:
            output.view(-1).copy_(tensor.reshape(-1))
            return output
        p = self.world_size
        with self._count((p - 1) * output.numel() * output.element_size()):
            reduce_scatter_flat(output.view(-1), tensor.reshape(-1), group=self.group)
        output.div_(p)
        return output

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Row ``j`` of ``tensor`` (first dim = world size) goes to rank ``j``; row ``i`` of
        ``output`` comes from rank ``i``."""
        self.all_to_all_async(output, tensor).wait()
        return output

    def neighbour_exchange(
        self,
        tensor: torch.Tensor,
        send_to: Sequence[int],
        recv_from: Sequence[int],
        out: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Send ``tensor`` to every rank in ``send_to`` and receive a tensor of its shape
        and dtype from every rank in ``recv_from`` (ranks of this group, none of them this
        rank), point to point, all posted at once (``batch_isend_irecv``, on NCCL and
        gloo); every peer must post the matching receives and sends. Returns the received
        tensors in ``recv_from`` order (written into ``out`` if given). Counts tensor bytes
        × ``len(send_to)`` under the current kind of traffic."""
        send_to, recv_from = list(send_to), list(recv_from)
        for label, peers in (("send_to", send_to), ("recv_from", recv_from)):
            bad = [r for r in peers if not 0 <= r < self.world_size or r == self.rank]
            if bad or len(set(peers)) != len(peers):
                raise ValueError(
                    f"neighbour_exchange {label} must name distinct ranks other than this "
                    f"rank ({self.rank}) in [0, {self.world_size}), got {peers}"
                )
        received = out if out is not None else [torch.empty_like(tensor) for _ in recv_from]
        if len(received) != len(recv_from) or any(
            r.shape != tensor.shape or r.dtype != tensor.dtype for r in received
        ):
            raise ValueError(
                f"neighbour_exchange needs one output of shape {tuple(tensor.shape)} and "
                f"dtype {tensor.dtype} per rank in recv_from ({len(recv_from)})"
            )
        if not send_to and not recv_from:
            return received
        tensor = tensor.contiguous()
        ops = [
            dist.P2POp(dist.isend, tensor, dist.get_global_rank(self.group, r), self.group)
            for r in send_to
        ] + [
            dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, r), self.group)
            for r, buf in zip(recv_from, received, strict=True)
        ]
        with self._count(len(send_to) * tensor.numel() * tensor.element_size()):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return received

    def all_reduce_async(self, tensor: torch.Tensor) -> AsyncAllReduce:
        """Start averaging ``tensor`` over ranks in place and return at once; the result is
        there after :meth:`AsyncAllReduce.wait`. The bytes (and the call) are counted now,
        under the current kind of traffic; the seconds when waited: the time the caller
        actually blocked, not the time the collective was in flight (reported separately).

        Call it on a :meth:`side_channel`, so that the collectives the caller runs while
        it is in flight are not queued behind it (NCCL runs one stream per group)."""
        p = self.world_size
        nbytes = 2 * (p - 1) * tensor.numel() * tensor.element_size() // p if p > 1 else 0
        handle = AsyncAllReduce(self, tensor, self.kind, nbytes)
        self.stats.add(self.kind, nbytes, 0.0)
        if not self.alone:
            handle.work = dist.all_reduce(tensor, group=self.group, async_op=True)
            handle.work.get_future().add_done_callback(handle._finished)
        else:
            handle.finished_at = handle.started_at
        return handle

    def side_channel(self, shared_stats: bool = True) -> Communicator:
        """A communicator over the same ranks in a process group of its own, whose counts
        go to this communicator's stats (or, ``shared_stats=False``, to its own).
        Collective: every rank calls it, in the same order."""
        if self.group is None:
            side = Communicator(None, self.device, self.synchronize_timing)
        else:
            ranks = dist.get_process_group_ranks(self.group)
            side = Communicator(dist.new_group(ranks), self.device, self.synchronize_timing)
        if shared_stats:
            side.stats = self.stats
        return side

    def barrier(self) -> None:
        if not self.alone:
            dist.barrier(group=self.group)

    def all_to_all_async(self, output: torch.Tensor, tensor: torch.Tensor) -> Issued:
        """:meth:`all_to_all`, started and returned at once (:class:`Issued`); the
        synchronous one waits on it."""
        if tensor.shape[0] != self.world_size or output.shape != tensor.shape:
            raise ValueError(
                f"all_to_all needs input and output of equal shape with first dimension "
                f"{self.world_size}, got {tuple(tensor.shape)} and {tuple(output.shape)}"
            )
        if self.alone:
            output.copy_(tensor)
        row_bytes = tensor[0].numel() * tensor.element_size()
        return self._issue(
            (self.world_size - 1) * row_bytes,
            lambda: dist.all_to_all_single(output, tensor, group=self.group, async_op=True),
        )

    def all_gather_async(self, output: torch.Tensor, tensor: torch.Tensor) -> Issued:
        """:meth:`all_gather`, started and returned at once (:class:`Issued`); the
        synchronous one waits on it."""
        self._check_slices("all_gather output", output, tensor)
        if self.alone:
            output.view(-1).copy_(tensor.reshape(-1))
        return self._issue(
            (self.world_size - 1) * tensor.numel() * tensor.element_size(),
            lambda: all_gather_flat(
                output.view(-1), tensor.reshape(-1), group=self.group, async_op=True
            ),
        )

    def _check_slices(self, what: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        """Refuse a ``whole`` that is not ``world_size`` slices the size of ``part``."""
        if whole.numel() != part.numel() * self.world_size:
            raise ValueError(
                f"{what} has {whole.numel()} elements; it needs {self.world_size} x {part.numel()}"
            )

    def _issue(self, nbytes: int, launch) -> Issued:
        """Start a collective (``launch()``, which issues it with ``async_op=True``; nothing on
        a world of one), counting ``nbytes`` under the current kind now and the seconds the
        caller later blocks on it."""
        kind = self.kind
        if self.alone:
            return Issued(self, None, kind)
        self.stats.add(kind, int(nbytes), 0.0)
        return Issued(self, launch(), kind)


class Issued:
    """A collective in flight, started on the caller's thread (``async_op=True``); its
    bytes were counted at launch, the seconds the caller blocks in :meth:`wait` are counted
    there."""

    def __init__(self, comm: Communicator, work, kind: str):
        self.comm, self.work, self.kind = comm, work, kind

    def ready(self) -> bool:
        """Whether the caller may use the result without blocking the host: the
        collective has finished, or on CUDA always (:meth:`wait` then orders the device
        stream after it instead of blocking)."""
        if self.work is None or self.comm.device.type == "cuda":
            return True
        return self.work.is_completed()

    def wait(self) -> None:
        """Wait for the collective: the host on the CPU; on CUDA the current stream (the
        seconds it stalls are the event pair's, filed once the step has waited)."""
        if self.work is None:
            return
        comm = self.comm
        if comm.timed_by_events:
            start = comm._clock.mark()
            self.work.wait()
            comm._device_seconds(comm.stats, self.kind, start)
            self.work = None
            return
        start = time.perf_counter()
        self.work.wait()
        if comm.synchronize_timing and comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        comm.stats.add_seconds(self.kind, time.perf_counter() - start)
        self.work = None
