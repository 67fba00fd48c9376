"""The two-phase average every compressing codec shares, as one state machine.

Phase one, all-to-all: the padded buffer is cut into one chunk per rank; every rank
encodes its copy (the *worker* step) and sends chunk ``j`` to rank ``j``. Phase two,
all-gather: rank ``j`` decodes the ``p`` copies of its chunk, averages them (the *server*
step), encodes the average and sends it to everyone, who decode the same bytes (the
*expand* step), so the result is identical on every rank.

:class:`TwoPhaseRun` issues the two collectives and calls the three steps of a
:class:`TwoPhaseSteps` (the 1-bit codec's per-bucket work, or a :class:`TwoPhaseCodec`'s
element encoding); :class:`Batched` puts several of them into one all-to-all and one
all-gather. Every collective is issued from the caller's thread, so a caller that runs
several runs at once issues them in one order on every rank (NCCL and gloo match
collectives by their order on a group).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from onebit_bert.distributed.codecs.base import Codec


class TwoPhaseSteps(Protocol):
    """The arithmetic of one two-phase average."""

    def compress(self) -> torch.Tensor:
        """Worker: this rank's copy encoded as ``(p, row bytes)`` uint8, row ``j`` for
        rank ``j``. Nothing is sent."""

    def serve(self, incoming: torch.Tensor) -> torch.Tensor:
        """Server: the average of this rank's chunk over the rows of ``incoming`` (one per
        rank), encoded as one message (kept alive until sent)."""

    def expand(self, gathered: torch.Tensor) -> None:
        """Everyone: write the average from ``gathered`` (row ``i``: server ``i``'s
        message)."""


class TwoPhaseRun:
    """One two-phase average in flight: :meth:`start` runs the worker step and issues the
    all-to-all; :meth:`exchange` (once that is done) runs the server step and issues the
    all-gather; :meth:`finish` waits for it and expands. :meth:`run` does all three."""

    def __init__(self, comm, steps: TwoPhaseSteps):
        self.comm = comm
        self.steps = steps
        self.pending = None
        self.stage = "new"

    def start(self) -> TwoPhaseRun:
        if self.stage != "new":
            raise RuntimeError(f"start() on a run in stage {self.stage}")
        self.outgoing = self.steps.compress()  # alive until the collective ends
        self.incoming = torch.empty_like(self.outgoing)
        self.pending = self.comm.all_to_all_async(self.incoming, self.outgoing)
        self.stage = "exchanging"
        return self

    def exchange(self, block: bool = False) -> bool:
        """Once the all-to-all is done (``block``: wait for it), run the server step and
        issue the all-gather. Returns whether it did (False: the all-to-all is still in
        flight)."""
        if self.stage != "exchanging":
            raise RuntimeError(f"exchange() on a run in stage {self.stage}")
        if not block and not self.pending.ready():
            return False
        self.pending.wait()
        self.reply = self.steps.serve(self.incoming)
        self.gathered = torch.empty(
            self.comm.world_size, self.reply.numel(), dtype=torch.uint8, device=self.reply.device
        )
        self.pending = self.comm.all_gather_async(self.gathered, self.reply)
        self.stage = "gathering"
        return True

    def finish(self) -> None:
        """Wait for the all-gather and expand every server's message."""
        if self.stage != "gathering":
            raise RuntimeError(f"finish() on a run in stage {self.stage}")
        self.pending.wait()
        self.steps.expand(self.gathered)
        self.stage = "done"

    def run(self) -> None:
        """The whole average, blocking."""
        self.start()
        self.exchange(block=True)
        self.finish()


class Batched:
    """Several :class:`TwoPhaseSteps` in one all-to-all and one all-gather: each part's
    message rows side by side; the same numbers and bytes as one run per part."""

    def __init__(self, parts: Sequence[TwoPhaseSteps]):
        self.parts = list(parts)

    def compress(self) -> torch.Tensor:
        outgoing = [part.compress() for part in self.parts]
        self.widths = [message.shape[1] for message in outgoing]
        return torch.cat(outgoing, dim=1)

    def serve(self, incoming: torch.Tensor) -> torch.Tensor:
        pieces = incoming.split(self.widths, dim=1)
        return torch.cat(
            [part.serve(piece) for part, piece in zip(self.parts, pieces, strict=True)]
        )

    def expand(self, gathered: torch.Tensor) -> None:
        pieces = gathered.split(self.widths, dim=1)
        for part, piece in zip(self.parts, pieces, strict=True):
            part.expand(piece)


