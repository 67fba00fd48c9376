"""The 1-bit all-reduce's per-bucket work as Triton kernels (:class:`FusedSignOps`).

Same contract as the reference :class:`~onebit_bert.distributed.codecs.compression.SignOps`,
whose passes over a bucket it replaces (elements: ``x`` the bucket, ``e`` an error):

- worker, :meth:`FusedSignOps.compress`: one pass sums ``(x+e)²`` over the real
  elements into per-block partials (the scale ``s`` is their sum's root over
  ``sqrt(real)``), a second writes the packed signs of ``x+e`` straight into the message
  rows and ``e = x+e - s·sign(x+e)`` (0 on the padding). ``x`` itself is not written:
  the bucket is overwritten by :meth:`~FusedSignOps.expand` before anyone reads it;
- server, :meth:`FusedSignOps.serve`: the average of the ranks' ``±s_i`` for this rank's
  chunk is recomputed from the received bytes in both passes instead of being stored;
- everyone, :meth:`FusedSignOps.expand`: one pass from the gathered bytes to ``±s_i``.

Bits are the reference's: bit ``k`` of byte ``i`` is the sign of element ``8i+k``, 1 for
``>= 0`` (NaN packs as negative). The packed signs, the server's sum of ``±s_i`` (a sum of
exact values in rank order, divided with IEEE rounding) and the expansion are bit for bit
the reference's for the same inputs; a scale is a sum of squares in another order, so it
and the errors it enters agree within rounding.

The kernels themselves are in ``onebit_bert/kernels/triton_src/signs.py``, loaded on first
use for the current Triton mode (:func:`~onebit_bert.kernels.triton_module`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from onebit_bert.kernels import COMPILE_OPTIONS, triton_module

SCALE_BYTES = 4  # the fp32 scale after each message row (as distributed.codecs.compression)
BYTES_PER_PROGRAM = 256  # 2,048 elements: 8 KiB of fp32 read per program and operand
MAX_BUCKET = 2**31 - 8
"""The most elements of one bucket the kernels take: they index its elements (and the
bytes of its messages) in 32-bit integers."""


def _scales(messages: torch.Tensor) -> torch.Tensor:
    """The fp32 scale at the end of each message row."""
    tail = torch.empty(messages.shape[0], SCALE_BYTES, dtype=torch.uint8, device=messages.device)
    tail.copy_(messages[:, -SCALE_BYTES:])
    return tail.view(torch.float32).view(-1)


class Measured:
    """Sums of squares over the buckets compressed inside :meth:`FusedSignOps.measure`:
    of the workers' inputs and of their errors after compression (the error figure's two
    norms, without two more passes over the buffer)."""

    def __init__(self, device):
        self.input_sq = torch.zeros((), dtype=torch.float32, device=device)
        self.error_sq = torch.zeros((), dtype=torch.float32, device=device)

    def relative_error(self) -> torch.Tensor:
        """‖errors‖ / ‖inputs‖, as the reference codec computes its error figure."""
        return self.error_sq.sqrt() / self.input_sq.sqrt().clamp_min(1e-30)


class FusedSignOps:
    """The per-bucket work of the 1-bit all-reduce in Triton kernels: worker compression
    into message rows, the server step, expansion. Buffers are flat fp32, contiguous,
    their length a multiple of ``8 × ranks``."""

    name = "fused"
    takes_squares = True
    """:meth:`compress` takes the sum of squares from a caller that has it."""

    def __init__(self, block: int = BYTES_PER_PROGRAM):
        self.block = block
        self._measured: Measured | None = None

    @contextmanager
    def measure(self, device):
        """Inside the block, worker compressions also sum the squares of their inputs and
        of their new errors into the :class:`Measured` yielded."""
        self._measured = Measured(device)
        try:
            yield self._measured
        finally:
            self._measured = None

    @staticmethod
    def check_bucket(numel: int) -> None:
        """Refuse a bucket of ``numel`` elements past the kernels' 32-bit indices."""
        if numel > MAX_BUCKET:
            raise ValueError(
                f"a 1-bit bucket of {numel:,} elements is past the fused kernels' "
                f"limit of {MAX_BUCKET:,}: set optimizer.bucket_numel to at most that "
                "(or optimizer.kernels: reference)"
            )

    def _grid(self, n_bytes: int) -> tuple[int]:
        self.check_bucket(8 * n_bytes)
        return (max(1, -(-n_bytes // self.block)),)

    def _scale(self, partial: torch.Tensor, real: int) -> torch.Tensor:
        if real == 0:
            return torch.zeros((), dtype=torch.float32, device=partial.device)
        return partial.sum().sqrt() / math.sqrt(real)

    def _encode(
        self, x, err, message, body, real, received, scales, ranks, stride, server, squares=None
    ):
        k = triton_module("signs")
        n_bytes = err.numel() // 8
        grid = self._grid(n_bytes)
        partial = torch.empty(grid[0], dtype=torch.float32, device=err.device)
        measured = None if server else self._measured
        sums = torch.empty(2, grid[0], dtype=torch.float32, device=err.device) if measured else None
        input_sq, error_sq = (sums[0], sums[1]) if measured else (partial, partial)
        common = dict(SERVER=server, MEASURE=measured is not None, BLOCK=self.block)
        common.update(COMPILE_OPTIONS)
        # both passes read the same sources: the received rows (a server) and the real count
        sources = (received, scales, ranks, float(ranks), stride, real)
        if squares is None:
            k.sum_squares[grid](x, err, partial, input_sq, n_bytes, *sources, **common)
            scale = self._scale(partial, real)
        else:  # the caller summed (x + err)² over the real elements, and x² if measured
            scale = self._scale(squares, real)
            if measured is not None:
                sums[0].zero_()
        width = message.shape[-1] if message.dim() == 2 else message.numel()
        k.pack[grid](x, err, scale, message, error_sq, n_bytes, body, width, *sources, **common)
        message.view(-1, body + SCALE_BYTES)[:, body:] = scale.reshape(1).view(torch.uint8)
        if measured is not None:
            totals = sums.sum(dim=1)
            measured.input_sq += totals[0]
            measured.error_sq += totals[1]
        return scale

    def compress(
        self,
        x: torch.Tensor,
        error: torch.Tensor,
        real: int,
        table,
        rows: int,
        squares: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Worker: ``(rows, x.numel()/8/rows + 4)`` message bytes, row ``j`` chunk ``j``'s
        signs of ``x + error`` and the scale; ``error`` updated. ``x`` is left as it was
        (the reference leaves ``x + error`` there; nobody reads it before the expansion
        overwrites it). ``squares``: the sum of ``(x + error)²`` over the real elements,
        where the caller has it (one pass fewer; inside :meth:`measure` the caller then
        adds the inputs' squares itself)."""
        body = x.numel() // 8 // rows
        message = torch.empty(rows, body + SCALE_BYTES, dtype=torch.uint8, device=x.device)
        self._encode(x, error, message, body, real, x, error, 0, 0, False, squares)
        return message

    def serve(self, incoming: torch.Tensor, error: torch.Tensor, real: int, table) -> torch.Tensor:
        """Server: average this rank's chunk over the rows of ``incoming`` (one per rank:
        signs, then the sender's scale), compress it with ``error`` into one flat message."""
        body = error.numel() // 8
        message = torch.empty(body + SCALE_BYTES, dtype=torch.uint8, device=error.device)
        scales = _scales(incoming)
        incoming = incoming.contiguous()
        self._encode(
            error,
            error,
            message,
            body,
            real,
            incoming,
            scales,
            incoming.shape[0],
            incoming.shape[1],
            server=True,
        )
        return message

    def expand(self, gathered: torch.Tensor, x: torch.Tensor, real: int, table) -> None:
        """Everyone: ``x`` (``ranks × chunk``) from every server's message, row ``i`` for
        chunk ``i``: ``±s_i``, 0 past ``real``."""
        gathered = gathered.contiguous()
        body = gathered.shape[1] - SCALE_BYTES
        n_bytes = x.numel() // 8
        grid = self._grid(n_bytes)
        triton_module("signs").expand[grid](
            gathered,
            _scales(gathered),
            x,
            n_bytes,
            body,
            gathered.shape[1],
            real,
            BLOCK=self.block,
            **COMPILE_OPTIONS,
        )
