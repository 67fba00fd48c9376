"""Triton kernels of :mod:`onebit_bert.kernels.signs` (loaded through
:func:`onebit_bert.kernels.triton_module`, never imported where Triton may be missing).

Every kernel works on a tile of ``BLOCK`` bytes by 8 elements: row ``r`` of the tile is
byte ``r`` of the packed signs and the 8 elements it encodes (bit ``k``: element ``8r+k``).
"""

import triton
import triton.language as tl


@triton.jit
def _value(x, err, index, rows, cols, n_bytes, received, scales, ranks, ranks_f, stride, real,
           SERVER: tl.constexpr):  # fmt: skip
    """The values whose signs are sent: ``x + e`` (worker), or ``mean_i(±s_i)`` over the
    received rows, 0 from ``real`` on, plus ``e`` (server: the reference's
    ``combine_chunks``, then ``compress_in_place``'s addition)."""
    inside = rows[:, None] < n_bytes
    e = tl.load(err + index, mask=inside, other=0.0)
    if SERVER:
        acc = tl.zeros((rows.shape[0], 8), dtype=tl.float32)
        for i in range(ranks):
            byte = tl.load(received + i * stride + rows, mask=rows < n_bytes, other=0)
            bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
            s = tl.load(scales + i)
            acc += tl.where(bit != 0, s, -s)
        acc = tl.math.div_rn(acc, tl.zeros_like(acc) + ranks_f)
        v = tl.where(index < real, acc, 0.0) + e
    else:
        v = tl.load(x + index, mask=inside, other=0.0) + e
    return v


@triton.jit
def sum_squares(x, err, partial, partial_input, n_bytes, received, scales, ranks, ranks_f,
                stride, real, SERVER: tl.constexpr, MEASURE: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """``partial[program]``: the sum of the squared values over this tile's real elements;
    with ``MEASURE`` (worker) also ``partial_input[program]``, that of ``x`` alone (``x``
    read once for both; only a worker measures)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, 8)
    index = rows[:, None] * 8 + cols[None, :]
    if MEASURE:
        plain = tl.load(x + index, mask=rows[:, None] < n_bytes, other=0.0)
        v = plain + tl.load(err + index, mask=rows[:, None] < n_bytes, other=0.0)
        tl.store(partial_input + tl.program_id(0), tl.sum(tl.sum(plain * plain, axis=1), axis=0))
    else:
        v = _value(x, err, index, rows, cols, n_bytes, received, scales, ranks, ranks_f, stride,
                   real, SERVER)  # fmt: skip
    v = tl.where(index < real, v, 0.0)
    tl.store(partial + tl.program_id(0), tl.sum(tl.sum(v * v, axis=1), axis=0))


@triton.jit
def pack(x, err, scale, message, partial_error, n_bytes, body, row_stride, received, scales,
         ranks, ranks_f, stride, real, SERVER: tl.constexpr, MEASURE: tl.constexpr,
         BLOCK: tl.constexpr):  # fmt: skip
    """The signs of the values into ``message`` (byte ``r`` to row ``r // body``, column
    ``r % body``, rows ``row_stride`` bytes apart) and ``err = v - scale·sign(v)`` (0 from
    ``real`` on); with ``MEASURE``, ``partial_error[program]``: the sum of its squares."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, 8)
    index = rows[:, None] * 8 + cols[None, :]
    v = _value(x, err, index, rows, cols, n_bytes, received, scales, ranks, ranks_f, stride,
               real, SERVER)  # fmt: skip
    positive = v >= 0
    bits = tl.where(positive, 1, 0) << cols[None, :]
    byte = tl.sum(bits, axis=1).to(tl.uint8)
    at = (rows // body) * row_stride + rows % body
    tl.store(message + at, byte, mask=rows < n_bytes)
    s = tl.load(scale)
    left = tl.where(positive, v - s, v + s)  # v - (±s), the reference's subtraction
    left = tl.where(index < real, left, 0.0)
    tl.store(err + index, left, mask=rows[:, None] < n_bytes)
    if MEASURE:
        tl.store(partial_error + tl.program_id(0), tl.sum(tl.sum(left * left, axis=1), axis=0))


@triton.jit
def expand(gathered, scales, x, n_bytes, body, row_stride, real, BLOCK: tl.constexpr):
    """``x`` from the gathered messages: byte ``r`` from row ``r // body`` (whose scale is
    ``scales[r // body]``) gives elements ``8r .. 8r+7`` as ``±scale``; 0 from ``real`` on."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, 8)
    inside = rows < n_bytes
    sender = rows // body
    byte = tl.load(gathered + sender * row_stride + rows % body, mask=inside, other=0)
    s = tl.load(scales + sender, mask=inside, other=0.0)
    bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
    out = tl.where(bit != 0, s[:, None], -s[:, None])
    index = rows[:, None] * 8 + cols[None, :]
    out = tl.where(index < real, out, 0.0)
    tl.store(x + index, out, mask=inside[:, None])
