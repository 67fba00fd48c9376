"""Codecs that round each element: bf16 and fp16 (:class:`HalfCodec`), int8 and int4 with
one fp32 scale per block and error feedback (:class:`Int8Codec`, :class:`Int4Codec`), all
through the two-phase average (:mod:`~onebit_bert.distributed.codecs.two_phase`).

**Error feedback** (int8, int4): what encoding left out on this rank is added to the next
call's input for the same buffer (the worker error), and likewise on the server side for
the chunk this rank reduces; so nothing is lost over time, only delayed. The errors are
per-rank state (:meth:`~onebit_bert.distributed.codecs.base.Codec.state_dict`), keyed by
the buffer's name, and restored on resume.
"""

from __future__ import annotations

import torch

from onebit_bert.distributed.codecs.two_phase import TwoPhaseCodec

INT8_LEVELS = 127
"""int8 codes run over [-127, 127] (symmetric, so 0 is exact and -128 never appears)."""
INT4_LEVELS = 7
"""int4 codes run over [-7, 7], sent as the nibble code + 8 (0 never appears)."""


class HalfCodec(TwoPhaseCodec):
    """bf16 or fp16 on the wire (round to nearest even), fp32 sums; no error feedback
    (the rounding error is about 2^-9 (bf16) or 2^-12 (fp16) of each value). fp16 values
    beyond +-65504 become inf, which the loop's divergence guard reports."""

    def __init__(self, comm, dtype: torch.dtype):
        super().__init__(comm)
        self.dtype = dtype
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    def _row_bytes(self, chunk: int) -> int:
        return 2 * chunk

    def _encode(self, rows):
        half = rows.to(self.dtype)
        return half.view(torch.uint8).reshape(rows.shape[0], -1), half.float()

    def _decode(self, messages):
        return messages.view(self.dtype).float()


class Int8Codec(TwoPhaseCodec):
    """int8 codes with one fp32 scale (max |x| / 127) per block of ``block`` elements, and
    error feedback on both sides. A message row is the chunk's codes followed by its
    scales' bytes."""

    name = "int8"
    error_feedback = True

    def __init__(self, comm, block: int = 1024):
        if block < 1:
            raise ValueError(f"comm.int8_block must be >= 1, got {block}")
        super().__init__(comm)
        self.block = block
        self.quantum = block

    def _row_bytes(self, chunk: int) -> int:
        return chunk + 4 * (chunk // self.block)

    def _encode(self, rows):
        n_rows, chunk = rows.shape
        blocks = rows.view(n_rows, chunk // self.block, self.block)
        scale = blocks.abs().amax(dim=2, keepdim=True) / INT8_LEVELS
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(blocks / safe).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        decoded = codes.float() * scale
        message = torch.cat(
            [codes.view(n_rows, chunk).view(torch.uint8), scale.view(n_rows, -1).view(torch.uint8)],
            dim=1,
        )
        return message, decoded.view(n_rows, chunk)

    def _decode(self, messages):
        n_rows = messages.shape[0]
        chunk = messages.shape[1] * self.block // (self.block + 4)
        codes = messages[:, :chunk].contiguous().view(torch.int8)
        scale = messages[:, chunk:].contiguous().view(torch.float32)
        blocks = codes.view(n_rows, -1, self.block).float() * scale.unsqueeze(2)
        return blocks.view(n_rows, chunk)


class Int4Codec(Int8Codec):
    """4-bit codes in [-7, 7] with one fp32 scale (max |x| / 7) per block of ``block``
    elements (even), and error feedback on both sides. A message row is the chunk's codes,
    two per byte (element 2i in the low nibble, 2i + 1 in the high one, each as code + 8),
    followed by its scales' bytes. Streaming DiLoCo (arXiv 2501.18512) sends its outer
    gradients in a 4-bit float format; this codec is a uniform 4-bit grid instead, with
    error feedback carrying what rounding leaves out to the next round."""

    name = "int4"

    def __init__(self, comm, block: int = 128):
        if block < 2 or block % 2:
            raise ValueError(f"comm.int4_block must be an even number >= 2, got {block}")
        super().__init__(comm, block)

    def _row_bytes(self, chunk: int) -> int:
        return chunk // 2 + 4 * (chunk // self.block)

    def _encode(self, rows):
        n_rows, chunk = rows.shape
        blocks = rows.view(n_rows, chunk // self.block, self.block)
        scale = blocks.abs().amax(dim=2, keepdim=True) / INT4_LEVELS
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round(blocks / safe).clamp_(-INT4_LEVELS, INT4_LEVELS)
        decoded = codes * scale
        nibbles = (codes + 8).to(torch.uint8).view(n_rows, chunk // 2, 2)
        packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
        message = torch.cat([packed, scale.view(n_rows, -1).view(torch.uint8)], dim=1)
        return message, decoded.view(n_rows, chunk)

    def _decode(self, messages):
        n_rows = messages.shape[0]
        # a row is chunk / 2 code bytes and 4 bytes per block of `block` elements
        chunk = messages.shape[1] * 2 * self.block // (self.block + 8)
        packed = messages[:, : chunk // 2]
        low = (packed & 0x0F).to(torch.int16) - 8
        high = (packed >> 4).to(torch.int16) - 8
        codes = torch.stack([low, high], dim=2).view(n_rows, chunk).float()
        scale = messages[:, chunk // 2 :].contiguous().view(torch.float32)
        blocks = codes.view(n_rows, -1, self.block) * scale.unsqueeze(2)
        return blocks.view(n_rows, chunk)