class TwoPhaseCodec(Codec):
    """The two-phase average (module docstring) for an element encoding that subclasses
    define: ``_encode(rows) -> (message bytes per row, decoded rows)`` and
    ``_decode(messages) -> rows``; the p copies of a chunk are summed in fp32 in rank
    order. ``quantum`` is the element count every chunk is a multiple of;
    ``error_feedback`` keeps worker and server errors."""

    error_feedback = False
    quantum = 1

    def __init__(self, comm):
        super().__init__(comm)
        self.errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def padded(self, numel: int) -> int:
        """The buffer length the two phases work on: a multiple of ``p * quantum``."""
        step = self.comm.world_size * self.quantum
        return max(step, -(-numel // step) * step)

    def wire_bytes(self, numel: int) -> int:
        """Bytes this rank sends to average ``numel`` elements: (p - 1) message rows in
        each phase."""
        p = self.comm.world_size
        if p == 1:
            return 0
        chunk = self.padded(numel) // p
        return 2 * (p - 1) * self._row_bytes(chunk)

    def _row_bytes(self, chunk: int) -> int:
        raise NotImplementedError

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        run = self.start(tensors, key)
        if run is not None:
            run.exchange(block=True)
            run.finish()

    def start(self, tensors: Sequence[torch.Tensor], key: str) -> TwoPhaseRun | None:
        """Begin :meth:`all_reduce` of ``tensors``: encode and issue the all-to-all; the
        returned :class:`TwoPhaseRun` does the rest (None: nothing to send)."""
        if self.comm.alone or not tensors:
            return None
        return TwoPhaseRun(self.comm, _EncodedBuffer(self, list(tensors), key)).start()

    def average_async(self, tensor: torch.Tensor, key: str, kind: str, stats):
        """The two phases issued from the caller's thread (:class:`AsyncCodecAllReduce`)."""
        return AsyncCodecAllReduce(self, [tensor], key, kind, stats)

    def _errors(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self.errors or self.errors[key][0].numel() != x.numel():
            self.errors[key] = (
                torch.zeros_like(x),
                torch.zeros(x.numel() // self.comm.world_size, dtype=x.dtype, device=x.device),
            )
        return self.errors[key]

    def state_dict(self) -> dict:
        if not self.errors:
            return {}
        return {
            "world_size": self.comm.world_size,
            "errors": {k: [w.clone(), s.clone()] for k, (w, s) in self.errors.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.errors = {}
        if not state:
            return
        if state["world_size"] != self.comm.world_size:
            raise ValueError(
                f"{self.name} compression errors were saved on {state['world_size']} ranks, "
                f"this run has {self.comm.world_size}"
            )
        device = self.comm.device
        self.errors = {k: (w.to(device), s.to(device)) for k, (w, s) in state["errors"].items()}

    def _encode(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, messages: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _EncodedBuffer:
    """The :class:`TwoPhaseSteps` of a :class:`TwoPhaseCodec` on a list of tensors: a
    zero-padded fp32 copy, the codec's errors of ``key`` when it keeps them."""

    def __init__(self, codec: TwoPhaseCodec, tensors: list[torch.Tensor], key: str):
        self.codec = codec
        self.tensors = tensors
        self.key = key

    def compress(self) -> torch.Tensor:
        codec, p = self.codec, self.codec.comm.world_size
        flat = codec._flatten(self.tensors)
        self.numel = flat.numel()
        x = torch.zeros(codec.padded(self.numel), dtype=torch.float32, device=flat.device)
        x[: self.numel] = flat
        worker_error = self.server_error = None
        if codec.error_feedback:
            worker_error, self.server_error = codec._errors(self.key, x)
            x.add_(worker_error)
        outgoing, decoded = codec._encode(x.view(p, -1))
        if worker_error is not None:
            torch.sub(x, decoded.view(-1), out=worker_error)
        return outgoing

    def serve(self, incoming: torch.Tensor) -> torch.Tensor:
        codec, p = self.codec, self.codec.comm.world_size
        mine = codec._decode(incoming).sum(dim=0, keepdim=True).div_(p)
        if self.server_error is not None:
            mine.add_(self.server_error.view(1, -1))
        reply, decoded_mine = codec._encode(mine)
        if self.server_error is not None:
            torch.sub(mine.view(-1), decoded_mine.view(-1), out=self.server_error)
        return reply

    def expand(self, gathered: torch.Tensor) -> None:
        result = self.codec._decode(gathered).reshape(-1)[: self.numel]
        self.codec._unflatten(result, self.tensors)


class AsyncCodecAllReduce:
    """``codec.all_reduce(tensors, key)`` of a :class:`TwoPhaseCodec` in flight, with the
    interface of :class:`~onebit_bert.distributed.comm.AsyncAllReduce`. No thread: the
    constructor issues the all-to-all (on the codec's own process group), :meth:`advance`
    issues the all-gather, and :meth:`wait` ends it, all on the caller's thread; a caller
    that calls :meth:`advance` at the same point of every rank's step keeps the order of
    collectives identical on every rank. The bytes are filed in ``stats`` under ``kind`` at
    launch (:meth:`TwoPhaseCodec.wire_bytes`, checked against what the codec's own
    communicator counted when waited), the seconds the caller blocked in :meth:`advance`
    and :meth:`wait` when waited; ``in_flight_seconds`` runs from launch to the end of the
    all-gather as this rank saw it."""

    def __init__(
        self, codec: TwoPhaseCodec, tensors: Sequence[torch.Tensor], key: str, kind: str, stats
    ):
        self.codec = codec
        self.kind = kind
        self.stats = stats
        self.before = codec.comm.snapshot()
        self.nbytes = codec.wire_bytes(sum(t.numel() for t in tensors))
        stats.add(kind, self.nbytes, 0.0)
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self.blocked = 0.0
        self.waited = False
        with codec.comm.traffic(kind):
            self.run = codec.start(tensors, key)

    def advance(self) -> None:
        """Issue the all-gather if it is not issued yet (blocking, on CPU, for the rest of
        the all-to-all; on CUDA the device stream waits instead)."""
        if self.run is None or self.run.stage != "exchanging":
            return
        start = time.perf_counter()
        with self.codec.comm.traffic(self.kind):
            self.run.exchange(block=True)
        self.blocked += time.perf_counter() - start

    def wait(self) -> float:
        """Finish; the seconds blocked in :meth:`advance` and here (0 on later calls)."""
        if self.waited:
            return 0.0
        self.advance()
        start = time.perf_counter()
        if self.run is not None:
            self.run.finish()
        self.finished_at = time.perf_counter()
        self.blocked += self.finished_at - start
        self.waited = True
        sent = (self.codec.comm.snapshot() - self.before).bytes_sent
        if sent != self.nbytes:
            raise RuntimeError(
                f"the {self.codec.name} average sent {sent} bytes where {self.nbytes} were "
                f"counted at launch"
            )
        self.stats.add_seconds(self.kind, self.blocked)
        return self.blocked

    @property
    def in_flight_seconds(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.started_at
