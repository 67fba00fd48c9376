"""Codecs: how a buffer is averaged over ranks, and at what precision it travels.

Every codec averages a list of tensors in place (:meth:`Codec.all_reduce`) through the
:class:`~onebit_bert.distributed.comm.Communicator`'s collectives, so the bytes it counts
are the bytes it sends (the messages' sizes, scales and padding included):

========  ======================================================================  ========
codec     what travels                                                             bits/el
========  ======================================================================  ========
none      fp32, one ring all-reduce (today's path, bit for bit)                    32
bf16      bf16 chunks, all-to-all; fp32 sums per chunk, bf16 all-gather           16
fp16      as bf16 with fp16                                                        16
int8      int8 with one fp32 scale per block of ``int8_block`` elements, error    8 + 32/B
          feedback on both sides, same two phases
int4      4-bit codes (two per byte) with one fp32 scale per block of             4 + 32/B
          ``int4_block`` elements, error feedback on both sides, same two phases
onebit    signs with one fp32 scale per chunk, error feedback on both sides (the  1 + ...
          1-bit all-reduce of 1-bit LAMB)
powersgd  rank-r factors P and Q of every matrix (PyTorch's PowerSGD DDP hook),    ~r(n+m)
          small tensors in fp32; error feedback and warm start as that hook
========  ======================================================================  ========

**Two phases.** bf16, fp16 and int8 use the pattern of the 1-bit all-reduce: the padded
buffer is cut into one chunk per rank; every rank encodes its copy and sends chunk ``j``
to rank ``j`` (all-to-all); rank ``j`` decodes the ``p`` copies of its chunk, sums them in
fp32 in rank order, divides by ``p``, encodes the average and sends it to everyone
(all-gather); every rank decodes the same bytes, so the result is identical on every
rank. Each phase puts ``(p - 1) / p`` of the encoded buffer on the wire, the two together
what a ring all-reduce of the encoded buffer would, but no sum is ever rounded to the
wire format before all ``p`` terms are in.

**Error feedback** (int8, int4, onebit): what encoding left out on this rank is added to the
next call's input for the same buffer (the worker error), and likewise on the server side
for the chunk this rank reduces; so nothing is lost over time, only delayed. The errors
are per-rank state (:meth:`Codec.state_dict`), keyed by the buffer's name, and restored
on resume.

Without a process group (a world of one) every codec is a no-op: there is nothing to
send. On a one-rank group the codecs run, as their collectives do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from onebit_bert.distributed.compression import ErrorFeedback, SignOps

CODECS = ("none", "bf16", "fp16", "int8", "int4", "onebit", "onebit_tensor", "powersgd")
"""Codec names, as the ``comm.compression`` config section spells them."""

INT8_LEVELS = 127
"""int8 codes run over [-127, 127] (symmetric, so 0 is exact and -128 never appears)."""
INT4_LEVELS = 7
"""int4 codes run over [-7, 7], sent as the nibble code + 8 (0 never appears)."""


class Codec:
    """Averages tensors over the ranks of a communicator at some precision.

    ``all_reduce(tensors, key)`` replaces every tensor by its mean over ranks; ``key``
    names the buffer (e.g. ``"grad/0"``): stateful codecs keep their errors per key, so
    the same key must mean the same tensors (same sizes, same order) on every call.
    """

    name = "none"
    lossy = False
    overlaps_fused = False
    """Whether a caller may run :meth:`all_reduce_fused`'s buckets itself, during the
    backward pass (:meth:`fused_feedback` gives their errors)."""
    per_tensor = False
    """Whether each tensor of an :meth:`all_reduce` is averaged on its own (a caller with
    one flat buffer passes it split into its tensors)."""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        """Average ``tensors`` over ranks, in place. ``last``: this buffer is the last one
        the caller averages in this step (PowerSGD counts steps by it)."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This rank's codec state (compression errors); empty when it has none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (from this rank of the same world size)."""

    def ddp_hook(self):
        """A ``DistributedDataParallel`` comm hook that averages each gradient bucket with
        this codec, counted as ``gradients``: synchronously during the backward pass
        (:func:`codec_ddp_hook`) unless the codec can leave its collective in flight."""
        return codec_ddp_hook(self)

    def average_async(self, tensor: torch.Tensor, key: str, kind: str, stats):
        """Start averaging ``tensor`` in place and return a handle with ``advance()`` (call
        it at the same point of every rank's step), ``wait()`` (the seconds blocked) and
        ``in_flight_seconds``; the bytes are filed in ``stats`` under ``kind``. Issue it on
        a codec whose communicator is a side channel, so that other collectives are not
        queued behind it."""
        raise NotImplementedError(f"the {self.name} codec has no asynchronous average")

    def all_reduce_fused(
        self, buffer: torch.Tensor, numel: int, key: str, sizes: Sequence[int] = ()
    ) -> torch.Tensor | None:
        """Average the first ``numel`` elements of the flat fp32 ``buffer`` in place (an
        optimizer's fused buffer, zero-padded after ``numel``; ``sizes``: its tensors'
        element counts, in order); return what compression left out on this rank relative
        to what it sent (None for codecs that do not measure it)."""
        self.all_reduce([buffer[:numel]], key)
        return None

    def reset(self) -> None:
        """Forget the carried compression errors (stateless codecs: nothing to do)."""

    def fused_feedback(self, key: str, numel: int):
        """The error feedback of a fused buffer, for a caller that runs the buckets of
        :meth:`all_reduce_fused` itself to overlap them with the backward pass; None: this
        codec cannot be overlapped that way."""
        return None

    # helpers shared by the flat codecs
    @staticmethod
    def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1).float() for t in tensors])

    @staticmethod
    def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class PlainCodec(Codec):
    """fp32, one ring all-reduce per buffer: exactly the communicator's
    :meth:`~onebit_bert.distributed.comm.Communicator.all_reduce_coalesced`."""

    name = "none"

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        if len(tensors) == 1 and tensors[0].is_contiguous():  # in place, no coalescing copy
            self.comm.all_reduce(tensors[0], op="avg")
        else:
            self.comm.all_reduce_coalesced(list(tensors), op="avg")

    def average_async(self, tensor: torch.Tensor, key: str, kind: str, stats):
        """One asynchronous all-reduce (:meth:`Communicator.all_reduce_async`), filed in the
        communicator's own stats (a side channel that shares them)."""
        if stats is not self.comm.stats:
            raise ValueError("the plain codec files its bytes in its communicator's stats")
        with self.comm.traffic(kind):
            return self.comm.all_reduce_async(tensor)

    def ddp_hook(self):
        """Each bucket's all-reduce left in flight while the backward pass goes on
        (:meth:`~onebit_bert.distributed.comm.Communicator.ddp_comm_hook`)."""
        return self.comm.ddp_comm_hook()


