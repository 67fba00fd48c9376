"""What 1-bit LAMB, 1-bit Adam and 0/1 Adam share: the machinery around the compressed
all-reduce, and the full-precision warmup that ends at ``freeze_step``.

:class:`CompressedOptimizer` keeps fp32 parameters on one device, the communicator, one
zero-padded flat buffer whose slices *are* a per-parameter state (so the error-compensated
1-bit all-reduce runs in place, once per bucket, over every layer at once), this rank's
compression errors, momentum masks, and a state dict split into the part every rank
shares and this rank's own part (``"per_rank"``).

Fusing all layers into one buffer means one scale per bucket instead of DeepSpeed's one
scale per tensor (its 1-bit Adam and 0/1 Adam compress tensor by tensor). Layers whose
values are much smaller than the rest would then be swamped by the common scale, so every
layer is multiplied by a scaling coefficient before compression and divided by it after
(:func:`scaling_coefficients`: the mean RMS over layers divided by the layer's RMS), which
is how 1-bit LAMB (Li et al., arXiv 2104.06069, Sec. 3; DeepSpeed's ``OnebitLamb``) makes
one fused buffer work. The coefficients are computed from state that is identical on every
rank, so every rank derives the same ones without communicating.

:class:`WarmupThenCompress` adds the two-stage schedule of 1-bit LAMB and 1-bit Adam:
steps ``1 .. freeze_step`` take averaged gradients, later ones compress. ``freeze_step``
may be ``"auto"`` (:mod:`onebit_bert.optim.auto_freeze`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from onebit_bert.distributed.codecs import Codec, OneBitCodec, TwoPhaseRun
from onebit_bert.distributed.codecs.compression import padded_size, plan_buckets, sign_ops
from onebit_bert.distributed.codecs.packing import prepare
from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import check_kernels
from onebit_bert.optim.auto_freeze import AUTO, AutoFreezeConfig, FreezeDetector
from onebit_bert.optim.ddp_traffic import DdpGradientTraffic
from onebit_bert.optim.lamb import check_params_and_grads

log = logging.getLogger(__name__)

FUSED = "fused"
"""The default codec's key for the fused buffer's error feedback."""


def scaling_coefficients(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, ``mean_k(rms_k) / rms_l`` (1 for an all-zero tensor instead of inf): the
    factors that give every tensor the same RMS before a fused compression."""
    rms = torch.stack([torch.linalg.vector_norm(t) / math.sqrt(t.numel()) for t in tensors])
    return torch.where(rms > 0, rms.mean() / rms, torch.ones_like(rms))


