"""Triton kernels of :mod:`onebit_bert.kernels.multi_tensor` (loaded through
:func:`onebit_bert.kernels.triton_module`, never imported where Triton may be missing).

A launch covers a run of consecutive blocks of the block table (every tensor of a list, or
the run of tensors that share one alignment): program ``i`` works on block ``b = block0 +
i``, elements ``start .. start + BLOCK`` of tensor ``tensor[b]``, whose address it reads
from a table of pointers (one int64 per tensor and operand). A block never spans two
tensors, so per-tensor sums are sums of whole blocks' partials (:func:`segment_reduce`, in
a fixed order: the same bits on every rank and every run).
"""

import triton
import triton.language as tl

UNSPECIALIZED = ("block0",)
"""Arguments Triton's launcher compiles no variant for by value (a run's first block: one
kernel for every run, whatever block it starts at)."""


@triton.jit
def _at(pointers, t, ALIGNED: tl.constexpr):
    """Tensor ``t``'s fp32 address from a pointer table; with ``ALIGNED`` (every address
    of the table a multiple of 16 bytes, checked where the kernel is launched) the
    compiler is told so, and loads and stores go 16 bytes at a time."""
    at = tl.load(pointers + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        at = tl.multiple_of(at, 16)
    return at


@triton.jit
def _largest(x):
    """The largest element of ``x``, NaN if any is (as torch's max; Triton's drops a NaN).
    Two built-in reductions rather than one with a NaN-keeping combine, which Triton's
    interpreter runs element by element."""
    nan = tl.max((x != x).to(tl.int32), axis=0)
    return tl.where(nan > 0, float("nan"), tl.max(x, axis=0))


@triton.jit
def _block(block_tensor, block_start, block_end, block0, ALIGNED: tl.constexpr,
           BLOCK: tl.constexpr):  # fmt: skip
    """This program's block: its index ``b`` (the launch's first block ``block0`` plus the
    program's), its tensor ``t``, its elements' offsets in that tensor and which of them
    are inside the block (before ``block_end[b]``). With ``ALIGNED`` every block of the
    launch starts and ends at a multiple of 4 elements."""
    b = tl.program_id(0) + block0
    t = tl.load(block_tensor + b)
    start = tl.load(block_start + b)
    end = tl.load(block_end + b)
    if ALIGNED:
        start = tl.multiple_of(start, 4)
        end = tl.multiple_of(end, 4)
    offs = start + tl.arange(0, BLOCK)
    return b, t, offs, offs < end


@triton.jit
def segment_reduce(first_block, block_count, partial, out, MAX: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """``out[t]``: the sum (or ``MAX``: the maximum, NaN if any is) of tensor ``t``'s block
    partials."""
    t = tl.program_id(0)
    first = tl.load(first_block + t)
    count = tl.load(block_count + t)
    if MAX:
        acc = tl.full((BLOCK,), float("-inf"), tl.float32)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if MAX:
            part = tl.load(partial + first + offs, mask=offs < count, other=float("-inf"))
            acc = tl.maximum(acc, part, propagate_nan=tl.PropagateNan.ALL)
        else:
            part = tl.load(partial + first + offs, mask=offs < count, other=0.0)
            acc += part
    if MAX:
        tl.store(out + t, _largest(acc))
    else:
        tl.store(out + t, tl.sum(acc, axis=0))


@triton.jit
def _update(m, v, p, eps, bc1, bc2_sqrt, wd, BIAS: tl.constexpr, WD: tl.constexpr):
    """LAMB's update direction ``m / (sqrt(v) + eps) + wd·p`` (with bias correction:
    ``m / (sqrt(v)/bc2_sqrt + eps) / bc1``), rounded as the reference's passes round."""
    denom = tl.sqrt_rn(v)
    if BIAS:
        denom = tl.math.div_rn(denom, tl.zeros_like(denom) + bc2_sqrt)
    u = tl.math.div_rn(m, denom + eps)
    if BIAS:
        u = tl.math.div_rn(u, tl.zeros_like(u) + bc1)
    if WD:
        u = u + wd * p
    return u


@triton.jit(do_not_specialize=UNSPECIALIZED)
def lamb_measure(block_tensor, block_start, block_end, block0, p_ptrs, g_ptrs, m_ptrs, v_ptrs,
                 part_w, part_u, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bc1,
                 bc2_sqrt, wd, BIAS: tl.constexpr, WD: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """LAMB's moments (written), and per block the sums of ``p²`` and of the update's
    squares (the trust ratio's two norms)."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    p = tl.load(_at(p_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    g = tl.load(_at(g_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    m_at = _at(m_ptrs, t, ALIGNED) + offs
    v_at = _at(v_ptrs, t, ALIGNED) + offs
    m = tl.load(m_at, mask=inside, other=0.0) * beta1
    m = m + one_minus_beta1 * g
    v = tl.load(v_at, mask=inside, other=0.0) * beta2
    v = v + one_minus_beta2 * g * g
    tl.store(m_at, m, mask=inside)
    tl.store(v_at, v, mask=inside)
    u = _update(m, v, p, eps, bc1, bc2_sqrt, wd, BIAS, WD)
    u = tl.where(inside, u, 0.0)
    tl.store(part_w + b, tl.sum(p * p, axis=0))
    tl.store(part_u + b, tl.sum(u * u, axis=0))


@triton.jit(do_not_specialize=UNSPECIALIZED)
def scaled_step(block_tensor, block_start, block_end, block0, p_ptrs, m_ptrs, v_ptrs, coef, eps,
                bc1, bc2_sqrt, wd, BIAS: tl.constexpr, WD: tl.constexpr, ALIGNED: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """``p += coef[t] · u``, the update direction recomputed from the moments."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    p_at = _at(p_ptrs, t, ALIGNED) + offs
    p = tl.load(p_at, mask=inside, other=0.0)
    m = tl.load(_at(m_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    v = tl.load(_at(v_ptrs, t, ALIGNED) + offs, mask=inside, other=1.0)
    u = _update(m, v, p, eps, bc1, bc2_sqrt, wd, BIAS, WD)
    step = u * tl.load(coef + t)
    tl.store(p_at, p + step, mask=inside)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def onebit_fold(block_tensor, block_start, block_end, block0, g_ptrs, m_ptrs, prev_ptrs, coeffs,
                grad_scale, beta1, one_minus_beta1, HAS_SCALE: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """1-bit LAMB's fold: ``prev = m``, then ``m = (β1·m + (1-β1)·g) · coeff[t]``."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    m_at = _at(m_ptrs, t, ALIGNED) + offs
    m = tl.load(m_at, mask=inside, other=0.0)
    tl.store(_at(prev_ptrs, t, ALIGNED) + offs, m, mask=inside)
    g = tl.load(_at(g_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(grad_scale)
    m = m * beta1
    m = (m + one_minus_beta1 * g) * tl.load(coeffs + t)
    tl.store(m_at, m, mask=inside)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def onebit_fold_compensated(block_tensor, block_start, block_end, block0, g_ptrs, m_ptrs, e_ptrs,
                            coeffs, grad_scale, positions, step, pending, part_x, part_v,
                            part_abs, beta1, one_minus_beta1, HAS_SCALE: tl.constexpr,
                            ALIGNED: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """1-bit LAMB's fold with the 1-bit worker's first pass: ``x = (β1·m + (1-β1)·g) ·
    coeff[t]`` (``g`` times ``grad_scale`` with ``HAS_SCALE``; ``m`` is left as it was)
    plus the worker's error at the same place, written over the error: ``v = x + e``.
    The stored values ``e_v`` stand for the error ``e_v - p·sign(e_v)`` with ``p`` the
    pending scale of their bucket (``pending[k]``, ``k`` = the element's position in the
    compressed buffer, ``positions[t]`` plus its offset, over ``step``: a block never
    spans two buckets). Per block the sums of ``x²``, ``v²`` and ``|v|``."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    m = tl.load(_at(m_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    g = tl.load(_at(g_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(grad_scale)
    m = m * beta1
    x = (m + one_minus_beta1 * g) * tl.load(coeffs + t)
    p = tl.load(pending + (tl.load(positions + t) + tl.load(block_start + b)) // step)
    e_at = _at(e_ptrs, t, ALIGNED) + offs
    stored = tl.load(e_at, mask=inside, other=0.0)
    v = x + tl.where(stored >= 0, stored - p, stored + p)
    tl.store(e_at, v, mask=inside)
    v = tl.where(inside, v, 0.0)
    tl.store(part_x + b, tl.sum(x * x, axis=0))
    tl.store(part_v + b, tl.sum(v * v, axis=0))
    tl.store(part_abs + b, tl.sum(tl.abs(v), axis=0))


@triton.jit
def _measure(m, prev, v, inside, b, t, offs, fresh_at, p_ptrs, part_drift, part_u, part_ud,
             neg_beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd, WD: tl.constexpr,
             ALIGNED: tl.constexpr):  # fmt: skip
    """The rest of :func:`onebit_measure` once ``m`` is unscaled, masked and stored."""
    estimate = prev * neg_beta1
    estimate = tl.math.div_rn(estimate + m, tl.zeros_like(v) + one_minus_beta1)
    fresh = tl.load(fresh_at, mask=inside, other=1.0) * beta2
    fresh = fresh + one_minus_beta2 * estimate * estimate
    tl.store(fresh_at, fresh, mask=inside)
    denom = tl.sqrt_rn(v) + eps
    drift = tl.math.div_rn(denom, tl.sqrt_rn(fresh) + eps)
    tl.store(part_drift + b, _largest(tl.where(inside, drift, float("-inf"))))
    if WD:
        u = tl.where(inside, tl.math.div_rn(m, denom), 0.0)
        p = tl.load(_at(p_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
        decayed = u + wd * p
        tl.store(part_u + b, tl.sum(u * u, axis=0))
        tl.store(part_ud + b, tl.sum(decayed * decayed, axis=0))


@triton.jit(do_not_specialize=UNSPECIALIZED)
def onebit_measure(block_tensor, block_start, block_end, block0, m_ptrs, prev_ptrs, fresh_ptrs,
                   v_ptrs, p_ptrs, coeffs, part_drift, part_u, part_ud, neg_beta1,
                   one_minus_beta1, beta2, one_minus_beta2, eps, wd,
                   MASK_UNTRAINED: tl.constexpr, WD: tl.constexpr, ALIGNED: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """1-bit LAMB after the all-reduce: ``m /= coeff[t]`` (0 where ``v`` is 0 with
    ``MASK_UNTRAINED``), the fresh second moment from the reconstructed gradient
    ``(m - β1·prev)/(1-β1)`` (both written), and per block the largest drift
    ``(sqrt(v)+eps)/(sqrt(fresh)+eps)`` and, with ``WD``, the sums of squares of
    ``u = m/(sqrt(v)+eps)`` and of ``u + wd·p``."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    m_at = _at(m_ptrs, t, ALIGNED) + offs
    v = tl.load(_at(v_ptrs, t, ALIGNED) + offs, mask=inside, other=1.0)
    m = tl.load(m_at, mask=inside, other=0.0)
    m = tl.math.div_rn(m, tl.zeros_like(v) + tl.load(coeffs + t))
    if MASK_UNTRAINED:
        m = tl.where(v == 0, 0.0, m)
    tl.store(m_at, m, mask=inside)
    prev = tl.load(_at(prev_ptrs, t, ALIGNED) + offs, mask=inside, other=0.0)
    _measure(m, prev, v, inside, b, t, offs, _at(fresh_ptrs, t, ALIGNED) + offs, p_ptrs, part_drift,
             part_u, part_ud, neg_beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd,
             WD, ALIGNED)  # fmt: skip


@triton.jit(do_not_specialize=UNSPECIALIZED)
def onebit_measure_signs(block_tensor, block_start, block_end, block0, m_ptrs, fresh_ptrs,
                         v_ptrs, p_ptrs, mask_ptrs, positions, messages, scales, step, padded,
                         ranks, coeffs, part_drift, part_u, part_ud, neg_beta1, one_minus_beta1,
                         beta2, one_minus_beta2, eps, wd, MASK_UNTRAINED: tl.constexpr,
                         WD: tl.constexpr, ALIGNED: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    """:func:`onebit_measure` reading the averaged momentum from the 1-bit all-reduce's
    gathered messages instead of a buffer it was expanded into, and the old momentum from
    ``m`` itself (which it then overwrites). Element ``P = positions[t] + offs`` of the
    compressed buffer (``padded`` elements) is in bucket ``k = P // step``, cut into
    ``ranks`` chunks; byte ``(P_k % chunk) // 8`` of row ``P_k // chunk`` of that bucket's
    messages (at ``messages[k]``, rows ``chunk/8 + 4`` bytes apart) holds its sign, and
    ``scales[k, row]`` its size. No block may span two buckets (the table is cut at their
    boundaries), so the bucket is found once per block and the rest in int32.
    ``mask_ptrs[t]``, where not 0, is tensor ``t``'s momentum mask at the tensor's shape
    (multiplied in before unscaling, as the reference masks)."""
    b, t, offs, inside = _block(block_tensor, block_start, block_end, block0, ALIGNED, BLOCK)
    first = tl.load(positions + t) + tl.load(block_start + b)
    k = first // step
    chunk = (tl.minimum(step, padded - k * step) // ranks).to(tl.int32)
    local = (first - k * step).to(tl.int32) + tl.arange(0, BLOCK)
    row = local // chunk
    column = (local - row * chunk) >> 3
    base = tl.load(messages + k).to(tl.pointer_type(tl.uint8))
    byte = tl.load(base + row * ((chunk >> 3) + 4) + column, mask=inside, other=0)
    s = tl.load(scales + k * ranks + row, mask=inside, other=0.0)
    bit = (byte.to(tl.int32) >> (local & 7)) & 1  # buckets start at multiples of 8
    m = tl.where(bit != 0, s, -s)
    mask_at = tl.load(mask_ptrs + t)
    if mask_at != 0:
        m = m * tl.load(_at(mask_ptrs, t, ALIGNED) + offs, mask=inside, other=1.0)
    v = tl.load(_at(v_ptrs, t, ALIGNED) + offs, mask=inside, other=1.0)
    m = tl.math.div_rn(m, tl.zeros_like(v) + tl.load(coeffs + t))
    if MASK_UNTRAINED:
        m = tl.where(v == 0, 0.0, m)
    m_at = _at(m_ptrs, t, ALIGNED) + offs
    prev = tl.load(m_at, mask=inside, other=0.0)
    tl.store(m_at, m, mask=inside)
    _measure(m, prev, v, inside, b, t, offs, _at(fresh_ptrs, t, ALIGNED) + offs, p_ptrs, part_drift,
             part_u, part_ud, neg_beta1, one_minus_beta1, beta2, one_minus_beta2, eps, wd,
             WD, ALIGNED)  # fmt: skip
