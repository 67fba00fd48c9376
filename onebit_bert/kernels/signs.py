"""The 1-bit all-reduce's per-bucket work as Triton kernels (:class:`FusedSignOps`).

Same contract as the reference :class:`~onebit_bert.distributed.codecs.compression.SignOps`,
whose passes over a bucket it replaces (elements: ``x`` the bucket, ``e`` an error), but
the errors are kept as the values last compressed with their bucket's scale pending
(:class:`~onebit_bert.distributed.codecs.compression.ErrorFeedback`): the error left,
``v - s·sign(v)``, needs ``s``, the root mean square of the whole bucket's ``v``, so
writing it would take a second pass over the bucket; it is taken instead where the
values are next read, in the pass that reads them anyway.

- worker, :meth:`FusedSignOps.compress`: one pass writes ``v = x + e`` over the stored
  values and its packed signs straight into the message rows, and sums ``v²`` over the
  real elements into per-block partials (the scale ``s`` is their sum's root over
  ``sqrt(real)``); where the caller has written ``v`` already (1-bit LAMB's fold) and
  summed it, the pass only packs the signs. ``x`` itself is not written: the bucket is
  overwritten by :meth:`~FusedSignOps.expand` before anyone reads it;
- server, :meth:`FusedSignOps.serve`: the same single pass on the average of the ranks'
  ``±s_i`` for this rank's chunk, recomputed from the received bytes;
- everyone, :meth:`FusedSignOps.expand`: one pass from the gathered bytes to ``±s_i``.

Bits are the reference's: bit ``k`` of byte ``i`` is the sign of element ``8i+k``, 1 for
``>= 0`` (NaN packs as negative). The packed signs, the server's sum of ``±s_i`` (a sum of
exact values in rank order, divided with IEEE rounding), the expansion and an error taken
from its value and scale are bit for bit the reference's for the same inputs; a scale is a
sum of squares in another order, so it and the errors it enters agree within rounding.
The error figure's ``‖e‖²`` is ``2·Σv² - 2s·Σ|v|`` per bucket (``s² = Σv²/real``), from the
pass's sums.

The kernels themselves are in ``onebit_bert/kernels/triton_src/signs.py``, loaded on first
use for the current Triton mode (:func:`~onebit_bert.kernels.triton_module`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from onebit_bert.distributed.codecs.packing import settle
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
    """:meth:`compress` takes values and their sums from a caller that has them."""
    keeps_values = True
    """The errors' buffers hold the values last compressed, their scale pending."""

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

    def _scale(self, squares: torch.Tensor, real: int) -> torch.Tensor:
        if real == 0:
            return torch.zeros((), dtype=torch.float32, device=squares.device)
        return squares.sum().sqrt() / math.sqrt(real)

    def _encode(
        self, x, values, pending, message, body, real, received, scales, ranks, stride, server,
        squares=None,
    ):  # fmt: skip
        """One pass (:func:`encode`) and the scale; ``pending``: the bucket's pending
        scale (read, then replaced by the new one), or None to leave errors in
        ``values``."""
        k = triton_module("signs")
        n_bytes = values.numel() // 8
        grid = self._grid(n_bytes)
        measured = None if server else self._measured
        stored = squares is not None
        width = message.shape[-1] if message.dim() == 2 else message.numel()
        if pending is None:
            old = torch.zeros(1, dtype=torch.float32, device=values.device)
        else:
            old = pending
        # the pass's sums (a pass that only packs signs writes none)
        partial = old if stored else torch.empty(3, grid[0], device=values.device)
        # (with STORED nothing is measured in the pass: one variant either way)
        measure = measured is not None and not stored
        common = dict(SERVER=server, MEASURE=measure, STORED=stored, BLOCK=self.block)
        common.update(COMPILE_OPTIONS)
        k.encode[grid](
            x, values, old, message, partial, n_bytes, body, width, received, scales, ranks,
            float(ranks), stride, real, **common,
        )  # fmt: skip
        if stored:  # the caller wrote the values and summed their squares and sizes
            square_sum, size_sum = squares[0], squares[1]
        else:
            square_sum, size_sum = partial[0], partial[2]
        scale = self._scale(square_sum, real)
        message.view(-1, body + SCALE_BYTES)[:, body:] = scale.reshape(1).view(torch.uint8)
        if measured is not None:
            if not stored:  # else the caller adds the inputs' squares itself
                measured.input_sq += partial[1].sum()
            left = 2 * square_sum.sum() - 2 * scale * size_sum.sum()
            measured.error_sq += left.clamp_min(0)
        if pending is None:
            settle(values, scale, real)
        else:
            pending.copy_(scale.reshape(1))
        return scale

    def compress(
        self,
        x: torch.Tensor,
        values: torch.Tensor,
        real: int,
        table,
        rows: int,
        squares: torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Worker: ``(rows, x.numel()/8/rows + 4)`` message bytes, row ``j`` chunk ``j``'s
        signs of ``x + error`` and the scale; ``values`` then hold ``x + error``, with the
        scale in ``pending`` (one element: the bucket's, which the error is taken with),
        or, without ``pending``, the error left. ``x`` is left as it was (the reference
        leaves ``x + error`` there; nobody reads it before the expansion overwrites it).
        ``squares``: where the caller wrote ``x + error`` to ``values`` itself, the sums of
        its squares and of its sizes over the real elements (one pass fewer: the pass
        only packs signs; inside :meth:`measure` the caller then adds the inputs'
        squares itself)."""
        body = x.numel() // 8 // rows
        message = torch.empty(rows, body + SCALE_BYTES, dtype=torch.uint8, device=x.device)
        self._encode(x, values, pending, message, body, real, x, values, 0, 0, False, squares)
        return message

    def serve(
        self,
        incoming: torch.Tensor,
        values: torch.Tensor,
        real: int,
        table,
        pending: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Server: average this rank's chunk over the rows of ``incoming`` (one per rank:
        signs, then the sender's scale), compress it with the error ``values`` stand for
        into one flat message (``values`` and ``pending`` as in :meth:`compress`)."""
        body = values.numel() // 8
        message = torch.empty(body + SCALE_BYTES, dtype=torch.uint8, device=values.device)
        scales = _scales(incoming)
        incoming = incoming.contiguous()
        self._encode(
            values,
            values,
            pending,
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