class TwoPhaseCodec(Codec):
    """The all-to-all / fp32 reduction / all-gather pattern (module docstring) for an
    element encoding that subclasses define: ``_encode(rows) -> (message bytes per row,
    decoded rows)`` and ``_decode(messages) -> rows``. ``quantum`` is the element count
    every chunk is a multiple of; ``error_feedback`` keeps worker and server errors."""

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
        p = self.comm.world_size
        if self.comm.alone or not tensors:
            return None
        flat = self._flatten(tensors)
        numel = flat.numel()
        x = torch.zeros(self.padded(numel), dtype=torch.float32, device=flat.device)
        x[:numel] = flat
        worker_error = server_error = None
        if self.error_feedback:
            worker_error, server_error = self._errors(key, x)
            x.add_(worker_error)
        rows = x.view(p, -1)
        outgoing, decoded = self._encode(rows)
        if worker_error is not None:
            torch.sub(x, decoded.view(-1), out=worker_error)
        incoming = torch.empty_like(outgoing)
        pending = self.comm.all_to_all_async(incoming, outgoing)
        return TwoPhaseRun(self, list(tensors), numel, server_error, outgoing, incoming, pending)

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


class TwoPhaseRun:
    """One :meth:`TwoPhaseCodec.all_reduce` in flight, every collective issued from the
    caller's thread: :meth:`TwoPhaseCodec.start` issued the all-to-all; :meth:`exchange`
    (once that is done) reduces this rank's chunk and issues the all-gather; :meth:`finish`
    waits for it and writes the averages into the tensors."""

    def __init__(self, codec, tensors, numel, server_error, outgoing, incoming, pending):
        self.codec = codec
        self.tensors = tensors
        self.numel = numel
        self.server_error = server_error
        self.outgoing, self.incoming = outgoing, incoming  # alive until the collective ends
        self.pending = pending
        self.stage = "exchanging"

    def exchange(self, block: bool = False) -> bool:
        """Average this rank's chunk (the p copies summed in fp32, in rank order), encode
        it and issue the all-gather; False (nothing done) while the all-to-all is in flight
        and not ``block``."""
        if self.stage != "exchanging":
            raise RuntimeError(f"exchange() on a run in stage {self.stage}")
        if not block and not self.pending.ready():
            return False
        self.pending.wait()
        codec, p = self.codec, self.codec.comm.world_size
        mine = codec._decode(self.incoming).sum(dim=0, keepdim=True).div_(p)
        if self.server_error is not None:
            mine.add_(self.server_error.view(1, -1))
        self.reply, decoded_mine = codec._encode(mine)
        if self.server_error is not None:
            torch.sub(mine.view(-1), decoded_mine.view(-1), out=self.server_error)
        self.gathered = torch.empty(
            p, self.reply.shape[1], dtype=torch.uint8, device=self.incoming.device
        )
        self.pending = codec.comm.all_gather_async(self.gathered, self.reply.view(-1))
        self.stage = "gathering"
        return True

    def finish(self) -> None:
        if self.stage != "gathering":
            raise RuntimeError(f"finish() on a run in stage {self.stage}")
        self.pending.wait()
        result = self.codec._decode(self.gathered).reshape(-1)[: self.numel]
        self.codec._unflatten(result, self.tensors)
        self.stage = "done"


