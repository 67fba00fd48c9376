"""State and arithmetic of the error-compensated 1-bit all-reduce.

The collective itself (which tensors go where) is
:func:`onebit_bert.distributed.codecs.onebit.compressed_all_reduce`; this module holds what
it needs between calls (:class:`ErrorFeedback`) and the per-bucket arithmetic, so the
collective reads as "compress, exchange, combine, exchange, expand".

Layout. A flat buffer of ``numel`` real elements is padded with zeros to ``padded_numel``
(a multiple of ``8 * world_size``) and cut into buckets, each a multiple of
``8 * world_size``. Within a bucket, rank ``j`` is the "server" of chunk ``j``. The padding
never carries a value: it is excluded from every scale and zeroed in errors and outputs.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from onebit_bert.distributed.codecs.packing import pack_signs, settle, unpack_signs
from onebit_bert.kernels import use_fused

# Bytes used to carry one fp32 scale next to the packed signs in the same message.
SCALE_BYTES = 4


@dataclass(frozen=True)
class Bucket:
    """One independently compressed slice ``[start, start + size)`` of the padded buffer."""

    start: int
    size: int  # multiple of 8 * world_size
    real: int  # elements of this bucket that are real (not padding)

    def chunk_real(self, j: int, world_size: int) -> int:
        """Real elements in chunk ``j`` (the part rank ``j`` serves)."""
        chunk = self.size // world_size
        return max(0, min(chunk, self.real - j * chunk))


def padded_size(numel: int, world_size: int) -> int:
    """Smallest multiple of ``8 * world_size`` that holds ``numel`` elements (at least one)."""
    quantum = 8 * world_size
    return max(quantum, -(-numel // quantum) * quantum)


def plan_buckets(numel: int, world_size: int, bucket_numel: int | None) -> list[Bucket]:
    """Cut the padded buffer into buckets of at most ``bucket_numel`` elements."""
    padded = padded_size(numel, world_size)
    quantum = 8 * world_size
    if bucket_numel is None or bucket_numel >= padded:
        step = padded
    else:
        if bucket_numel < quantum:
            raise ValueError(
                f"bucket size {bucket_numel} is below the minimum of 8 x world size = "
                f"{quantum} elements; use a larger bucket size or none"
            )
        step = bucket_numel // quantum * quantum
    buckets = []
    for start in range(0, padded, step):
        size = min(step, padded - start)
        buckets.append(Bucket(start, size, max(0, min(size, numel - start))))
    return buckets


class ErrorFeedback:
    """This rank's compression errors for one flat buffer: what 1-bit rounding left out.

    ``worker_error`` covers the whole padded buffer; ``server_error`` covers the chunk this
    rank serves in every bucket (``padded_numel / world_size`` elements in all).

    Per-bucket work that :attr:`~onebit_bert.kernels.signs.FusedSignOps.keeps_values`
    saves a pass by storing what it compressed rather than the error left: it writes ``v``
    to :attr:`worker_values` (:attr:`server_values`) and bucket ``k``'s scale ``s`` to
    ``worker_scale[k]`` (``server_scale[k]``), and the error ``v - s·sign(v)`` is taken
    where the values are next read, by the next compression or by :meth:`settle`. With
    scale 0 the values are the errors. ``worker_error`` and ``server_error`` settle
    first, so whoever reads or writes the errors sees errors. A caller may write a
    bucket's values itself ahead of its compression (1-bit LAMB's fold: ``x + e``, the
    error taken with the pending scale); until that bucket is compressed its values and
    scale belong to no error, and nothing reads them in between.
    """

    def __init__(
        self,
        numel: int,
        world_size: int,
        rank: int = 0,
        device: torch.device | str = "cpu",
        bucket_numel: int | None = None,
    ):
        if numel < 1:
            raise ValueError(f"a compressed buffer needs at least one element, got {numel}")
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.numel = numel
        self.world_size = world_size
        self.rank = rank
        self.bucket_numel = bucket_numel
        self.buckets = plan_buckets(numel, world_size, bucket_numel)
        self.padded_numel = padded_size(numel, world_size)
        self.worker_values = torch.zeros(self.padded_numel, device=device)
        self.server_values = torch.zeros(self.padded_numel // world_size, device=device)
        self.worker_scale = torch.zeros(len(self.buckets), device=device)
        self.server_scale = torch.zeros(len(self.buckets), device=device)
        self.pending = False
        """Whether a scale may be pending (set by whoever stores values)."""

    @property
    def worker_error(self) -> torch.Tensor:
        self.settle()
        return self.worker_values

    @property
    def server_error(self) -> torch.Tensor:
        self.settle()
        return self.server_values

    def settle(self) -> None:
        """Make the stored values the errors they stand for (:func:`settle`, bucket by
        bucket) and the scales 0; the next compression gives the same bits either way."""
        if not self.pending:
            return
        p = self.world_size
        for k, b in enumerate(self.buckets):
            settle(self.worker_values[b.start : b.start + b.size], self.worker_scale[k], b.real)
            chunk = self.server_values[b.start // p : (b.start + b.size) // p]
            settle(chunk, self.server_scale[k], b.chunk_real(self.rank, p))
        self.worker_scale.zero_()
        self.server_scale.zero_()
        self.pending = False

    def reset(self) -> None:
        for t in (self.worker_values, self.server_values, self.worker_scale, self.server_scale):
            t.zero_()
        self.pending = False

    PLAN = ("numel", "world_size", "rank", "bucket_numel")
    """What the errors were laid out for: saved with them, checked on load."""

    def state_dict(self) -> dict:
        state = {key: getattr(self, key) for key in self.PLAN}
        state.update(worker_error=self.worker_error.clone(), server_error=self.server_error.clone())
        return state

    def load_state_dict(self, state: dict) -> bool:
        """Restore saved errors. Returns False (and resets, with a warning) if they were
        saved under a different world size or bucket plan, or by another rank, where they
        mean nothing for this rank."""
        if state["numel"] != self.numel:
            raise ValueError(
                f"saved compression errors cover {state['numel']} elements but this buffer "
                f"has {self.numel}: the checkpoint belongs to a different model"
            )
        saved = (state["world_size"], state["rank"], state["bucket_numel"])
        if saved != (self.world_size, self.rank, self.bucket_numel):
            warnings.warn(
                f"compression errors were saved by rank {saved[1]} of world size {saved[0]} "
                f"(bucket {saved[2]}); this is rank {self.rank} of world size "
                f"{self.world_size} (bucket {self.bucket_numel}): starting them from zero",
                stacklevel=2,
            )
            self.reset()
            return False
        self.reset()
        self.worker_values.copy_(state["worker_error"])
        self.server_values.copy_(state["server_error"])
        return True


def rms(x: torch.Tensor, count: int) -> torch.Tensor:
    """‖x‖₂ / sqrt(count) as a 0-dim tensor (0 for an empty slice), without a host sync."""
    if count == 0:
        return torch.zeros((), device=x.device, dtype=torch.float32)
    return torch.linalg.vector_norm(x[:count].float()) / math.sqrt(count)


def compress_in_place(
    x: torch.Tensor, error: torch.Tensor, real: int, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Error-compensated 1-bit compression of ``x`` (the worker or the server step).

    ``x += error``; one scale ``s = rms(x)``; ``error = x - s * sign(x)`` on the real
    elements and 0 on the padding. Returns ``(packed signs, scale)``.
    """
    x.add_(error)
    scale = rms(x, real)
    packed = pack_signs(x)
    # s·sign(x) by expanding the packed signs (a table lookup per byte) is several times
    # faster than an elementwise select over x.
    unpack_signs(packed, scale, out=error, table=table)
    torch.sub(x, error, out=error)
    error[real:].zero_()
    return packed, scale


