"""Triton kernels of :mod:`onebit_bert.kernels.signs` (loaded through
:func:`onebit_bert.kernels.triton_module`, never imported where Triton may be missing).

Every kernel works on a tile of ``BLOCK`` bytes by 8 elements: row ``r`` of the tile is
byte ``r`` of the packed signs and the 8 elements it encodes (bit ``k``: element ``8r+k``).
"""

import triton
import triton.language as tl


@triton.jit
def _error(values, pending, index, inside, real):
    """The error that stored ``values`` stand for: ``v - p·sign(v)`` with ``p`` the
    pending scale (0 when the values are the errors themselves: the same bits), 0 from
    ``real`` on. The reference's subtraction of ``±p``, as :func:`encode` would have
    stored it."""
    v = tl.load(values + index, mask=inside, other=0.0)
    p = tl.load(pending)
    return tl.where(index < real, tl.where(v >= 0, v - p, v + p), 0.0)


@triton.jit
def encode(x, values, pending, message, partial, n_bytes, body, row_stride, received, scales,
           ranks, ranks_f, stride, real, SERVER: tl.constexpr, MEASURE: tl.constexpr,
           STORED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The signs of the values compressed into ``message`` (byte ``r`` to row ``r // body``,
    column ``r % body``, rows ``row_stride`` bytes apart).

    With ``STORED`` the values are in ``values`` already (a caller wrote them) and only
    the signs are written. Otherwise ``v`` is the error (:func:`_error`) plus ``x``
    (worker) or plus ``mean_i(±s_i)`` over the received rows, 0 from ``real`` on (server:
    the reference's ``combine_chunks``), written over ``values`` (0 on the padding);
    ``partial[0, program]``: the sum of ``v²`` over the tile's real elements, with
    ``MEASURE`` (worker) also ``partial[1, program]``: of ``x²``, and ``partial[2,
    program]``: of ``|v|``. The error left, ``v - s·sign(v)``, needs the scale ``s`` of
    the whole bucket: it is taken when the values are next read."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, 8)
    index = rows[:, None] * 8 + cols[None, :]
    inside = rows[:, None] < n_bytes
    if STORED:
        v = tl.load(values + index, mask=inside, other=0.0)
    else:
        e = _error(values, pending, index, inside, real)
        if SERVER:
            acc = tl.zeros((BLOCK, 8), dtype=tl.float32)
            for i in range(ranks):
                byte = tl.load(received + i * stride + rows, mask=rows < n_bytes, other=0)
                bit = (byte.to(tl.int32)[:, None] >> cols[None, :]) & 1
                s = tl.load(scales + i)
                acc += tl.where(bit != 0, s, -s)
            acc = tl.math.div_rn(acc, tl.zeros_like(acc) + ranks_f)
            plain = tl.where(index < real, acc, 0.0)
        else:
            plain = tl.load(x + index, mask=inside, other=0.0)
        v = plain + e
        tl.store(values + index, tl.where(index < real, v, 0.0), mask=inside)
    bits = tl.where(v >= 0, 1, 0) << cols[None, :]
    byte = tl.sum(bits, axis=1).to(tl.uint8)
    at = (rows // body) * row_stride + rows % body
    tl.store(message + at, byte, mask=rows < n_bytes)
    if not STORED:
        real_v = tl.where(index < real, v, 0.0)
        tl.store(partial + tl.program_id(0), tl.sum(tl.sum(real_v * real_v, axis=1), axis=0))
        if MEASURE:
            width = tl.num_programs(0)
            plain = tl.where(index < real, plain, 0.0)
            tl.store(partial + width + tl.program_id(0),
                     tl.sum(tl.sum(plain * plain, axis=1), axis=0))  # fmt: skip
            tl.store(partial + 2 * width + tl.program_id(0),
                     tl.sum(tl.sum(tl.abs(real_v), axis=1), axis=0))  # fmt: skip


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