class HalfCodec(TwoPhaseCodec):
    """bf16 or fp16 on the wire (round to nearest even), fp32 sums; no error feedback
    (the rounding error is about 2^-9 (bf16) or 2^-12 (fp16) of each value). fp16 values
    beyond +-65504 become inf, which the loop's divergence guard reports."""

    def __init__(self, comm, dtype: torch.dtype):
        super().__init__(comm)
        self.dtype = dtype
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]

    lossy = True

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
    lossy = True
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


class OneBitCodec(Codec):
    """Signs with error feedback: the communicator's 1-bit all-reduce
    (:meth:`~onebit_bert.distributed.comm.Communicator.compressed_all_reduce`) on a
    zero-padded copy, one :class:`~onebit_bert.distributed.compression.ErrorFeedback` per
    buffer name.

    ``per_tensor`` (codec ``onebit_tensor``): every tensor is compressed on its own, with
    scales of its own and errors under ``<key>/<i>``, as DeepSpeed's 1-bit optimizers
    compress each tensor, but all tensors travel in one all-to-all and one all-gather
    (DeepSpeed issues both per tensor); otherwise the tensors are concatenated and share
    each chunk's scale (a layer of small values next to one of large values is then
    rounded to the large one's scale).

    ``sign_ops``: the per-bucket implementation (default: the communicator's,
    :attr:`~onebit_bert.distributed.comm.Communicator.sign_ops`)."""

    name = "onebit"
    lossy = True
    overlaps_fused = True

    def __init__(
        self,
        comm,
        bucket_numel: int | None = None,
        per_tensor: bool = False,
        sign_ops: SignOps | None = None,
    ):
        super().__init__(comm)
        comm.prepare_packing()
        self.sign_ops = sign_ops if sign_ops is not None else comm.sign_ops
        self.bucket_numel = bucket_numel
        self.feedback: dict[str, ErrorFeedback] = {}
        self.per_tensor = per_tensor
        if per_tensor:
            self.name = "onebit_tensor"
            self.overlaps_fused = False

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        if self.comm.alone or not tensors:
            return
        if self.per_tensor and len(tensors) > 1:
            # each tensor its own scales and errors, all of them in one pair of collectives
            padded = [self._padded([t], f"{key}/{i}") for i, t in enumerate(tensors)]
            self.comm.compressed_all_reduce_many(
                [(buffer, fb) for buffer, fb, _ in padded], self.sign_ops
            )
            for tensor, (buffer, _, numel) in zip(tensors, padded, strict=True):
                self._unflatten(buffer[:numel], [tensor])
            return
        buffer, feedback, numel = self._padded(tensors, key)
        self.comm.compressed_all_reduce(buffer, feedback, self.sign_ops)
        self._unflatten(buffer[:numel], tensors)

    def _padded(
        self, tensors: Sequence[torch.Tensor], key: str
    ) -> tuple[torch.Tensor, ErrorFeedback, int]:
        """``tensors`` flattened into a zero-padded fp32 buffer, the error feedback of
        ``key`` (created at zero for a new key or size) and the real element count."""
        flat = self._flatten(tensors)
        feedback = self.feedback.get(key)
        if feedback is None or feedback.numel != flat.numel():
            feedback = self.feedback[key] = ErrorFeedback(
                flat.numel(),
                self.comm.world_size,
                rank=self.comm.rank,
                device=flat.device,
                bucket_numel=self.bucket_numel,
            )
        buffer = torch.zeros(feedback.padded_numel, dtype=torch.float32, device=flat.device)
        buffer[: flat.numel()] = flat
        return buffer, feedback, flat.numel()

    def fused_feedback(self, key: str, numel: int) -> ErrorFeedback:
        """The error feedback of fused buffer ``key`` of ``numel`` elements (created at
        zero); refused when the saved one covers another size."""
        feedback = self.feedback.get(key)
        if feedback is None:
            feedback = self.feedback[key] = ErrorFeedback(
                numel,
                self.comm.world_size,
                rank=self.comm.rank,
                device=self.comm.device,
                bucket_numel=self.bucket_numel,
            )
        elif feedback.numel != numel:
            raise ValueError(
                f"saved compression errors cover {feedback.numel} elements but the fused "
                f"buffer has {numel}: the optimizer state belongs to a different model"
            )
        return feedback

    def all_reduce_fused(
        self, buffer: torch.Tensor, numel: int, key: str, sizes: Sequence[int] = ()
    ) -> torch.Tensor | None:
        """In place on the padded buffer, also with one rank (whose errors still carry
        what 1-bit rounding left out); per tensor: each of ``sizes`` on its own (no error
        figure)."""
        if self.per_tensor and sizes:
            self.all_reduce(list(torch.split(buffer[:numel], list(sizes))), key)
            return None
        feedback = self.fused_feedback(key, numel)
        if buffer.numel() != feedback.padded_numel:
            padded = torch.zeros(feedback.padded_numel, dtype=torch.float32, device=buffer.device)
            padded[:numel] = buffer[:numel]
            error = self.all_reduce_fused(padded, numel, key)
            buffer[:numel] = padded[:numel]
            return error
        measure = getattr(self.sign_ops, "measure", None)
        if measure is not None:  # the fused kernels sum both norms' squares as they go
            with measure(buffer.device) as measured:
                self.comm.compressed_all_reduce(buffer, feedback, self.sign_ops)
            return measured.relative_error()
        norm = torch.linalg.vector_norm(buffer)
        self.comm.compressed_all_reduce(buffer, feedback, self.sign_ops)
        return torch.linalg.vector_norm(feedback.worker_error) / norm.clamp_min(1e-30)

    def reset(self) -> None:
        for feedback in self.feedback.values():
            feedback.reset()

    def state_dict(self) -> dict:
        return {k: f.state_dict() for k, f in self.feedback.items()}

    def load_state_dict(self, state: dict) -> None:
        self.feedback = {}
        for key, saved in state.items():
            fb = ErrorFeedback(
                saved["numel"],
                self.comm.world_size,
                rank=self.comm.rank,
                device=self.comm.device,
                bucket_numel=self.bucket_numel,
            )
            fb.load_state_dict(saved)
            self.feedback[key] = fb