class CompressedOptimizer(Optimizer):
    """Base of the optimizers that average something across ranks with the 1-bit
    all-reduce. Subclasses set ``NAME`` and implement ``step``; ``_step`` counts steps.

    After each step: ``last_compression_error`` (‖this rank's worker error‖ / ‖what it
    compressed‖, None when nothing was compressed), ``last_step_bytes`` and ``bytes_sent``
    (this optimizer's traffic from this rank, and that of a DDP model all-reducing its
    gradients without the compression hook: :attr:`ddp_traffic`).
    """

    NAME = "compressed optimizer"

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        comm: Communicator | None,
        bucket_numel: int | None,
        kernels: str = "auto",
    ):
        check_kernels(kernels)
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive element count, got {bucket_numel}")
        super().__init__(params, defaults)
        check_params_and_grads(self, self.NAME)
        self._check_single_fp32_device()
        self.bucket_numel = bucket_numel
        if comm is None:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            comm = Communicator(group=group, device=self._device)
        self.comm = comm
        prepare(self._device)
        self._step = 0
        # Masks describe this run (e.g. the phase's sequence length), not its history, so
        # they are kept out of the state dict: a phase-2 run loading phase-1 state sets its own.
        self._masks: dict[torch.Tensor, torch.Tensor] = {}
        self.mask_untrained = True
        """Zero the compressed result where the second moment ``exp_avg_sq`` is exactly 0
        (no gradient has reached that element in full precision; the same on every rank).
        The 1-bit all-reduce turns a zero into ``±scale``, and ``m/(sqrt(v)+eps)`` with
        ``v = 0`` makes that ``scale/eps``: unused rows (a token type, the NSP head and the
        pooler when training without NSP) would be thrown to magnitudes of 1e4 by noise.
        DeepSpeed leaves this to a hand-made ``exp_avg_mask``. False: its behaviour."""
        self.kernels = kernels
        """The reference or the fused kernels (:mod:`onebit_bert.kernels`; ``auto``: fused
        on CUDA) for the default codec's per-bucket work and the subclasses' updates."""
        self.codec: Codec = OneBitCodec(
            self.comm, bucket_numel, sign_ops=sign_ops(self._device, kernels)
        )
        """The codec (:mod:`onebit_bert.distributed.codecs`) that averages the fused buffer:
        by default 1-bit with error feedback on this optimizer's communicator, in place on
        the padded buffer (and overlappable with the backward pass); :meth:`set_codec`
        replaces it (``comm.compression.momentum`` other than onebit, or
        ``comm.hierarchy: node``)."""
        self._check_buckets(bucket_numel)
        self._own_codec = True
        self._flat: torch.Tensor | None = None
        self._flat_numel = 0
        self._flat_sizes: list[int] = []
        self.last_compression_error: torch.Tensor | None = None
        self.last_step_bytes = 0
        self.bytes_sent = 0
        self.ddp_traffic = DdpGradientTraffic(self)
        """A DDP model that all-reduces this optimizer's gradients without
        :func:`~onebit_bert.ddp.register_compression_hook`: warned about once, its fp32
        all-reduce counted in ``last_step_bytes``, ``bytes_sent`` and the communicator's
        ``gradients`` (:mod:`onebit_bert.optim.ddp_traffic`)."""
        self.register_step_pre_hook(self.ddp_traffic.before_step)
        self.register_step_post_hook(self.ddp_traffic.after_step)

    def _check_buckets(self, bucket_numel: int | None) -> None:
        """Refuse a bucket size the compression steps could not use (below ``8 ×`` world
        size elements, or past the fused kernels' limit) now, rather than at the freeze."""
        numel = sum(p.numel() for group in self.param_groups for p in group["params"])
        try:
            buckets = plan_buckets(numel, self.comm.world_size, bucket_numel)
        except ValueError as err:
            raise ValueError(f"{self.NAME}: {err}") from None
        check = getattr(self.codec.sign_ops, "check_bucket", None)
        if check is not None:
            check(max(bucket.size for bucket in buckets))

    def _check_single_fp32_device(self) -> None:
        devices = set()
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"{self.NAME} keeps fp32 master weights; got a {p.dtype} parameter of "
                        f"shape {tuple(p.shape)}. Keep parameters in fp32 and use autocast for "
                        f"bf16/fp16 compute"
                    )
                devices.add(p.device)
        if len(devices) > 1:
            raise ValueError(
                f"{self.NAME} needs all parameters on one device, got {sorted(map(str, devices))}"
            )
        self._device = devices.pop() if devices else torch.device("cpu")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._flat = None  # the fused layout changed

    @property
    def step_count(self) -> int:
        return self._step

    # ------------------------------------------------------------------ masks
    def set_momentum_mask(self, param: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Zero what the compressed all-reduce returns for ``param`` where ``mask`` is 0
        (rows that never train, such as position embeddings beyond the current sequence
        length, would otherwise pick up compression noise; elements whose second moment is
        still 0 are zeroed anyway, see :attr:`mask_untrained`). ``mask`` broadcasts to the
        parameter's shape; ``None`` removes it. Masks are not part of :meth:`state_dict`:
        set them again after building the optimizer."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("set_momentum_mask: the tensor is not a parameter of this optimizer")
        if mask is None:
            self._masks.pop(param, None)
            return
        try:
            fits = torch.broadcast_shapes(mask.shape, param.shape) == param.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"momentum mask of shape {tuple(mask.shape)} does not broadcast to the "
                f"parameter's shape {tuple(param.shape)}"
            )
        mask = mask.detach().to(device=param.device, dtype=torch.float32)
        if not torch.all((mask == 0) | (mask == 1)):
            raise ValueError("a momentum mask holds only 0 (masked) and 1 (kept)")
        self._masks[param] = mask

    def _states_with(self, key: str) -> list[torch.Tensor]:
        """State ``key`` of every parameter that has it, in group and parameter order."""
        return [
            self.state[p][key]
            for group in self.param_groups
            for p in group["params"]
            if key in self.state[p]
        ]

    def _apply_masks(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """The momentum masks, then (with :attr:`mask_untrained`) zero where ``v`` is 0."""
        for p, t in zip(params, tensors, strict=True):
            mask = self._masks.get(p)
            if mask is not None:
                t.mul_(mask)
            if self.mask_untrained:
                second = self.state[p].get("exp_avg_sq")
                if second is not None:
                    t.masked_fill_(second == 0, 0.0)

    # ------------------------------------------------------------------ the fused buffer
    def _layout(self, key: str, when: str) -> list[tuple[dict, list[torch.Tensor]]]:
        """Per group, the parameters that take part in the fused all-reduce: every
        parameter that has state ``key`` (the same set on every rank). A parameter with a
        gradient but no such state got its first gradient too late (``when`` says when)."""
        layout = []
        for group in self.param_groups:
            members = []
            for p in group["params"]:
                if key in self.state[p]:
                    members.append(p)
                elif p.grad is not None:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(p.shape)} received its first gradient "
                        f"{when}; every trained parameter must receive gradients from the "
                        f"first step on"
                    )
            layout.append((group, members))
        return layout

    def _fused(self, params: list[torch.Tensor], key: str) -> torch.Tensor:
        """One zero-padded fp32 buffer whose slices are the ``key`` states of ``params``,
        so the compressed all-reduce works in place; and this rank's compression errors
        for it. Rebuilt after loading a state dict."""
        numel = sum(p.numel() for p in params)
        flat = self._flat
        if flat is not None:
            offset = 0
            for p in params:
                if self.state[p][key].data_ptr() != flat.data_ptr() + 4 * offset:
                    flat = None
                    break
                offset += p.numel()
            if offset != numel:
                flat = None
        if flat is None:
            flat = torch.zeros(padded_size(numel, self.comm.world_size), device=self._device)
            for p, view in zip(params, self._views(flat, params, 0), strict=True):
                view.copy_(self.state[p][key])
                self.state[p][key] = view
            self._flat = flat
            self._on_new_flat(flat)
        self._flat_numel = numel
        self._flat_sizes = [p.numel() for p in params]
        if self._own_codec:
            self.codec.fused_feedback(FUSED, numel)  # a size mismatch is refused here
        return flat

    def _on_new_flat(self, flat: torch.Tensor) -> None:
        """Called when the fused buffer is (re)built; subclasses size scratch space here."""

    @staticmethod
    def _views(buffer: torch.Tensor, params: list[torch.Tensor], start: int) -> list:
        """Slices of ``buffer`` from ``start`` on, shaped like ``params`` one after another."""
        views, offset = [], start
        for p in params:
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def set_kernels(self, kernels: str) -> None:
        """Take later steps with ``kernels`` (the state is the same for both)."""
        check_kernels(kernels)
        self.kernels = kernels
        if self._own_codec:
            self.codec.sign_ops = sign_ops(self._device, kernels)

    def set_codec(self, codec: Codec) -> None:
        """Average the fused buffer with ``codec`` instead of the default 1-bit codec (its
        state then travels in this optimizer's per-rank state under ``codec``)."""
        self.codec = codec
        self._own_codec = False

    def _codec_key(self, kind: str) -> str:
        # the default codec keeps one error feedback for the fused buffer, whatever it
        # carries (0/1 Adam resets it when its gradients give way to its momentum); a
        # codec set from the policy keeps its errors per kind of traffic
        return FUSED if self._own_codec else kind

    def _compressed_all_reduce(self, flat: torch.Tensor, kind: str) -> None:
        """Average ``flat`` over ranks with :attr:`codec`, in place, filed as traffic
        ``kind``; sets ``last_compression_error`` (what compression left out on this rank
        relative to what it sent; None when the codec does not measure it) and the byte
        counters."""
        before = self.comm.snapshot()
        with self.comm.traffic(kind):
            error = self.codec.all_reduce_fused(
                flat, self._flat_numel, self._codec_key(kind), self._flat_sizes
            )
        self.last_compression_error = error
        self.last_step_bytes = (self.comm.snapshot() - before).bytes_sent
        self.bytes_sent += self.last_step_bytes

    def _codec_overlaps(self) -> bool:
        """Whether :attr:`codec` can run its buckets during the backward pass (a codec with
        that capability, on this optimizer's communicator)."""
        return self.codec.overlaps_fused and self.codec.comm is self.comm

    # ------------------------------------------------------------------ overlap
    def enable_overlap(self, comm: Communicator, bucket_numel: int | None = None) -> None:
        """Let compression steps start their bucket all-reduces during the backward pass
        (:class:`OverlappedCompression`), on ``comm`` (a side channel of this optimizer's
        communicator). Registers a post-accumulate-grad hook on every parameter.

        ``bucket_numel``: the buckets' size where this optimizer was built without one
        (one bucket leaves nothing to overlap: its all-reduce can start only once every
        gradient is folded); ignored where it was built with one. Call it before any
        compression step or state load: errors are laid out by bucket."""
        if bucket_numel is not None and self.bucket_numel is None:
            self._set_bucket_numel(bucket_numel)
        self._overlap_comm = comm
        self._overlapped: OverlappedCompression | None = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _set_bucket_numel(self, bucket_numel: int) -> None:
        """Compress in buckets of at most ``bucket_numel`` elements from now on (the
        default codec's; a codec set by :meth:`set_codec` keeps its own)."""
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive element count, got {bucket_numel}")
        self._check_buckets(bucket_numel)
        if self._own_codec:
            if self.codec.feedback:
                raise RuntimeError(
                    f"{self.NAME}: the bucket size can change only before the first "
                    "compression step or state load (the errors are laid out by bucket)"
                )
            self.codec.bucket_numel = bucket_numel
        self.bucket_numel = bucket_numel

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        run = getattr(self, "_overlapped", None)
        if run is not None:
            run.grad_ready(p)

    def begin_overlap(self, clip: OverlapClip | None = None) -> bool:
        """Before the last micro-batch's backward of a step: arm the overlap if that step
        compresses with a codec that can overlap (:meth:`_codec_overlaps`); True when armed.
        ``clip``: clip the step's gradients bucket by bucket (:class:`OverlapClip`); None:
        fold them as they are."""
        if getattr(self, "_overlap_comm", None) is None or not self._next_step_overlaps():
            return False
        layout = self._layout("exp_avg", "after the freeze step")
        members = [p for _, ps in layout for p in ps]
        if not members:
            return False
        flat = self._fused(members, "exp_avg")
        self._prepare_compression(members, flat)
        self._overlapped = OverlappedCompression(self, layout, flat, self._overlap_comm, clip)
        return True

    def _take_overlapped(self) -> OverlappedCompression | None:
        """The armed overlap of this step (disarmed), or None."""
        run = getattr(self, "_overlapped", None)
        self._overlapped = None
        return run

    def _next_step_overlaps(self) -> bool:
        """Whether the coming step compresses with the built-in all-reduce (subclasses
        that can overlap say so)."""
        return False

    def _prepare_compression(self, members: list[torch.Tensor], flat: torch.Tensor) -> None:
        """State a compression step needs before it folds gradients (subclasses)."""

    def _overlap_buffer(self, layout, flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The buffer an overlapped step compresses and whether the codec keeps the
        average unexpanded for the update (subclasses that read it from the messages):
        here the fused buffer, expanded."""
        return flat, False

    def _bucket_squares(self, index: int) -> torch.Tensor | None:
        """In an overlapped step, once every gradient of bucket ``index`` is folded: where
        the folds wrote its worker values ``x + worker error`` themselves (subclasses
        whose folds do), the sums of ``x²``, of the values' squares and of their sizes
        over it; None: the codec makes the values and sums itself."""
        return None

    def _fold_for_compression(
        self, group: dict, params: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> None:
        """Fold ``params``' gradients (times ``grad_scale``, a 0-d tensor, when given) into
        their momenta and scale for compression (subclasses that can overlap)."""
        raise NotImplementedError

    @staticmethod
    def _gradients(params: list[torch.Tensor], grad_scale: torch.Tensor | None) -> list:
        """``params``' gradients (zeros where there is none), times ``grad_scale`` when
        given: new tensors, the same numbers as clipping them in place by that
        coefficient (torch's ``clip_grad_norm_`` multiplies by a 0-d tensor too)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if grad_scale is None:
            return grads
        return list(torch._foreach_mul(grads, grad_scale))

    def _set_scaling_coefficients(self, params: list[torch.Tensor], source: str) -> None:
        """``scaling_coeff`` of every parameter from its ``source`` state, which must be
        identical on every rank when this is called."""
        scales = scaling_coefficients([self.state[p][source] for p in params])
        for p, s in zip(params, scales.unbind(0), strict=True):
            self.state[p]["scaling_coeff"] = s.clone()

    # ------------------------------------------------------------------ per-rank state
    def _per_rank_state(self) -> dict:
        if not self._own_codec:
            return {"error_feedback": None, "codec": self.codec.state_dict()}
        saved = self.codec.state_dict().get(FUSED)
        return {"error_feedback": saved}

    def _load_per_rank_state(self, per_rank: dict, compressing: bool) -> None:
        """Restore this rank's compression errors (fresh ones, with a warning when the run
        is already compressing and none were saved for this rank)."""
        self._flat = None
        if not self._own_codec:
            self.codec.load_state_dict(per_rank.get("codec") or {})
            return
        saved = per_rank.get("error_feedback")
        if saved is None and compressing:
            warnings.warn(
                f"{self.NAME} state at step {self._step} has no compression errors for this "
                f"rank; starting them from zero",
                stacklevel=3,
            )
        self.codec.load_state_dict({} if saved is None else {FUSED: saved})


STAGES = ("start", "exchange")
"""The two collectives of a bucket's 1-bit all-reduce, in issue order."""


def gradient_norms(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each parameter's gradient norm (a 0-d tensor; None where it has no gradient), as
    torch's ``clip_grad_norm_`` computes them (one ``_foreach_norm``)."""
    present = [p.grad for p in params if p.grad is not None]
    norms = iter(torch._foreach_norm(present) if present else [])
    return [None if p.grad is None else next(norms) for p in params]


class OverlapClip:
    """Gradient clipping for an overlapped step, whose buckets are sent before the whole
    gradient's norm is known.

    When a bucket is ready, the gradients of every parameter in it or in a bucket sent
    before it (the parameters "seen") are complete; the others are not. The step's norm is
    estimated from the seen parameters' norms now and the others' norms at the previous
    compression step (``previous``), summed as torch's ``clip_grad_norm_`` sums them
    (each parameter's norm, in :attr:`params`' order), and the bucket's parameters not
    folded yet are folded with torch's coefficient ``min(1, max_norm / (norm + 1e-6))``
    for that estimate. The last bucket sent sees every parameter, so its coefficient is
    exactly the plain step's; with a single bucket the whole step is the plain clipped
    step, bit for bit. A spike in any bucket's gradients is clipped in that bucket and in
    every bucket sent after it."""

    def __init__(
        self, max_norm: float, params: list[torch.Tensor], previous: list[torch.Tensor | None]
    ):
        if len(previous) != len(params):
            raise ValueError(f"{len(previous)} previous norms for {len(params)} parameters")
        self.max_norm = max_norm
        self.params = params
        """Every parameter whose gradient is clipped, in the order its norm is summed."""
        self._index = {id(p): i for i, p in enumerate(params)}
        self._current: dict[int, torch.Tensor | None] = {}
        self._seen: set[int] = set()
        self._estimate = list(previous)
        """The norms the estimate sums, in params' order: this step's for the parameters
        seen, ``previous`` (each parameter's norm at the previous compression step) for the
        rest; None (no gradient) is not counted."""
        # While every parameter counts, the estimate is also kept in one buffer, written
        # as buckets are seen, so a bucket's coefficient is one norm of it (the same
        # numbers as stacking the list, with no per-parameter work and no host
        # synchronisation on an accelerator); a None drops it and the list is stacked.
        self._buffer = None
        if all(n is not None for n in previous) and len({n.dtype for n in previous}) == 1:
            self._buffer = torch.stack(previous).to(params[0].device)

    def _measure(self, params: list[torch.Tensor]) -> None:
        """This step's norms of ``params``' gradients not measured yet (None: no gradient)."""
        new = [p for p in params if id(p) not in self._current]
        for p, n in zip(new, gradient_norms(new), strict=True):
            self._current[id(p)] = n

    def see(self, params: list[torch.Tensor]) -> None:
        """``params``' gradients are complete and their bucket is being sent: their norms
        replace the previous ones in the estimate."""
        self._measure(params)
        for p in params:
            if id(p) in self._seen:
                continue
            self._seen.add(id(p))
            i = self._index.get(id(p))
            if i is None:
                continue
            n = self._current[id(p)]
            self._estimate[i] = n
            if self._buffer is not None:
                if n is None or n.dtype != self._buffer.dtype:
                    self._buffer = None
                else:
                    self._buffer[i].copy_(n)

    def coefficient(self) -> torch.Tensor:
        """The clipping coefficient for the norm estimated from what has been seen."""
        if self._buffer is not None:
            total = torch.linalg.vector_norm(self._buffer)
        else:
            norms = [n for n in self._estimate if n is not None]
            if not norms:
                return torch.ones((), device=self.params[0].device)
            total = torch.linalg.vector_norm(torch.stack(norms))
        return torch.clamp(self.max_norm / (total + 1e-6), max=1.0)

    def norms(self) -> list[torch.Tensor | None]:
        """Each parameter's gradient norm this step (None where it has no gradient), to be
        called once every gradient is complete: the step's norm, and the previous norms of
        the next overlapped step. The buckets not sent yet use the norms measured here, but
        still estimate as if sent in turn (what each bucket counts as seen does not depend
        on when its collectives could be issued)."""
        self._measure(self.params)
        return [self._current[id(p)] for p in self.params]


class OverlappedCompression:
    """One compression step whose bucket all-reduces start during the backward pass.

    Armed before the last micro-batch's backward (:meth:`CompressedOptimizer.begin_overlap`):
    as each parameter's gradient is complete (its post-accumulate-grad hook), the
    optimizer folds it into the momentum (the same per-group arithmetic, one parameter at
    a time); once every parameter overlapping a bucket of the fused buffer is folded, the
    bucket is ready. With ``clip`` (:class:`OverlapClip`) the fold waits for the bucket
    instead: when every parameter overlapping it has its gradient, they are folded with the
    bucket's clipping coefficient. The buckets are the codec's
    (:meth:`~onebit_bert.distributed.codecs.Codec.fused_buckets`, any codec whose spec
    ``overlaps``). No thread of its own: the hooks (which run on the thread running the
    backward pass) and :meth:`finish` issue the buckets' asynchronous collectives (each a
    :class:`~onebit_bert.distributed.codecs.TwoPhaseRun`) in one fixed order, the same on
    every rank: for the last bucket first (the order the backward pass
    completes them), its all-to-all, then its all-gather once the all-to-all is done, then
    the next bucket's. Each hook issues what it can without blocking; :meth:`finish` folds
    what got no gradient and issues and waits for the rest. The buckets are independent,
    so the numbers are those of the step without overlap whose gradients were multiplied,
    parameter by parameter, by the coefficients the step used (1 without ``clip``)."""

    def __init__(
        self,
        opt: CompressedOptimizer,
        layout,
        flat: torch.Tensor,
        comm: Communicator,
        clip: OverlapClip | None = None,
    ):
        self.opt = opt
        self.clip = clip
        self.comm = comm
        key, numel = opt._codec_key("momentum"), opt._flat_numel
        # the buffer compressed: the fused one, or one the optimizer folds into beside it
        # and whose average it reads from the messages (keep)
        self.flat, self.keep = opt._overlap_buffer(layout, flat)
        if self.keep:
            self.fused = opt.codec.fused_buckets(self.flat, key, numel, comm, keep=True)
        else:
            self.fused = opt.codec.fused_buckets(self.flat, key, numel, comm)
        self.signs = None
        """With ``keep``, after :meth:`finish`: the average's messages, unexpanded."""
        buckets = self.fused.buckets
        self.pending = [0] * len(buckets)
        self.where: dict[int, tuple[dict, torch.Tensor, list[int]]] = {}
        self.members: list[list[tuple[dict, torch.Tensor]]] = [[] for _ in buckets]
        """The parameters overlapping each bucket."""
        self.unfolded: dict[int, tuple[dict, torch.Tensor]] = {}
        offset = 0
        for group, params in layout:
            for p in params:
                hit = [
                    k
                    for k, b in enumerate(buckets)
                    if offset < b.start + b.size and b.start < offset + p.numel()
                ]
                for k in hit:
                    self.pending[k] += 1
                    self.members[k].append((group, p))
                self.where[id(p)] = (group, p, hit)
                self.unfolded[id(p)] = (group, p)
                offset += p.numel()
        # The collectives in issue order: (bucket, "start" | "exchange"), last bucket first.
        self.order = [(k, op) for k in reversed(range(len(buckets))) for op in STAGES]
        self.next = 0
        self.runs: dict[int, TwoPhaseRun] = {}
        self.norm_sq = torch.zeros((), dtype=torch.float64, device=flat.device)
        self.before = comm.snapshot()

    def _fold(self, members: list[tuple[dict, torch.Tensor]], scale) -> None:
        for group, p in members:
            if self.unfolded.pop(id(p), None) is not None:
                self.opt._fold_for_compression(group, [p], scale)

    def _progress(self, block: bool) -> None:
        """Issue the collectives whose turn has come, in :attr:`order`, until one must wait
        (a bucket not ready yet, or, unless ``block``, an all-to-all still in flight)."""
        with self.comm.traffic("momentum"):
            while self.next < len(self.order):
                k, op = self.order[self.next]
                if op == "start":
                    if self.pending[k] > 0:
                        return
                    if self.clip is not None:
                        self.clip.see([p for _, p in self.members[k]])
                        self._fold(self.members[k], self.clip.coefficient())
                    squares = self.opt._bucket_squares(k)
                    if not getattr(self.fused, "measures", False):
                        b = self.fused.buckets[k]
                        bucket = self.flat[b.start : b.start + b.size]
                        self.norm_sq += torch.linalg.vector_norm(bucket).double() ** 2
                    if squares is None:
                        self.runs[k] = self.fused.start(k)
                    else:  # summed as the bucket's gradients were folded
                        self.runs[k] = self.fused.start(k, squares)
                elif not self.runs[k].exchange(block):
                    return
                self.next += 1

    def grad_ready(self, p: torch.Tensor) -> None:
        entry = self.where.pop(id(p), None)
        if entry is None:
            return
        group, param, hit = entry
        if self.clip is None or not hit:
            self._fold([(group, param)], None)
        for k in hit:
            self.pending[k] -= 1
        self._progress(block=False)

    def finish(self) -> None:
        """Fold the parameters that got no gradient, issue every remaining collective and
        wait for every bucket; set the optimizer's error and byte figures."""
        for _group, param, _hit in list(self.where.values()):
            self.grad_ready(param)
        self._progress(block=True)
        with self.comm.traffic("momentum"):
            for k in reversed(range(len(self.fused.buckets))):
                self.runs[k].finish()
        if self.keep:
            self.signs = self.fused.signs()
        opt = self.opt
        if getattr(self.fused, "measures", False):  # summed by the kernels as they went
            opt.last_compression_error = self.fused.relative_error()
        else:
            norm = self.norm_sq.sqrt().float()
            opt.last_compression_error = self.fused.error_norm() / norm.clamp_min(1e-30)
        opt.last_step_bytes = (self.comm.snapshot() - self.before).bytes_sent
        opt.bytes_sent += opt.last_step_bytes


class WarmupThenCompress(CompressedOptimizer):
    """Steps ``1 .. freeze_step`` take gradients the caller averaged (the warmup), later
    ones compress (``syncs_internally``). ``freeze_step="auto"`` lets a
    :class:`~onebit_bert.optim.auto_freeze.FreezeDetector` choose it from the second
    moment, within bounds set by ``auto_freeze`` and ``total_steps``; until it has chosen,
    ``freeze_step`` is None."""

    def _init_freeze(
        self,
        freeze_step: int | str,
        auto_freeze: AutoFreezeConfig | None,
        total_steps: int | None,
    ) -> None:
        self._detector: FreezeDetector | None = None
        if freeze_step == AUTO:
            self._detector = (auto_freeze or AutoFreezeConfig()).detector(total_steps)
            self.freeze_step: int | None = None
        else:
            self.freeze_step = freeze_step

    @staticmethod
    def _check_freeze_step(freeze_step) -> None:
        if freeze_step == AUTO:
            return
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be an integer >= 1 (the last warmup step) or 'auto', "
                f"got {freeze_step!r}"
            )

    @property
    def auto_freeze(self) -> bool:
        """Whether the warmup's end is chosen from the second moment."""
        return self._detector is not None

    @property
    def freeze_statistic(self) -> float | None:
        """With ``freeze_step="auto"``: the last check's largest relative change of a
        layer's ‖v‖ over the window (None before the second check)."""
        return None if self._detector is None else self._detector.statistic

    @property
    def syncs_internally(self) -> bool:
        """True when the next ``step()`` averages across ranks by itself: the caller must
        then skip its own gradient all-reduce and pass local (micro-batch averaged)
        gradients."""
        return self.freeze_step is not None and self._step + 1 > self.freeze_step

    @property
    def stage(self) -> str:
        """Stage of the last step taken ("warmup" before the first one): what the step's
        logged ``stage`` metric says. The stage of the coming step is :attr:`next_stage`."""
        if self.freeze_step is None or self._step <= self.freeze_step:
            return "warmup"
        return "compression"

    @property
    def next_stage(self) -> str:
        """Stage the next ``step()`` will run: "compression" when it averages across ranks
        by itself (:attr:`syncs_internally`), else "warmup"."""
        return "compression" if self.syncs_internally else "warmup"

    def _observe_warmup(self, exp_avg_sqs: list[torch.Tensor]) -> None:
        """After warmup step ``_step``: let the detector decide whether it was the last."""
        if self._detector is None or self.freeze_step is not None:
            return
        beta2 = self.param_groups[0]["betas"][1]
        if self._detector.observe(self._step, exp_avg_sqs, beta2):
            self.freeze_step = self._step
            if self.comm.rank == 0:
                log.info(
                    "%s: warmup ends at step %d (largest relative change of a layer's |v| "
                    "over %d steps: %s)",
                    self.NAME,
                    self._step,
                    self._detector.window,
                    self._detector.statistic,
                )

    def _freeze_state(self) -> dict:
        return {
            "step": self._step,
            "freeze_step": self.freeze_step,
            "auto_freeze": None if self._detector is None else self._detector.state_dict(),
        }

    def _load_freeze_state(self, extra: dict) -> None:
        """Restore the step count and, with ``freeze_step="auto"``, the decision or the
        detector's history. A fixed ``freeze_step`` stays this optimizer's own (a new
        phase may set another)."""
        self._step = int(extra["step"])
        if self._detector is None:
            return
        saved = extra.get("auto_freeze")
        if saved is not None:
            self._detector.load_state_dict(saved)
            self.freeze_step = self._detector.freeze_step
        elif extra.get("freeze_step") is not None and self._step > extra["freeze_step"]:
            # written by a run with a fixed freeze_step that is already compressing
            self.freeze_step = int(extra["freeze_step"])
            self._detector.freeze_step = self.freeze_step
