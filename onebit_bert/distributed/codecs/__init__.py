"""Codecs: how a buffer is averaged over ranks, and at what precision it travels.

Every codec averages a list of tensors in place (:meth:`Codec.all_reduce`) through the
:class:`~onebit_bert.distributed.comm.Communicator`'s collectives, so the bytes it counts
are the bytes it sends (the messages' sizes, scales and padding included). The codecs are
the entries of :data:`CODECS` (the built-in ones at the end of this module; the guide's
codec table is :func:`codec_table`):

- :mod:`.base`: the :class:`Codec` interface, the registry, the plain fp32 codec;
- :mod:`.two_phase`: the all-to-all / fp32 sum / all-gather state machine every
  compressing codec runs (:class:`TwoPhaseRun`), and :class:`TwoPhaseCodec` for an element
  encoding;
- :mod:`.quantised`: bf16, fp16, int8 and int4;
- :mod:`.onebit`: the error-compensated 1-bit all-reduce of 1-bit LAMB
  (:func:`compressed_all_reduce`) and its codecs; :mod:`.compression` and :mod:`.packing`
  hold its state and arithmetic;
- :mod:`.powersgd`: PyTorch's PowerSGD hook as a codec.

**Two phases.** A compressing codec cuts the padded buffer into one chunk per rank; every
rank encodes its copy and sends chunk ``j`` to rank ``j`` (all-to-all); rank ``j`` decodes
the ``p`` copies of its chunk, sums them in fp32 in rank order, divides by ``p``, encodes the
average and sends it to everyone (all-gather); every rank decodes the same bytes, so the
result is identical on every rank. Each phase puts ``(p - 1) / p`` of the encoded buffer on
the wire, the two together what a ring all-reduce of the encoded buffer would, but no sum is
ever rounded to the wire format before all ``p`` terms are in.

**Error feedback** (int8, int4, onebit): what encoding left out on this rank is added to the
next call's input for the same buffer, on the worker and on the server side; the errors are
per-rank state (:meth:`Codec.state_dict`), keyed by the buffer's name, and restored on
resume.

Without a process group (a world of one) every codec is a no-op: there is nothing to
send. On a one-rank group the codecs run, as their collectives do.

Adding a codec: a module with a :class:`Codec` subclass and one :func:`register_codec`
call (docs/guide/development.md has the checklist).
"""

from __future__ import annotations

import math

import torch

from onebit_bert.distributed.codecs.base import (
    CODECS,
    GRAD_BUCKET_BYTES,
    Codec,
    CodecOptions,
    CodecSpec,
    PlainCodec,
    accepted_codecs,
    bits_per_element,
    bucketed,
    build_codec,
    codec_ddp_hook,
    codec_spec,
    codec_table,
    register_codec,
)
from onebit_bert.distributed.codecs.onebit import (
    OneBitCodec,
    compressed_all_reduce,
    compressed_all_reduce_many,
)
from onebit_bert.distributed.codecs.powersgd import PowerSGDCodec
from onebit_bert.distributed.codecs.quantised import (
    INT4_LEVELS,
    INT8_LEVELS,
    HalfCodec,
    Int4Codec,
    Int8Codec,
)
from onebit_bert.distributed.codecs.two_phase import (
    AsyncCodecAllReduce,
    TwoPhaseCodec,
    TwoPhaseRun,
)

__all__ = [
    "CODECS",
    "GRAD_BUCKET_BYTES",
    "INT4_LEVELS",
    "INT8_LEVELS",
    "AsyncCodecAllReduce",
    "Codec",
    "CodecOptions",
    "CodecSpec",
    "HalfCodec",
    "Int4Codec",
    "Int8Codec",
    "OneBitCodec",
    "PlainCodec",
    "PowerSGDCodec",
    "TwoPhaseCodec",
    "TwoPhaseRun",
    "accepted_codecs",
    "bits_per_element",
    "bucketed",
    "build_codec",
    "codec_ddp_hook",
    "codec_spec",
    "codec_table",
    "compressed_all_reduce",
    "compressed_all_reduce_many",
    "register_codec",
]

_ALL = ("grad", "momentum", "outer", "neighbour", "stats")
_GRAD_MOMENTUM = ("grad", "momentum")

for _spec in (
    CodecSpec("none", lambda comm, o: PlainCodec(comm), _ALL, 32, lossy=False, overlaps=False,
              summary="fp32, one ring all-reduce (bit for bit the uncompressed path)"),
    CodecSpec("bf16", lambda comm, o: HalfCodec(comm, torch.bfloat16),
              ("grad", "momentum", "outer", "neighbour"), 16, lossy=True, overlaps=False,
              summary="bf16 chunks in two phases, fp32 sums per chunk"),
    CodecSpec("fp16", lambda comm, o: HalfCodec(comm, torch.float16),
              ("grad", "momentum", "outer", "neighbour"), 16, lossy=True, overlaps=False,
              summary="as bf16 with fp16 (beyond +-65504: inf)"),
    CodecSpec("int8", lambda comm, o: Int8Codec(comm, o.int8_block),
              ("grad", "momentum", "outer"), lambda o: 8 + 32 / o.int8_block, lossy=True,
              overlaps=False,
              summary="int8 codes, one fp32 scale per `comm.int8_block` elements, error "
              "feedback on both sides, two phases"),
    CodecSpec("int4", lambda comm, o: Int4Codec(comm, o.int4_block), ("grad", "outer"),
              lambda o: 4 + 32 / o.int4_block, lossy=True, overlaps=False,
              summary="4-bit codes two per byte, one fp32 scale per `comm.int4_block` "
              "elements, error feedback on both sides, two phases"),
    CodecSpec("onebit", lambda comm, o: OneBitCodec(comm, o.bucket_numel), _GRAD_MOMENTUM, 1,
              lossy=True, overlaps=True,
              summary="signs with one fp32 scale per chunk, error feedback on both sides "
              "(the 1-bit all-reduce of 1-bit LAMB)"),
    CodecSpec("onebit_tensor", lambda comm, o: OneBitCodec(comm, o.bucket_numel, per_tensor=True),
              _GRAD_MOMENTUM, 1, lossy=True, overlaps=False,
              summary="as onebit with every tensor on its own scales, all in one exchange"),
    CodecSpec("powersgd",
              lambda comm, o: PowerSGDCodec(comm, o.powersgd_rank, o.powersgd_start_step),
              ("grad",), math.nan, lossy=True, overlaps=False,
              summary="rank-r factors of every gradient matrix (PyTorch's PowerSGD hook), "
              "small tensors in fp32"),
):  # fmt: skip
    register_codec(_spec)