class _Bucket:
    """What PyTorch's PowerSGD hook reads from a DDP ``GradBucket``, for a list of
    gradient tensors outside DDP: a flat buffer and per-tensor views of it."""

    def __init__(self, index: int, tensors: Sequence[torch.Tensor], is_last: bool):
        self._index = index
        self._is_last = is_last
        self._buffer = torch.cat([t.reshape(-1) for t in tensors])
        self._grads = []
        offset = 0
        for t in tensors:
            self._grads.append(self._buffer[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)


class PowerSGDCodec(Codec):
    """PowerSGD (Vogels et al., 2019) by PyTorch's own DDP hook
    (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``): every gradient
    matrix worth it (``_should_compress``: compressed size x ``min_compression_rate`` <
    its size) travels as rank-``rank`` factors, the rest in fp32; error feedback and warm
    start on. The hook all-reduces through ``torch.distributed`` itself, so its bytes are
    counted here from the same decision the hook makes (the hook's own ``_should_compress``
    on each tensor): 2 (p - 1) / p x 4 bytes x (uncompressed elements + P + Q elements),
    and the whole buffer before ``start_step``. Gradients only: it needs each tensor's
    shape, and is a biased compressor meant for gradients."""

    name = "powersgd"
    lossy = True

    def __init__(self, comm, rank: int = 4, start_step: int = 10, min_compression_rate=2.0):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

        super().__init__(comm)
        if rank < 1:
            raise ValueError(f"comm.powersgd_rank must be >= 1, got {rank}")
        if comm.device.type == "cpu" and torch.cuda.is_available():
            # torch's hook synchronises CUDA on the tensors' device whenever CUDA exists
            raise RuntimeError(
                "comm.compression.grad=powersgd on CPU tensors fails inside PyTorch's "
                "PowerSGD hook on a machine with CUDA: train on the GPU, or hide it with "
                "CUDA_VISIBLE_DEVICES="
            )
        if start_step < 2:
            raise ValueError(
                f"comm.powersgd_start_step must be >= 2 (the hook's error feedback and warm "
                f"start need a full-precision first step), got {start_step}"
            )
        self.hook = hook
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.state = (
            hook.PowerSGDState(
                process_group=comm.group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=start_step,
                min_compression_rate=min_compression_rate,
                use_error_feedback=True,
                warm_start=True,
                random_seed=0,
            )
            if not comm.alone
            else None
        )
        self._buckets: dict[str, int] = {}

    def _wire_elements(self, tensors: Sequence[torch.Tensor]) -> int:
        if self.state.iter < self.state.start_powerSGD_iter:
            return sum(t.numel() for t in tensors)
        total = 0
        for t in tensors:
            n = t.shape[0] if t.dim() else 1
            m = t.numel() // max(n, 1)
            r = min(n, m, self.rank)
            compress, plain, packed = self.hook._should_compress(n, m, r, self.min_compression_rate)
            total += packed if compress else plain
        return total

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        if self.comm.alone or not tensors:
            return
        index = self._buckets.setdefault(key, len(self._buckets))
        bucket = _Bucket(index, tensors, last)
        result = self.run_hook(bucket)
        self._unflatten(result, tensors)

    def run_hook(self, bucket) -> torch.Tensor:
        """PyTorch's hook on one bucket (a DDP ``GradBucket`` or :class:`_Bucket`), waited,
        with its bytes counted; returns the averaged flat buffer."""
        p = self.comm.world_size
        nbytes = 2 * (p - 1) * 4 * self._wire_elements(bucket.gradients()) // p
        with self.comm.external(nbytes):
            result = self.hook.powerSGD_hook(self.state, bucket).wait()
        return result[0] if isinstance(result, list) else result

    def state_dict(self) -> dict:
        if self.state is None:
            return {}
        st = self.state
        kind, keys, pos, has_gauss, cached = st.rng.get_state()
        return {
            "iter": st.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            "error": {int(k): v.clone() for k, v in st.error_dict.items()},
            "p": {int(k): v.clone() for k, v in st.p_memory_dict.items()},
            "q": {int(k): v.clone() for k, v in st.q_memory_dict.items()},
            "buckets": dict(self._buckets),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.state is None or not state:
            return
        st = self.state
        st.iter = int(state["iter"])
        rng = state["rng"]
        st.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["cached"],
            )
        )
        device = self.comm.device
        st.error_dict = {k: v.to(device) for k, v in state["error"].items()}
        st.p_memory_dict = {k: v.to(device) for k, v in state["p"].items()}
        st.q_memory_dict = {k: v.to(device) for k, v in state["q"].items()}
        self._buckets = dict(state["buckets"])


