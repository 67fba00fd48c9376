"""The codec interface, the codec registry and the plain fp32 codec.

A codec declares itself once, in a :class:`CodecSpec` registered in :data:`CODECS`: its
name, the kinds of traffic it serves, its nominal bits per element, whether it is lossy,
whether an optimizer may overlap its buckets with the backward pass, and its builder. The
compression policy (which kinds accept it), :func:`bits_per_element`, the benchmark's
choices and the guide's tables read the registry; nothing else lists codec names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from onebit_bert.distributed.traffic import POLICY_KINDS
from onebit_bert.registry import Registry


@dataclass(frozen=True)
class CodecOptions:
    """The ``comm`` settings a builder may read (:class:`~onebit_bert.distributed.policy.CommConfig`
    holds them, with their checks)."""

    int8_block: int = 1024
    int4_block: int = 128
    powersgd_rank: int = 4
    powersgd_start_step: int = 10
    bucket_numel: int | None = None
    """1-bit codecs: elements per independently compressed bucket (None: one bucket)."""


@dataclass(frozen=True)
class CodecSpec:
    """What the rest of the harness knows about a codec."""

    name: str
    """The value of ``comm.compression.<key>`` that selects it."""
    build: Callable[..., Codec]
    """``build(comm, options)``: the codec over a communicator, with :class:`CodecOptions`."""
    serves: tuple[str, ...]
    """The ``comm.compression`` keys (kinds of traffic) that accept it."""
    bits: float | Callable[[CodecOptions], float]
    """Nominal wire bits per element before padding (a function of the options where they
    set it; NaN where the data decide)."""
    lossy: bool
    """Whether the average differs from the fp32 one."""
    overlaps: bool
    """Whether an optimizer may run its fused buckets during the backward pass
    (:meth:`Codec.fused_buckets`; ``comm.overlap``)."""
    summary: str
    """What travels, in one line (the guide's codec table)."""

    def __post_init__(self):
        unknown = sorted(set(self.serves) - set(POLICY_KINDS))
        if unknown or not self.serves:
            raise ValueError(
                f"codec {self.name} serves {', '.join(unknown) or 'no kind'}; the kinds of "
                f"traffic are {', '.join(POLICY_KINDS)}"
            )

    def bits_per_element(self, options: CodecOptions | None = None) -> float:
        bits = self.bits
        return float(bits(options or CodecOptions()) if callable(bits) else bits)


CODECS: Registry[CodecSpec] = Registry("codec", key="comm.compression.<kind>")
"""Every codec, by name, in registration order (the built-in ones: ``codecs/__init__.py``)."""


def register_codec(spec: CodecSpec, replace: bool = False) -> CodecSpec:
    """Add a codec to :data:`CODECS`: it is then accepted by the kinds it serves and built
    by :func:`build_codec`."""
    return CODECS.register(spec, replace=replace)


def codec_spec(name: str) -> CodecSpec:
    """The registered codec ``name``; a clear error naming every choice."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return CODECS[name]


def accepted_codecs(key: str) -> tuple[str, ...]:
    """The codecs traffic ``key`` (a ``comm.compression`` key) accepts, in registry order."""
    return CODECS.names(lambda spec: key in spec.serves)


def build_codec(name: str, comm, **options) -> Codec:
    """The codec called ``name`` over ``comm``; ``options``: fields of :class:`CodecOptions`."""
    return codec_spec(name).build(comm, CodecOptions(**options))


def bits_per_element(name: str, int8_block: int = 1024, int4_block: int = 128) -> float:
    """Nominal wire bits per element of a codec, before padding and per-chunk scales
    (powersgd: data dependent, NaN)."""
    options = CodecOptions(int8_block=int8_block, int4_block=int4_block)
    return codec_spec(name).bits_per_element(options)


def codec_table() -> list[str]:
    """The registry as a Markdown table (the guide's codec table is this, verbatim)."""
    lines = [
        "| codec | kinds it serves | bits per element | lossy | overlaps | what travels |",
        "|---|---|---|---|---|---|",
    ]
    for spec in CODECS.values():
        bits = spec.bits_per_element()
        lines.append(
            f"| `{spec.name}` | {', '.join(spec.serves)} | "
            f"{'data dependent' if math.isnan(bits) else f'{bits:g}'} | "
            f"{'yes' if spec.lossy else 'no'} | {'yes' if spec.overlaps else 'no'} | "
            f"{spec.summary} |"
        )
    return lines


class Codec:
    """Averages tensors over the ranks of a communicator at some precision.

    ``all_reduce(tensors, key)`` replaces every tensor by its mean over ranks; ``key``
    names the buffer (e.g. ``"grad/0"``): stateful codecs keep their errors per key, so
    the same key must mean the same tensors (same sizes, same order) on every call.
    A subclass sets ``name`` to its registered name; what the registry declares about it
    (:attr:`lossy`, :attr:`overlaps_fused`) is read from there.
    """

    name = "none"
    per_tensor = False
    """Whether each tensor of an :meth:`all_reduce` is averaged on its own (a caller with
    one flat buffer passes it split into its tensors)."""

    def __init__(self, comm):
        self.comm = comm

    @property
    def spec(self) -> CodecSpec:
        return codec_spec(self.name)

    @property
    def lossy(self) -> bool:
        return self.spec.lossy

    @property
    def overlaps_fused(self) -> bool:
        """Whether a caller may run :meth:`all_reduce_fused`'s buckets itself, during the
        backward pass (:meth:`fused_buckets`)."""
        return self.spec.overlaps

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

    def average_bucket(self, bucket) -> None:
        """Average a DDP ``GradBucket``'s buffer in place (:func:`codec_ddp_hook`): each
        gradient on its own for a per-tensor codec, else the whole buffer."""
        buffer = bucket.buffer()
        if self.per_tensor:
            sizes = [g.numel() for g in bucket.gradients()]
            self.all_reduce(list(torch.split(buffer, sizes)), f"grad/{bucket.index()}")
        else:
            self.all_reduce([buffer], f"grad/{bucket.index()}", last=bucket.is_last())

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

    def fused_buckets(self, buffer: torch.Tensor, key: str, numel: int, comm):
        """:meth:`all_reduce_fused` of ``buffer`` cut into buckets that a caller runs
        itself, to overlap them with the backward pass (codecs whose spec ``overlaps``): an
        object with ``buckets`` (each with ``start`` and ``size`` in the buffer),
        ``start(index)`` (issue bucket ``index``'s first collective on ``comm``, a side
        channel of this codec's communicator; returns its
        :class:`~onebit_bert.distributed.codecs.two_phase.TwoPhaseRun`) and
        ``error_norm()`` (the norm of what compression left out on this rank, once every
        bucket is done). Optional (:class:`~onebit_bert.distributed.codecs.onebit.
        FusedOneBitBuckets` has them): ``measures`` and ``relative_error()``, the error
        figure from sums its kernels made while compressing (the caller then takes no norms
        itself); with ``keep=True`` (a codec whose ``expands_later``), ``signs()``, the
        average left unexpanded, and ``start(index, squares)``, the bucket's sums of
        squares taken from a caller that made them."""
        raise NotImplementedError(f"the {self.name} codec cannot overlap its buckets")

    def reset(self) -> None:
        """Forget the carried compression errors (stateless codecs: nothing to do)."""

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
    ``codec`` (:meth:`Codec.average_bucket`, synchronously, during the backward pass),
    counted as ``gradients``."""

    def hook(_state, bucket):
        buffer = bucket.buffer()
        with codec.comm.traffic("gradients"):
            codec.average_bucket(bucket)
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook
