"""Data parallelism with a gradient average every step (LAMB, AdamW), and the strategies of
the optimizers that average across ranks by themselves on some steps (1-bit LAMB, 1-bit
Adam; 0/1 Adam in :mod:`onebit_bert.strategies.zero_one_adam`): they average gradients
only on the steps whose optimizer asks for it."""

from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.distributed.codecs import GRAD_BUCKET_BYTES, Codec, PlainCodec, bucketed
from onebit_bert.optim.compressed import OverlapClip, gradient_norms
from onebit_bert.optim.surface import OverlappingOptimizer
from onebit_bert.strategies.base import GradientSync, Strategy
from onebit_bert.strategies.registry import (
    BuildArgs,
    StrategySpec,
    register_strategy,
    strategy_spec,
)


class DataParallel(Strategy):
    """Average gradients over ranks, then step: with DDP (bucketed all-reduces overlapped
    with the backward pass, skipped by ``no_sync`` during accumulation) or with one
    bucketed all-reduce after the last micro-batch (exact byte and time accounting).
    Gradient traffic is counted as ``gradients``."""

    name = "data_parallel"

    def __init__(self, model, loss_module, optimizer, ctx, use_ddp: bool, grad_codec=None):
        self.ddp = None
        self.grad_codec: Codec | None = grad_codec
        """Averages the gradients (``comm.compression.grad``, ``comm.hierarchy``; None: the
        plain fp32 all-reduce, :class:`PlainCodec`); None on a world of one."""
        if ctx.world_size > 1 and grad_codec is None:
            self.grad_codec = PlainCodec(ctx.comm)
        module = loss_module
        if ctx.world_size > 1 and use_ddp:
            self.ddp = DistributedDataParallel(
                loss_module,
                device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
            )
            self.ddp.register_comm_hook(None, self.grad_codec.ddp_hook())
            module = self.ddp
        super().__init__(model, module, optimizer, ctx)

    def gradient_sync(self) -> GradientSync:
        """Every step's gradients are averaged."""
        return "allreduce"

    def backward_context(self, last_micro_batch: bool):
        if self.ddp is not None and not (last_micro_batch and self.gradient_sync() == "allreduce"):
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        if self.gradient_sync() == "allreduce" and self.ddp is None and self.ctx.world_size > 1:
            grads = [p.grad for p in self.params if p.grad is not None]
            buckets = bucketed(grads, GRAD_BUCKET_BYTES)
            with self.comm.traffic("gradients"):
                for i, bucket in enumerate(buckets):
                    self.grad_codec.all_reduce(bucket, f"grad/{i}", last=i == len(buckets) - 1)

    def state_dict(self) -> tuple[dict, dict]:
        shared, per_rank = super().state_dict()
        if self.grad_codec is not None and self.grad_codec.state_dict():
            per_rank["grad_codec"] = self.grad_codec.state_dict()
        return shared, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        super().load_state_dict(shared, per_rank, same_run)
        if self.grad_codec is not None:
            self.grad_codec.load_state_dict((per_rank or {}).get("grad_codec") or {})


class SelfSyncingDataParallel(DataParallel):
    """For an optimizer with ``syncs_internally``: averaged gradients (as
    :class:`DataParallel`) on the steps it says False, none on the others, where its step
    communicates by itself."""

    overlapping = False
    """True from the last micro-batch's backward to the step of a compression step whose
    all-reduces started during the backward pass (``comm.overlap``)."""

    def gradient_sync(self) -> GradientSync:
        return "optimizer" if self.optimizer.syncs_internally else "allreduce"

    overlap_clip = 0.0
    """``clip_grad_norm`` of the overlapped steps (0: they do not clip)."""
    _overlap_clip: OverlapClip | None = None
    """The clipping of the overlapped step in progress."""
    grad_norms: list[torch.Tensor | None] | None = None
    """Each parameter's gradient norm on this rank at its last compression step (where
    gradients stay local), None where it had no gradient; kept only with
    :attr:`overlap_clip`; per-rank checkpoint state."""

    def enable_overlap(self, bucket_mb: float, clip_grad_norm: float = 0.0) -> None:
        """``comm.overlap``: compression steps fold each gradient into the momentum as soon
        as it is complete and all-reduce each bucket of the momentum as soon as it is
        folded, during the last micro-batch's backward. The momentum is compressed in
        buckets of about ``bucket_mb`` MB (unless ``optimizer.bucket_numel`` sets them), on
        a process group of its own.

        Such a step sends a bucket before the whole gradient's norm is known, so with
        ``clip_grad_norm`` > 0 each bucket is clipped by the norm estimated from the
        gradients complete by then and this rank's previous compression step's norms for
        the rest (:class:`~onebit_bert.optim.compressed.OverlapClip`; exact for the last
        bucket, and for the whole step when there is one bucket). The first compression
        step (of a run, or after a resume without those norms) does not overlap and clips
        as the plain step does."""
        bucket_numel = max(1, int(bucket_mb * (1 << 20)) // 4)
        try:
            self.optimizer.enable_overlap(self.comm.side_channel(), bucket_numel)
        except ValueError as err:
            raise ValueError(f"comm.bucket_mb {bucket_mb}: {err}") from None
        self.overlap_clip = clip_grad_norm

    def backward_context(self, last_micro_batch: bool):
        if last_micro_batch and isinstance(self.optimizer, OverlappingOptimizer):
            if self.overlap_clip <= 0:
                self.overlapping = self.optimizer.begin_overlap()
            elif self.grad_norms is not None:
                clip = OverlapClip(self.overlap_clip, self.params, self.grad_norms)
                self.overlapping = self.optimizer.begin_overlap(clip)
                self._overlap_clip = clip if self.overlapping else None
        return super().backward_context(last_micro_batch)

    def clip_gradients(self, max_norm: float) -> float:
        """An overlapped step clips its gradients bucket by bucket, from per-parameter
        norms it measures as each bucket is ready; here those of the buckets not sent yet
        are measured too (and reused when they are sent), and the step's norm from them
        all. With :attr:`overlap_clip`, every compression step keeps each parameter's norm
        for the next overlapped step, and one not overlapped clips as torch does from
        those norms: one pass over the gradients either way."""
        if self.overlap_clip <= 0 or self.gradient_sync() != "optimizer":
            return super().clip_gradients(max_norm)
        clip = self._overlap_clip if self.overlapping else None
        self.grad_norms = clip.norms() if clip is not None else gradient_norms(self.params)
        norms = [n for n in self.grad_norms if n is not None]
        if not norms:
            return 0.0
        total = torch.linalg.vector_norm(torch.stack(norms))
        if not self.overlapping:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for p in self.params if p.grad is not None], coefficient)
        return float(total)

    def state_dict(self) -> tuple[dict, dict]:
        shared, per_rank = super().state_dict()
        if self.grad_norms is not None:
            nan = torch.tensor(math.nan, device=self.ctx.device)
            per_rank["grad_norms"] = torch.stack([nan if n is None else n for n in self.grad_norms])
        return shared, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        super().load_state_dict(shared, per_rank, same_run)
        saved = (per_rank or {}).get("grad_norms")
        self.grad_norms = None
        if saved is not None and len(saved) == len(self.params):
            self.grad_norms = [
                None if math.isnan(float(n)) else n.to(self.ctx.device).clone()
                for n in saved.unbind(0)
            ]

    def step(self) -> None:
        self.optimizer.step()
        self.last_overlapped = self.overlapping
        self.overlapping = False
        self._overlap_clip = None

    last_overlapped = False

    def metrics(self) -> dict:
        """The base figures, and with ``freeze_step: auto`` the detector's last statistic
        (``freeze_statistic``) and, once chosen, the last warmup step (``freeze_step``)."""
        out = super().metrics()
        if self.last_overlapped:
            out["overlapped"] = True
        if getattr(self.optimizer, "auto_freeze", False):
            if self.optimizer.freeze_statistic is not None:
                out["freeze_statistic"] = self.optimizer.freeze_statistic
            if self.optimizer.freeze_step is not None:
                out["freeze_step"] = self.optimizer.freeze_step
        return out


class OneBitLambStrategy(SelfSyncingDataParallel):
    """1-bit LAMB: averaged gradients up to ``freeze_step``, then none: the optimizer's step
    all-reduces its momentum in 1 bit (``momentum``)."""

    name = "onebit_lamb"


class OneBitAdamStrategy(SelfSyncingDataParallel):
    """1-bit Adam: averaged gradients up to ``freeze_step``, then none: the optimizer's step
    all-reduces its momentum in 1 bit (``momentum``)."""

    name = "onebit_adam"


# ---------------------------------------------------------------------- registry entries
def averaging(cls: type[DataParallel]):
    """Build function of a strategy that averages gradients (on every step, or on the
    steps its optimizer asks for) and, where its entry sends ``momentum`` traffic, lets the
    optimizer all-reduce its momentum through the policy's codec."""

    def build(args: BuildArgs) -> Strategy:
        comm, policy = args.comm, args.policy
        spec = strategy_spec(args.name)
        if (
            policy is not None
            and "momentum" in spec.traffic
            and (not comm.compression.is_default("momentum") or comm.hierarchy == "node")
        ):
            args.optimizer.set_codec(policy.codec("momentum"))
        # the gradient average's codec (the plain fp32 all-reduce by default)
        grad_codec = policy.codec("grad") if policy is not None else None
        strategy = cls.build(args, use_ddp=args.use_ddp, grad_codec=grad_codec)
        if comm.overlap and spec.overlap and args.ctx.world_size > 1:
            strategy.enable_overlap(comm.bucket_mb, args.clip_grad_norm)
        return strategy

    return build


SELF_SYNCING = dict(
    family="data_parallel",
    optimizer_hint="or strategy.name=auto",
    traffic=("grad", "momentum"),
    hierarchy=True,
)
"""The keys the entries of the self-syncing optimizers' strategies share (each runs only
the optimizer of its own name)."""


def _onebit(cls: type[SelfSyncingDataParallel], optimizer: str) -> StrategySpec:
    return StrategySpec(
        cls.name,
        averaging(cls),
        f"{optimizer}: averaged gradients in the warmup, then its compressed momentum",
        optimizers=(cls.name,),
        overlap=True,
        **SELF_SYNCING,
    )


register_strategy(
    StrategySpec(
        "data_parallel",
        averaging(DataParallel),
        "average full-precision gradients every step, then step the optimizer",
        family="data_parallel",
        traffic=("grad",),
        hierarchy=True,
    )
)
register_strategy(_onebit(OneBitLambStrategy, "1-bit LAMB"))
register_strategy(_onebit(OneBitAdamStrategy, "1-bit Adam"))
