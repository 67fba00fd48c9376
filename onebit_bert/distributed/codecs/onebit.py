"""The error-compensated 1-bit all-reduce of 1-bit LAMB, and the codecs built on it.

:func:`compressed_all_reduce` averages a zero-padded flat fp32 buffer bucket by bucket
(the layout and the errors it carries between calls: :mod:`.compression`). Per bucket,
a :class:`TwoPhaseRun` of :class:`OneBitBucket`'s steps: worker compression, one
all-to-all carrying each chunk's signs with this rank's scale, the server step on this
rank's chunk, one all-gather carrying the server signs with their scale, then expansion.
The result is identical on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from onebit_bert.distributed.codecs.base import Codec
from onebit_bert.distributed.codecs.compression import (
    SCALE_BYTES,
    ErrorFeedback,
    SignOps,
    sign_ops,
)
from onebit_bert.distributed.codecs.packing import cached_sign_table, prepare
from onebit_bert.distributed.codecs.two_phase import Batched, TwoPhaseRun
from onebit_bert.kernels.multi_tensor import to_device


class OneBitBucket:
    """The :class:`~onebit_bert.distributed.codecs.two_phase.TwoPhaseSteps` of bucket
    ``index`` of ``feedback``'s plan, in place on ``buffer``; ``ops``: the per-bucket
    implementation (default: :func:`~.compression.sign_ops` for the communicator's
    device). ``squares``: where the caller wrote the worker's values itself (ops that
    :attr:`~onebit_bert.kernels.signs.FusedSignOps.takes_squares`), their sums of squares
    and of sizes over the bucket's real elements."""

    def __init__(
        self,
        comm,
        buffer: torch.Tensor,
        feedback: ErrorFeedback,
        index: int,
        ops: SignOps | None = None,
        squares: torch.Tensor | None = None,
        keep: bool = False,
    ):
        bucket = feedback.buckets[index]
        p = comm.world_size
        self.rows = p
        self.ops = ops if ops is not None else sign_ops(comm.device)
        self.feedback = feedback
        # ops that keep values take them with their scales pending; the others, errors
        self.keeps_values = getattr(self.ops, "keeps_values", False)
        if self.keeps_values:
            worker, server = feedback.worker_values, feedback.server_values
            self.pending = (
                feedback.worker_scale[index : index + 1],
                feedback.server_scale[index : index + 1],
            )
        else:
            worker, server = feedback.worker_error, feedback.server_error
        self.x = buffer[bucket.start : bucket.start + bucket.size]
        self.worker_error = worker[bucket.start : bucket.start + bucket.size]
        self.server_error = server[bucket.start // p : (bucket.start + bucket.size) // p]
        self.real = bucket.real
        self.my_real = bucket.chunk_real(comm.rank, p)
        self.table = cached_sign_table(buffer.device)
        self.squares = squares
        self.keep = keep
        self.gathered: torch.Tensor | None = None

    def compress(self) -> torch.Tensor:
        """Worker: the local slice as ``(p, chunk/8 + 4)`` bytes, row j (chunk j's signs
        and this rank's scale) addressed to rank j."""
        if not self.keeps_values:
            return self.ops.compress(self.x, self.worker_error, self.real, self.table, self.rows)
        self.feedback.pending = True
        return self.ops.compress(
            self.x,
            self.worker_error,
            self.real,
            self.table,
            self.rows,
            self.squares,
            pending=self.pending[0],
        )

    def serve(self, incoming: torch.Tensor) -> torch.Tensor:
        """Server: this rank's chunk averaged over the rows of ``incoming`` and compressed
        again into one message (signs and scale)."""
        if not self.keeps_values:
            return self.ops.serve(incoming, self.server_error, self.my_real, self.table)
        self.feedback.pending = True
        return self.ops.serve(
            incoming, self.server_error, self.my_real, self.table, pending=self.pending[1]
        )

    def expand(self, gathered: torch.Tensor) -> None:
        """Everyone: every server's message (row i of ``gathered``) expanded into its chunk
        of the slice; the padding is zeroed again. With ``keep``, the messages are kept in
        :attr:`gathered` instead and the slice is left as it was."""
        if self.keep:
            self.gathered = gathered
            return
        self.ops.expand(gathered, self.x, self.real, self.table)


def check_compressed(comm, buffer: torch.Tensor, feedback: ErrorFeedback) -> None:
    """Refuse a buffer or errors that do not fit ``comm``'s 1-bit average."""
    p = comm.world_size
    if feedback.world_size != p:
        raise ValueError(
            f"compression errors were built for world size {feedback.world_size} but this "
            f"communicator has {p} ranks; build the ErrorFeedback with world_size={p}"
        )
    if buffer.dim() != 1 or buffer.numel() != feedback.padded_numel:
        raise ValueError(
            f"compressed_all_reduce needs a flat buffer of {feedback.padded_numel} elements "
            f"(padded), got shape {tuple(buffer.shape)}"
        )
    if buffer.dtype != torch.float32:
        raise ValueError(f"compressed_all_reduce needs fp32, got {buffer.dtype}")


def compressed_all_reduce(
    comm, buffer: torch.Tensor, feedback: ErrorFeedback, ops: SignOps | None = None
) -> torch.Tensor:
    """Average ``buffer`` over the ranks of ``comm`` with error-compensated 1-bit
    compression, in place (module docstring), one bucket after another.

    ``buffer`` is flat fp32 of ``feedback.padded_numel`` elements; its padding tail must
    be zero and stays zero. ``ops``: the per-bucket implementation.
    """
    check_compressed(comm, buffer, feedback)
    for index in range(len(feedback.buckets)):
        TwoPhaseRun(comm, OneBitBucket(comm, buffer, feedback, index, ops)).run()
    return buffer


def compressed_all_reduce_many(
    comm, pairs: Sequence[tuple[torch.Tensor, ErrorFeedback]], ops: SignOps | None = None
) -> None:
    """:func:`compressed_all_reduce` on every ``(buffer, feedback)`` pair, each with its own
    scales and errors, in one all-to-all and one all-gather for all of them: the same
    numbers and bytes as one call per pair, in two collectives instead of two per bucket
    (DeepSpeed's per-tensor compression, without a round trip per tensor)."""
    for buffer, feedback in pairs:
        check_compressed(comm, buffer, feedback)
    parts = [
        OneBitBucket(comm, buffer, feedback, index, ops)
        for buffer, feedback in pairs
        for index in range(len(feedback.buckets))
    ]
    if parts:
        TwoPhaseRun(comm, Batched(parts)).run()


class GatheredSigns:
    """A 1-bit average left unexpanded (:meth:`OneBitCodec.average_signs`): every
    bucket's gathered server messages, as a kernel reads them. Element ``P`` of the
    buffer is in bucket ``P // step`` (``padded`` elements in all; each bucket cut into
    ``ranks`` chunks, the last bucket possibly shorter); ``addresses[k]``: where bucket
    ``k``'s messages start (``ranks`` rows of ``chunk/8 + 4`` bytes: signs, then the
    server's fp32 scale); ``scales[k, i]``: server ``i``'s scale in bucket ``k``."""

    def __init__(self, feedback: ErrorFeedback, gathered: Sequence[torch.Tensor]):
        self.messages = [g.contiguous() for g in gathered]  # alive as long as this is
        self.step = feedback.buckets[0].size
        self.padded = feedback.padded_numel
        self.ranks = feedback.world_size
        device = self.messages[0].device
        self.addresses = to_device([m.data_ptr() for m in self.messages], device)
        tails = torch.empty(
            len(self.messages), self.ranks, SCALE_BYTES, dtype=torch.uint8, device=device
        )
        for k, m in enumerate(self.messages):
            tails[k].copy_(m[:, -SCALE_BYTES:])
        self.scales = tails.view(torch.float32).view(len(self.messages), self.ranks)


def average_signs(
    comm,
    buffer: torch.Tensor,
    feedback: ErrorFeedback,
    ops: SignOps,
    squares: torch.Tensor,
) -> GatheredSigns:
    """:func:`compressed_all_reduce` without the expansion: ``buffer`` is compressed (its
    errors updated, the buffer itself left as it was) and the servers' messages come back
    for the caller to read. ``squares[:, k]``: where the caller wrote bucket ``k``'s
    values ``x + worker error`` over the worker's stored values, the sums of their squares
    and of their sizes over its real elements, which ``ops`` (one that ``takes_squares``)
    uses instead of a pass of its own."""
    check_compressed(comm, buffer, feedback)
    parts = [
        OneBitBucket(comm, buffer, feedback, index, ops, squares[:, index], keep=True)
        for index in range(len(feedback.buckets))
    ]
    for part in parts:
        TwoPhaseRun(comm, part).run()
    return GatheredSigns(feedback, [part.gathered for part in parts])


class FusedOneBitBuckets:
    """The buckets of a fused buffer's 1-bit average, for a caller that runs them itself
    (:meth:`~onebit_bert.distributed.codecs.base.Codec.fused_buckets`)."""

    def __init__(
        self, comm, buffer: torch.Tensor, feedback: ErrorFeedback, ops, keep: bool = False
    ):
        check_compressed(comm, buffer, feedback)
        self.comm = comm
        self.buffer = buffer
        self.feedback = feedback
        self.ops = ops
        self.keep = keep
        self.buckets = feedback.buckets
        self._parts: dict[int, OneBitBucket] = {}
        self.measures = hasattr(ops, "measure")
        """Whether :meth:`relative_error` comes from sums the kernels made as they
        compressed (else the caller measures the norms itself)."""
        self._input_sq = self._error_sq = None

    def start(self, index: int, squares: tuple | None = None) -> TwoPhaseRun:
        """Compress bucket ``index`` and issue its all-to-all. ``squares``: where the
        caller wrote the bucket's values ``x + worker error`` as it folded (ops that
        ``takes_squares``; no pass of their own), the sums of ``x²``, of the values'
        squares and of their sizes over the bucket's real elements."""
        takes = self.measures and getattr(self.ops, "takes_squares", False)
        if squares is not None and not takes:
            raise ValueError(f"the {self.ops.name} sign ops cannot take a bucket's squares")
        bucket = OneBitBucket(
            self.comm,
            self.buffer,
            self.feedback,
            index,
            self.ops,
            squares=None if squares is None else squares[1:],
            keep=self.keep,
        )
        self._parts[index] = bucket
        if not self.measures:
            return TwoPhaseRun(self.comm, bucket).start()
        with self.ops.measure(self.buffer.device) as measured:
            run = TwoPhaseRun(self.comm, bucket).start()
        if squares is not None:  # the kernel left the inputs' squares to the caller
            measured.input_sq += squares[0]
        if self._input_sq is None:
            self._input_sq, self._error_sq = measured.input_sq, measured.error_sq
        else:
            self._input_sq = self._input_sq + measured.input_sq
            self._error_sq = self._error_sq + measured.error_sq
        return run

    def relative_error(self) -> torch.Tensor:
        """With :attr:`measures`, once every bucket started: ‖this rank's worker errors‖ /
        ‖the buffer it compressed‖, from the kernels' sums (no pass over either)."""
        if not self.measures or self._input_sq is None:
            raise RuntimeError("relative_error() needs measuring kernels and a started bucket")
        return self._error_sq.sqrt() / self._input_sq.sqrt().clamp_min(1e-30)

    def signs(self) -> GatheredSigns:
        """With ``keep``, once every bucket is finished: the servers' messages, left
        unexpanded (the buffer keeps what was compressed)."""
        if not self.keep or len(self._parts) != len(self.buckets):
            raise RuntimeError("signs() needs keep=True and every bucket finished")
        parts = [self._parts[k] for k in range(len(self.buckets))]
        if any(part.gathered is None for part in parts):
            raise RuntimeError("signs() before every bucket finished")
        return GatheredSigns(self.feedback, [part.gathered for part in parts])

    def error_norm(self) -> torch.Tensor:
        """The norm of this rank's worker errors over the whole buffer."""
        return torch.linalg.vector_norm(self.feedback.worker_error)


class OneBitCodec(Codec):
    """Signs with error feedback: :func:`compressed_all_reduce` on a zero-padded copy, one
    :class:`~.compression.ErrorFeedback` per buffer name.

    ``per_tensor`` (codec ``onebit_tensor``): every tensor is compressed on its own, with
    scales of its own and errors under ``<key>/<i>``, as DeepSpeed's 1-bit optimizers
    compress each tensor, but all tensors travel in one all-to-all and one all-gather
    (DeepSpeed issues both per tensor); otherwise the tensors are concatenated and share
    each chunk's scale (a layer of small values next to one of large values is then
    rounded to the large one's scale).

    ``sign_ops``: the per-bucket implementation (default: :func:`~.compression.sign_ops`
    for the communicator's device)."""

    name = "onebit"

    def __init__(
        self,
        comm,
        bucket_numel: int | None = None,
        per_tensor: bool = False,
        sign_ops: SignOps | None = None,
    ):
        super().__init__(comm)
        prepare(comm.device)
        self.sign_ops = sign_ops if sign_ops is not None else _default_ops(comm)
        self.bucket_numel = bucket_numel
        self.feedback: dict[str, ErrorFeedback] = {}
        self.per_tensor = per_tensor
        if per_tensor:
            self.name = "onebit_tensor"

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        if self.comm.alone or not tensors:
            return
        if self.per_tensor and len(tensors) > 1:
            # each tensor its own scales and errors, all of them in one pair of collectives
            padded = [self._padded([t], f"{key}/{i}") for i, t in enumerate(tensors)]
            compressed_all_reduce_many(
                self.comm, [(buffer, fb) for buffer, fb, _ in padded], self.sign_ops
            )
            for tensor, (buffer, _, numel) in zip(tensors, padded, strict=True):
                self._unflatten(buffer[:numel], [tensor])
            return
        buffer, feedback, numel = self._padded(tensors, key)
        compressed_all_reduce(self.comm, buffer, feedback, self.sign_ops)
        self._unflatten(buffer[:numel], tensors)

    def _new_feedback(self, numel: int, device) -> ErrorFeedback:
        return ErrorFeedback(
            numel,
            self.comm.world_size,
            rank=self.comm.rank,
            device=device,
            bucket_numel=self.bucket_numel,
        )

    def _padded(
        self, tensors: Sequence[torch.Tensor], key: str
    ) -> tuple[torch.Tensor, ErrorFeedback, int]:
        """``tensors`` flattened into a zero-padded fp32 buffer, the error feedback of
        ``key`` (created at zero for a new key or size) and the real element count."""
        flat = self._flatten(tensors)
        feedback = self.feedback.get(key)
        if feedback is None or feedback.numel != flat.numel():
            feedback = self.feedback[key] = self._new_feedback(flat.numel(), flat.device)
        buffer = torch.zeros(feedback.padded_numel, dtype=torch.float32, device=flat.device)
        buffer[: flat.numel()] = flat
        return buffer, feedback, flat.numel()

    def fused_feedback(self, key: str, numel: int) -> ErrorFeedback:
        """The error feedback of fused buffer ``key`` of ``numel`` elements (created at
        zero); refused when the saved one covers another size."""
        feedback = self.feedback.get(key)
        if feedback is None:
            feedback = self.feedback[key] = self._new_feedback(numel, self.comm.device)
        elif feedback.numel != numel:
            raise ValueError(
                f"saved compression errors cover {feedback.numel} elements but the fused "
                f"buffer has {numel}: the optimizer state belongs to a different model"
            )
        return feedback

    def fused_buckets(self, buffer: torch.Tensor, key: str, numel: int, comm, keep=False):
        """The buckets of :meth:`all_reduce_fused` on the padded ``buffer``, issued on
        ``comm`` (:class:`FusedOneBitBuckets`); ``keep``: leave the average unexpanded
        for the caller to read (:meth:`FusedOneBitBuckets.signs`, where
        :attr:`expands_later`)."""
        if self.per_tensor:
            return super().fused_buckets(buffer, key, numel, comm)
        feedback = self.fused_feedback(key, numel)
        return FusedOneBitBuckets(comm, buffer, feedback, self.sign_ops, keep)

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
                compressed_all_reduce(self.comm, buffer, feedback, self.sign_ops)
            return measured.relative_error()
        norm = torch.linalg.vector_norm(buffer)
        compressed_all_reduce(self.comm, buffer, feedback, self.sign_ops)
        return torch.linalg.vector_norm(feedback.worker_error) / norm.clamp_min(1e-30)

    @property
    def expands_later(self) -> bool:
        """Whether :meth:`average_signs` applies: one scale per bucket of the fused buffer
        and per-bucket work that takes its sums of squares from the caller."""
        return not self.per_tensor and getattr(self.sign_ops, "takes_squares", False)

    def average_signs(
        self,
        buffer: torch.Tensor,
        numel: int,
        key: str,
        squares: torch.Tensor,
        input_squares: torch.Tensor,
    ) -> tuple[GatheredSigns, torch.Tensor]:
        """:meth:`all_reduce_fused`'s 1-bit average of the padded ``buffer`` whose caller
        has folded it, summed ``squares`` (per bucket, :func:`average_signs`) and the sum
        of ``buffer²`` (``input_squares``), and reads the average from the messages
        itself: the :class:`GatheredSigns` and the error figure."""
        if not self.expands_later:
            raise RuntimeError(
                f"average_signs needs the fused per-bucket kernels and shared scales; this "
                f"codec has {self.sign_ops.name} ones"
                + (" and per-tensor scales" if self.per_tensor else "")
            )
        feedback = self.fused_feedback(key, numel)
        with self.sign_ops.measure(buffer.device) as measured:
            signs = average_signs(self.comm, buffer, feedback, self.sign_ops, squares)
        measured.input_sq += input_squares
        return signs, measured.relative_error()

    def reset(self) -> None:
        for feedback in self.feedback.values():
            feedback.reset()

    def state_dict(self) -> dict:
        return {k: f.state_dict() for k, f in self.feedback.items()}

    def load_state_dict(self, state: dict) -> None:
        self.feedback = {}
        for key, saved in state.items():
            fb = self._new_feedback(saved["numel"], self.comm.device)
            fb.load_state_dict(saved)
            self.feedback[key] = fb


def _default_ops(comm):
    """The per-bucket implementation for ``comm``'s device (:func:`~.compression.sign_ops`)."""
    return sign_ops(comm.device)