def combine_chunks(
    received: torch.Tensor, world_size: int, table: torch.Tensor, out: torch.Tensor
) -> None:
    """Server step: ``out = (1/p) * sum_i s_i * sign_i`` over the chunks of every rank.

    ``received`` is ``(p, chunk/8 + SCALE_BYTES)`` uint8, row ``i`` from rank ``i``: its
    packed signs for this chunk, then its fp32 scale.
    """
    body = received.shape[1] - SCALE_BYTES
    scales = read_scales(received)
    out.zero_()
    term = torch.empty_like(out)
    for i in range(world_size):
        unpack_signs(received[i, :body], scales[i], out=term, table=table)
        out.add_(term)
    out.div_(world_size)


def read_scales(messages: torch.Tensor) -> torch.Tensor:
    """The fp32 scale at the end of each message row of :func:`frame`."""
    tail = torch.empty(messages.shape[0], SCALE_BYTES, dtype=torch.uint8, device=messages.device)
    tail.copy_(messages[:, -SCALE_BYTES:])
    return tail.view(torch.float32).view(-1)


def frame(packed: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Lay packed signs out as ``rows`` messages, each followed by the 4 bytes of ``scale``."""
    body = packed.numel() // rows
    message = torch.empty(rows, body + SCALE_BYTES, dtype=torch.uint8, device=packed.device)
    message[:, :body] = packed.view(rows, body)
    message[:, body:] = scale.to(torch.float32).reshape(1).view(torch.uint8)
    return message


class SignOps:
    """The per-bucket work of the 1-bit all-reduce in plain torch: the reference, on every
    device. :class:`onebit_bert.kernels.signs.FusedSignOps` does the same in fewer passes
    (:func:`sign_ops` chooses). ``table`` is
    :func:`~onebit_bert.distributed.codecs.packing.sign_table` for the buffers' device."""

    name = "reference"

    def compress(
        self, x: torch.Tensor, error: torch.Tensor, real: int, table: torch.Tensor, rows: int
    ) -> torch.Tensor:
        """Worker: :func:`compress_in_place` on ``x``, framed as ``rows`` messages (row
        ``j``: chunk ``j``'s signs, then the scale)."""
        signs, scale = compress_in_place(x, error, real, table)
        return frame(signs, scale, rows)

    def serve(
        self, incoming: torch.Tensor, error: torch.Tensor, real: int, table: torch.Tensor
    ) -> torch.Tensor:
        """Server: average this rank's chunk over the rows of ``incoming`` (one per rank),
        zero it past ``real``, compress it with ``error``: one flat message."""
        mine = torch.empty(error.numel(), dtype=torch.float32, device=error.device)
        combine_chunks(incoming, incoming.shape[0], table, mine)
        mine[real:].zero_()
        signs, scale = compress_in_place(mine, error, real, table)
        return frame(signs, scale, 1).view(-1)

    def expand(self, gathered: torch.Tensor, x: torch.Tensor, real: int, table) -> None:
        """Everyone: chunk ``i`` of ``x`` from row ``i`` of ``gathered`` (server ``i``'s
        signs and scale); 0 past ``real``."""
        ranks = gathered.shape[0]
        chunk = x.numel() // ranks
        body = gathered.shape[1] - SCALE_BYTES
        server_scales = read_scales(gathered)
        for i in range(ranks):
            unpack_signs(
                gathered[i, :body],
                server_scales[i],
                out=x[i * chunk : (i + 1) * chunk],
                table=table,
            )
        x[real:].zero_()


def sign_ops(device: torch.device | str, kernels: str = "auto"):
    """The per-bucket implementation for buffers on ``device`` under setting ``kernels``
    (:func:`onebit_bert.kernels.use_fused`)."""
    if use_fused(device, kernels):
        from onebit_bert.kernels.signs import FusedSignOps

        return FusedSignOps()
    return SignOps()
