"""Sign bits packed eight to a byte, in pure torch (same code on CPU and CUDA).

Bit ``k`` of byte ``i`` holds the sign of element ``8*i + k``; 1 means ``x >= 0`` (so
sign(0) = +1), 0 means negative.
"""

from __future__ import annotations

import torch

# Multiplying eight 0/1 bytes, read as one little-endian int64, by this constant moves
# byte k's bit into bit 56+k without carries, so one multiply and one shift pack a byte.
_GATHER_BITS = 0x0102040810204080
_verified: dict[torch.device, bool] = {}


def _pack_by_multiply(nonneg: torch.Tensor) -> torch.Tensor:
    words = nonneg.view(torch.uint8).view(-1, 8).view(torch.int64).view(-1)
    return ((words * _GATHER_BITS) >> 56).bitwise_and_(0xFF).to(torch.uint8)


def _pack_by_shifts(nonneg: torch.Tensor) -> torch.Tensor:
    bits = nonneg.view(torch.uint8).view(-1, 8)
    out = bits[:, 0].clone()
    for k in range(1, 8):
        out.bitwise_or_(bits[:, k] << k)
    return out


_shift_tables: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """0..7 as uint8 on ``device`` (bit ``k`` of a byte is ``byte >> k & 1``), built once."""
    if device not in _shift_tables:
        _shift_tables[device] = torch.arange(8, dtype=torch.uint8, device=device)
    return _shift_tables[device]


def _multiply_is_exact(device: torch.device) -> bool:
    # The multiply relies on int64 products wrapping modulo 2**64, which every torch
    # backend does in practice; check once per device and fall back if one does not.
    if device not in _verified:
        probe = torch.rand(4096, generator=torch.Generator().manual_seed(0)) >= 0.5
        probe = probe.to(device)
        _verified[device] = torch.equal(_pack_by_multiply(probe), _pack_by_shifts(probe))
    return _verified[device]


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Pack the signs of a flat tensor whose length is a multiple of 8 into uint8 bytes."""
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(
            f"pack_signs needs a flat tensor whose length is a multiple of 8, "
            f"got shape {tuple(x.shape)}"
        )
    nonneg = (x >= 0).contiguous()
    if _multiply_is_exact(x.device):
        return _pack_by_multiply(nonneg)
    return _pack_by_shifts(nonneg)


def sign_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(256, 8) table: row ``b`` holds the eight ±1 signs that byte ``b`` encodes. Built on
    ``device`` itself: no copy from the host."""
    device = torch.device(device)
    bits = (torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(1) >> _shifts(device)) & 1
    return torch.where(bits.bool(), 1.0, -1.0).to(dtype)


_sign_tables: dict[torch.device, torch.Tensor] = {}


def cached_sign_table(device: torch.device | str) -> torch.Tensor:
    """:func:`sign_table` for ``device`` (fp32), built once."""
    device = torch.device(device)
    if device not in _sign_tables:
        _sign_tables[device] = sign_table(device)
    return _sign_tables[device]


def prepare(device: torch.device | str) -> None:
    """Do the 1-bit path's one-time set-up for buffers on ``device`` now, not in the first
    compressed step: the packer's check (it waits for the device once) and the sign table.
    Optimizers and codecs that compress call it when they are built."""
    _multiply_is_exact(torch.device(device))
    cached_sign_table(device)


def unpack_signs(
    packed: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    out: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack bytes into ``scale * (±1)`` values, 8 per byte.

    ``out`` (flat, contiguous, ``8 * len(packed)`` elements) receives the result in place.
    On the CPU each byte's row of a table is looked up (``table`` may be passed in to avoid
    rebuilding :func:`sign_table` on every call); on other devices the bits are shifted out
    and selected elementwise, since the lookup's gather kernel measured 25 ms per call for
    BERT-Large's momentum on an H200, far below the memory's speed. Both give exactly
    ``+scale`` or ``-scale``, the same bits.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("unpack_signs needs a flat uint8 tensor")
    if packed.device.type != "cpu":
        return _unpack_by_shifts(packed, scale, out)
    if table is None:
        table = sign_table(packed.device)
    scaled = table * scale
    index = packed.to(torch.int32)
    if out is None:
        return scaled.index_select(0, index).view(-1)
    torch.index_select(scaled, 0, index, out=out.view(-1, 8))
    return out


def _unpack_by_shifts(
    packed: torch.Tensor, scale: torch.Tensor | float, out: torch.Tensor | None
) -> torch.Tensor:
    positive = (packed.unsqueeze(1) >> _shifts(packed.device)).bitwise_and_(1).bool()
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), float(scale), device=packed.device)
    if out is None:
        return torch.where(positive, scale, -scale).view(-1)
    torch.where(positive, scale, -scale, out=out.view(-1, 8))
    return out


def settle(values: torch.Tensor, scale: torch.Tensor, real: int) -> None:
    """Stored ``values`` made the error they stand for, in place: ``v - s·sign(v)`` on the
    first ``real`` elements (``sign(v)`` +1 for ``v >= 0``; the reference's subtraction of
    ``±s``, so the same bits as :func:`~.compression.compress_in_place`'s error for the
    same ``v`` and ``s``), 0 after them: what the error-compensated compression left out
    when it kept its values and their scale (:class:`~.compression.ErrorFeedback`)."""
    head = values[:real]
    head.copy_(torch.where(head >= 0, head - scale, head + scale))
    values[real:].zero_()