GRAD_BUCKET_BYTES = 64 << 20
"""Gradients are averaged in buffers of at most this many bytes (as
:meth:`~onebit_bert.distributed.comm.Communicator.all_reduce_coalesced`)."""


def bucketed(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``bucket_bytes`` each (a tensor larger
    than that is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(t)
            size += nbytes
        else:
            buckets.append([t])
            size = nbytes
    return buckets


def codec_ddp_hook(codec: Codec):
    """A ``DistributedDataParallel`` comm hook that averages each gradient bucket with
    ``codec`` (synchronously, during the backward pass; PowerSGD gets DDP's own bucket),
    counted as ``gradients``."""

    def hook(_state, bucket):
        buffer = bucket.buffer()
        with codec.comm.traffic("gradients"):
            if isinstance(codec, PowerSGDCodec):
                buffer.copy_(codec.run_hook(bucket))
            elif codec.per_tensor:
                sizes = [g.numel() for g in bucket.gradients()]
                codec.all_reduce(list(torch.split(buffer, sizes)), f"grad/{bucket.index()}")
            else:
                codec.all_reduce([buffer], f"grad/{bucket.index()}", last=bucket.is_last())
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


def build_codec(
    name: str,
    comm,
    *,
    int8_block: int = 1024,
    int4_block: int = 128,
    powersgd_rank: int = 4,
    powersgd_start_step: int = 10,
    bucket_numel: int | None = None,
) -> Codec:
    """The codec called ``name`` over ``comm``."""
    if name == "none":
        return PlainCodec(comm)
    if name == "bf16":
        return HalfCodec(comm, torch.bfloat16)
    if name == "fp16":
        return HalfCodec(comm, torch.float16)
    if name == "int8":
        return Int8Codec(comm, int8_block)
    if name == "int4":
        return Int4Codec(comm, int4_block)
    if name == "onebit":
        return OneBitCodec(comm, bucket_numel)
    if name == "onebit_tensor":
        return OneBitCodec(comm, bucket_numel, per_tensor=True)
    if name == "powersgd":
        return PowerSGDCodec(comm, powersgd_rank, powersgd_start_step)
    raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")


def bits_per_element(name: str, int8_block: int = 1024, int4_block: int = 128) -> float:
    """Nominal wire bits per element of a codec, before padding and per-chunk scales
    (powersgd: data dependent, NaN)."""
    return {
        "none": 32.0,
        "bf16": 16.0,
        "fp16": 16.0,
        "int8": 8.0 + 32.0 / int8_block,
        "int4": 4.0 + 32.0 / int4_block,
        "onebit": 1.0,
        "onebit_tensor": 1.0,
    }.get(name, math.nan)


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
