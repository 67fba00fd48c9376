"""1-bit LAMB (Li et al., 2021): LAMB whose momentum is synchronised with 1-bit compression.

Steps ``1 .. freeze_step`` (warmup) are exactly LAMB on gradients the caller has averaged,
while recording an EMA ``c`` of every layer's trust ratio. At ``freeze_step`` the second
moment ``v`` freezes and a "fresh" copy starts. From then on (compression) the caller
does NOT all-reduce gradients (``syncs_internally`` is True): each rank folds its local
gradient into its momentum, and the momenta of all layers are averaged with one
error-compensated 1-bit all-reduce. Each layer's step is ``lr · c · f · u`` where the
factor ``f`` tracks how far the fresh second moment has drifted from the frozen one.
``freeze_step="auto"`` ends the warmup when ``v`` has settled
(:mod:`onebit_bert.optim.auto_freeze`).

Hyperparameter names match DeepSpeed's ``OneBitLamb`` so its JSON config maps one to one
(:meth:`OneBitLamb.from_deepspeed_config`).

**Refreshed coefficients** (``coeff_refresh > 0``, beyond the paper; off by default). The
frozen ``c`` keeps the warmup's trust ratio, while LAMB's own ratio ``‖w‖ / ‖u‖`` keeps
moving after the freeze (it grows when ‖m/√v‖ shrinks); a 1-bit LAMB step is then smaller
than LAMB's. At the steps :func:`refresh_due` names (the first ``coeff_refresh`` steps after
the freeze, then at intervals that double up to ``coeff_refresh_max``) the momentum is
averaged exactly (an fp32 all-reduce instead of the 1-bit one) and every layer's ``c`` is
reset so that ``c·f`` equals LAMB's clipped trust ratio of that exact momentum against the
frozen second moment: that step has LAMB's step norm, and ``f`` carries on from it. With
16 and 512 a 6,000-step run with the freeze at 800 refreshes 14 times. With the fused
kernels a refresh step folds and updates in them (the exact average in between) and takes
the parameters' norms in one more pass. It failed its pre-registered parity gate in
the stretched regime, where it needed more samples than the authors' algorithm
(docs/results/parity_long_refresh/README.md).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import multi_tensor, use_fused
from onebit_bert.kernels.multi_tensor import TableCache
from onebit_bert.optim import defaults
from onebit_bert.optim.auto_freeze import AutoFreezeConfig
from onebit_bert.optim.compressed import FUSED, WarmupThenCompress
from onebit_bert.optim.deepspeed import FromDeepSpeed, onebit_lamb_kwargs
from onebit_bert.optim.lamb import (
    begin_step,
    groups_with_grads,
    lamb_group_update,
    lamb_hyperparameters,
    trust_ratios,
    trust_ratios_from_norms,
    zero_moments,
)
from onebit_bert.optim.warmup_state import WarmupCheckpoint

NAME = "1-bit LAMB"


def refresh_due(since_freeze: int, first: int, longest: int) -> bool:
    """Whether compression step ``since_freeze`` (1 = the first after the freeze) refreshes
    the coefficients: steps ``first``, then every interval after the last, each twice the
    one before (from ``first``) up to ``longest``; never when ``first`` is 0."""
    if first <= 0 or since_freeze < first:
        return False
    point, interval = first, first
    while point < since_freeze:
        interval = min(2 * interval, longest)
        point += interval
    return point == since_freeze


def _foreach_max(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's maximum: ``torch._foreach_max`` where the running torch has it (from
    2.4 on, as far as its changelog shows), else one reduction per tensor (the same
    values: a maximum is exact)."""
    fused = getattr(torch, "_foreach_max", None)
    return list(fused(tensors)) if fused is not None else [t.max() for t in tensors]


class OneBitLamb(WarmupCheckpoint, FromDeepSpeed, WarmupThenCompress):
    """1-bit LAMB over the ranks of ``comm`` (default: the default process group, or a
    world of one when none exists).

    Args:
        lr, betas, eps, weight_decay, max_coeff, min_coeff: as in LAMB (decoupled weight
            decay; the bounds of the warmup trust ratio), checked and defaulted by
            :func:`~onebit_bert.optim.lamb.lamb_hyperparameters`.
        freeze_step: last step of the warmup stage (>= 1), or ``"auto"``: chosen when the
            second moment has settled (:mod:`onebit_bert.optim.auto_freeze`, bounded by
            ``auto_freeze`` and ``total_steps``).
        coeff_beta: EMA rate of the recorded trust ratio ``c``.
        factor_max, factor_min: bounds of the compression-stage factor ``f``.
        factor_threshold: largest relative change of ``f`` from one step to the next.
        comm: the :class:`Communicator` whose ranks share this model.
        bucket_numel: compress the momentum in buckets of at most this many elements
            (bounds the temporary memory of one all-reduce); ``None``: one bucket.
        auto_freeze, total_steps: with ``freeze_step="auto"``, the detector's settings and
            the run's length in steps (its bounds are fractions of it).
        coeff_refresh, coeff_refresh_max: refresh ``c`` from an exact momentum average at
            the steps :func:`refresh_due` names (0: never, the authors' algorithm).
        kernels: ``auto`` (the fused kernels on CUDA), ``reference`` or ``fused``
            (:mod:`onebit_bert.kernels`) for the compression stage: the fold, the 1-bit
            all-reduce's per-bucket work and the update; with the fused kernels the
            update reads the average from the servers' messages (:attr:`expand_in_update`;
            not with a codec set from the policy, nor on a refresh step). The warmup is
            LAMB's reference.

    After each step: ``stage`` ("warmup" or "compression"), ``last_trust_ratios`` (``r``
    in warmup, ``c·f`` in compression, one per layer), ``last_factors`` (``f``, or None in
    warmup), ``last_compression_error`` (‖this rank's worker error‖ / ‖the scaled momentum
    it compressed‖, or None in warmup), ``last_step_bytes`` and ``bytes_sent`` (this
    optimizer's traffic from this rank), ``last_refreshed`` (whether the last step refreshed
    the coefficients), ``last_step_kernels`` (the path the last compression step took:
    ``reference``, ``fused``, or ``fused, expanded in the update``).
    """

    NAME = NAME
    SECTION = "onebit"
    expand_in_update = True
    """With the fused kernels, fold beside the momentum (straight into the 1-bit worker's
    values) and read the 1-bit average from the servers' messages in the update
    (:meth:`_fold_and_compress`: 16 bytes per parameter fewer than a separate fold and
    expansion; an overlapped step folds each gradient so as it arrives,
    :meth:`_overlap_buffer`); False keeps those passes."""
    OTHER_STATE_HINT = "load LAMB states into LAMB"
    deepspeed_kwargs = staticmethod(onebit_lamb_kwargs)

    def __init__(
        self,
        params: Iterable,
        *,
        freeze_step: int | str = defaults.FREEZE_STEP,
        coeff_beta: float = defaults.COEFF_BETA,
        factor_max: float = defaults.FACTOR_MAX,
        factor_min: float = defaults.FACTOR_MIN,
        factor_threshold: float = defaults.FACTOR_THRESHOLD,
        comm: Communicator | None = None,
        bucket_numel: int | None = None,
        auto_freeze: AutoFreezeConfig | None = None,
        total_steps: int | None = None,
        kernels: str = "auto",
        coeff_refresh: int = 0,
        coeff_refresh_max: int = 512,
        **hyperparameters,
    ):
        group_defaults = lamb_hyperparameters(**hyperparameters)
        if coeff_refresh < 0 or (coeff_refresh > 0 and coeff_refresh_max < coeff_refresh):
            raise ValueError(
                f"coeff_refresh must be >= 0 (0: never) and coeff_refresh_max >= it, got "
                f"coeff_refresh={coeff_refresh}, coeff_refresh_max={coeff_refresh_max}"
            )
        self.coeff_refresh, self.coeff_refresh_max = coeff_refresh, coeff_refresh_max
        self._check_freeze_step(freeze_step)
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"coeff_beta must be in [0, 1), got {coeff_beta}")
        if not 0.0 < factor_min <= factor_max:
            raise ValueError(
                f"factor bounds need 0 < factor_min <= factor_max, got factor_min={factor_min}, "
                f"factor_max={factor_max}"
            )
        if not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"factor_threshold must be in [0, 1), got {factor_threshold}")
        group_defaults.update(
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, group_defaults, comm, bucket_numel, kernels)
        self._init_freeze(freeze_step, auto_freeze, total_steps)
        self._scratch: torch.Tensor | None = None
        self._tables = TableCache()
        self._full_masks: dict = {}
        self._segments_cache: tuple | None = None  # the blocks' buckets, on the device
        self._folded_plan: FoldedSquares | None = None  # overlapped steps' sums, per layout
        # the armed overlapped step folds into the worker's values and sums them there
        self._folded: FoldedSquares | None = None
        self.last_trust_ratios: torch.Tensor | None = None
        self.last_factors: torch.Tensor | None = None
        self.last_refreshed = False
        self.last_step_kernels: str | None = None

    def _on_new_flat(self, flat: torch.Tensor) -> None:
        self._scratch = torch.zeros_like(flat)  # its padding is compressed as zeros

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = begin_step(self, closure, NAME)
        self._step += 1
        if self.freeze_step is None or self._step <= self.freeze_step:
            self._warmup_step()
        else:
            self._compression_step()
        return loss

    def _warmup_step(self) -> None:
        ratios = []
        for group, params in groups_with_grads(self):
            for p in params:
                if zero_moments(self.state[p], p):
                    self.state[p]["lamb_coeff"] = torch.zeros((), device=p.device)
            r = lamb_group_update(
                group, params, [self.state[p] for p in params], self._step, bias_correction=False
            )
            coeffs = [self.state[p]["lamb_coeff"] for p in params]
            c = torch.stack(coeffs)
            cb = group["coeff_beta"]
            torch._foreach_copy_(coeffs, list(torch.where(r != 1.0, cb * c + (1 - cb) * r, c)))
            ratios.append(r)
        self._observe_warmup(self._states_with("exp_avg_sq"))
        if self._step == self.freeze_step:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self.state[p]["exp_avg_sq_fresh"] = self.state[p]["exp_avg_sq"].clone()
        self.last_trust_ratios = torch.cat(ratios) if ratios else None
        self.last_factors = None
        self.last_compression_error = None
        self.last_step_bytes = 0

    def _compression_step(self) -> None:
        layout = self._layout("exp_avg", f"after freeze_step={self.freeze_step}")
        members = [p for _, ps in layout for p in ps]
        if not members:
            return
        flat = self._fused(members, "exp_avg")
        previous = self._scratch
        refresh = self._refresh_due(self._step)
        overlapped = self._take_overlapped()
        signs = None
        if overlapped is not None:  # folded and all-reduced during the backward pass
            overlapped.finish()
            signs = overlapped.signs
            self._folded = None
        else:
            self._prepare_compression(members, flat)
            if not refresh and self._expands_in_update(layout):
                signs = self._fold_and_compress(layout)
        if overlapped is None and signs is None:
            for group, params in layout:
                if params:
                    self._fold_for_compression(group, params)
            if refresh:
                self._exact_all_reduce(flat, "momentum")
            else:
                self._compressed_all_reduce(flat, "momentum")

        ratios, factors, offset = [], [], 0
        for group, params in layout:
            if not params:
                continue
            if signs is not None:
                factor, trust = self._update_from_signs(group, params, signs, offset)
            elif self._fits(params):
                factor, trust = self._fused_compressed_update(
                    group, params, previous, offset, refresh
                )
            else:
                factor, trust = self._compressed_update(group, params, previous, offset, refresh)
            factors.append(factor)
            ratios.append(trust)
            offset += sum(p.numel() for p in params)
        self.last_factors = torch.cat(factors)
        self.last_trust_ratios = torch.cat(ratios)
        self.last_refreshed = refresh
        self.last_step_kernels = (
            "reference"
            if not all(self._fits(params) for _, params in layout if params)
            else "fused, expanded in the update"
            if signs is not None
            else "fused"
        )

    def _refresh_due(self, step: int) -> bool:
        """Whether compression step ``step`` refreshes the coefficients."""
        if self.freeze_step is None:
            return False
        return refresh_due(step - self.freeze_step, self.coeff_refresh, self.coeff_refresh_max)

    def _exact_all_reduce(self, flat: torch.Tensor, kind: str) -> None:
        """Average ``flat`` over ranks exactly (fp32), filed as traffic ``kind``; the
        compression errors wait for the next compressed step."""
        before = self.comm.snapshot()
        with self.comm.traffic(kind):
            self.comm.all_reduce(flat[: self._flat_numel], op="avg")
        self.last_compression_error = None
        self.last_step_bytes = (self.comm.snapshot() - before).bytes_sent
        self.bytes_sent += self.last_step_bytes

    def _next_step_overlaps(self) -> bool:
        return (
            self.syncs_internally
            and self._codec_overlaps()
            and not self._refresh_due(self._step + 1)
        )

    def _prepare_compression(self, members: list[torch.Tensor], flat: torch.Tensor) -> None:
        for p in members:
            st = self.state[p]
            if "exp_avg_sq_fresh" not in st:  # freeze_step moved past a saved run's step
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
        if "scaling_coeff" not in self.state[members[0]]:
            # Momenta are identical on all ranks here (warmup averaged the gradients).
            self._set_scaling_coefficients(members, "exp_avg")
            for p in members:
                self.state[p].setdefault("last_factor", torch.ones((), device=p.device))

    def _fold_for_compression(
        self, group: dict, params: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> None:
        """Keep each momentum before the step (the scratch buffer, same layout as the
        fused one), then ``m = β1·m + (1-β1)·g`` (``g`` times ``grad_scale`` when given)
        and the scaling coefficient; in one kernel where the group fits
        (:meth:`_fused_fold`: also for the overlapped steps' folds, parameter by
        parameter, and beside the momentum where the update reads the messages)."""
        if self._fused_fold(group, params, grad_scale):
            return
        beta1 = group["betas"][0]
        momenta = [self.state[p]["exp_avg"] for p in params]
        for m in momenta:
            offset = self._flat_offset(m)
            self._scratch[offset : offset + m.numel()].copy_(m.view(-1))
        grads = self._gradients(params, grad_scale)
        torch._foreach_mul_(momenta, beta1)
        torch._foreach_add_(momenta, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(momenta, [self.state[p]["scaling_coeff"] for p in params])

    def _compressed_update(self, group, params, previous, offset, refresh=False):
        beta1, beta2 = group["betas"]
        eps, wd, lr = group["eps"], group["weight_decay"], group["lr"]
        states = [self.state[p] for p in params]
        momenta = [st["exp_avg"] for st in states]
        torch._foreach_div_(momenta, [st["scaling_coeff"] for st in states])
        self._apply_masks(params, momenta)
        # Reconstructed global gradient g~ = (m - β1·m_prev) / (1-β1), in the scratch buffer.
        grad_est = self._views(previous, params, offset)
        torch._foreach_mul_(grad_est, -beta1)
        torch._foreach_add_(grad_est, momenta)
        torch._foreach_div_(grad_est, 1.0 - beta1)
        fresh = [st["exp_avg_sq_fresh"] for st in states]
        torch._foreach_mul_(fresh, beta2)
        torch._foreach_addcmul_(fresh, grad_est, grad_est, value=1.0 - beta2)

        denom = torch._foreach_sqrt([st["exp_avg_sq"] for st in states])
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(momenta, denom)
        denom_fresh = torch._foreach_sqrt(fresh)
        torch._foreach_add_(denom_fresh, eps)
        torch._foreach_div_(denom, denom_fresh)  # denom now holds the per-element drift
        del denom_fresh
        factor = torch.stack(_foreach_max(denom)).float()
        del denom
        norms = None
        if wd != 0.0:
            norm_plain = torch.stack(torch._foreach_norm(update)).float()
            torch._foreach_add_(update, params, alpha=wd)
            norm_decayed = torch.stack(torch._foreach_norm(update)).float()
            norms = (norm_plain, norm_decayed)
        factor, trust = self._factor_and_trust(group, states, factor, norms)
        if refresh:  # c·f becomes LAMB's trust ratio of the exact momentum
            ratio = trust_ratios(params, update, group["min_coeff"], group["max_coeff"])
            trust = _refreshed_trust(states, ratio, factor)
        torch._foreach_mul_(update, list((trust * -lr).unbind(0)))
        torch._foreach_add_(params, update)
        return factor, trust

    def _factor_and_trust(self, group, states, factor, norms):
        """The factor ``f`` from the largest drift per layer (and, with weight decay, the
        norms of the update without and with it), bounded and rate-limited against the
        last one, which it replaces; and the trust ratio ``c·f``."""
        if norms is not None:
            norm_plain, norm_decayed = norms
            rho = torch.where(
                norm_decayed > 0,
                (norm_plain / norm_decayed).clamp(max=1.0),
                torch.ones_like(norm_plain),
            )
            factor = factor * rho + (1.0 - rho)
        factor = factor.clamp(group["factor_min"], group["factor_max"])
        last = torch.stack([st["last_factor"] for st in states])
        threshold = group["factor_threshold"]
        factor = torch.minimum(
            torch.maximum(factor, last * (1.0 - threshold)), last * (1.0 + threshold)
        )
        torch._foreach_copy_([st["last_factor"] for st in states], list(factor.unbind(0)))
        trust = torch.stack([st["lamb_coeff"] for st in states]) * factor
        return factor, trust

    # ------------------------------------------------------------------ fused kernels
    def _fits(self, params: list[torch.Tensor]) -> bool:
        """Whether this group's compression step runs in the fused kernels."""
        if not use_fused(self._device, self.kernels):
            return False
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        return multi_tensor.fits(
            params,
            grads,
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [st["exp_avg_sq_fresh"] for st in states],
        )

    def _flat_offset(self, state: torch.Tensor) -> int:
        """Where ``state`` (a view of the fused buffer) starts in it, in elements."""
        return (state.data_ptr() - self._flat.data_ptr()) // state.element_size()

    def _fused_fold(
        self, group: dict, params: list[torch.Tensor], grad_scale: torch.Tensor | None = None
    ) -> bool:
        """:meth:`_fold_for_compression` in one kernel; in an overlapped step that reads
        the average in the update (armed with :class:`FoldedSquares`) each parameter's
        folded momentum goes into the 1-bit worker's values instead, the momentum stays
        and the worker's sums are made (:meth:`_fold_summing`). False where it does not
        apply."""
        if not self._fits(params):
            return False
        if self._folded is not None:
            for p in params:  # each with its bucket-cut blocks, their sums in place
                self._fold_summing(group, p, grad_scale)
            return True
        states = [self.state[p] for p in params]
        momenta = [st["exp_avg"] for st in states]
        arguments = (
            self._tables.table(params),
            self._gradients(params, None),
            momenta,
            self._views(self._scratch, params, self._flat_offset(momenta[0])),
        )
        coeffs, beta1 = torch.stack([st["scaling_coeff"] for st in states]), group["betas"][0]
        multi_tensor.onebit_fold(*arguments, coeffs, beta1, grad_scale)
        return True

    def _fold_summing(self, group: dict, p: torch.Tensor, grad_scale) -> None:
        """An overlapped step's fold of ``p`` beside its momentum, with the worker's values
        written over its stored ones and their sums over ``p``'s blocks written to their
        places among the step's (:class:`FoldedSquares`), so that the 1-bit worker takes
        its bucket's values and sums from there (:meth:`_bucket_squares`) instead of a
        pass of its own."""
        folded = self._folded
        st = self.state[p]
        start = self._flat_offset(st["exp_avg"])
        table, first = folded.place(p)
        multi_tensor.onebit_fold_compensated(
            table,
            self._gradients([p], None),
            [st["exp_avg"]],
            self._views(folded.feedback.worker_values, [p], start),
            [start],
            folded.feedback.worker_scale,
            folded.step,
            st["scaling_coeff"].reshape(1),
            group["betas"][0],
            grad_scale,
            out=folded.slices(first, table.blocks),
        )

    def _bucket_squares(self, index: int) -> torch.Tensor | None:
        return None if self._folded is None else self._folded.bucket(index)

    def _fused_compressed_update(self, group, params, previous, offset, refresh=False):
        """:meth:`_compressed_update` in two passes of fused kernels (a refresh step also
        takes the parameters' norms)."""
        states = [self.state[p] for p in params]
        momenta = [st["exp_avg"] for st in states]
        second = [st["exp_avg_sq"] for st in states]
        for p, m in zip(params, momenta, strict=True):
            mask = self._masks.get(p)
            if mask is not None:
                m.mul_(mask)  # masking before unscaling: the same bits (the mask is 0 or 1)
        table = self._tables.table(params)
        measured = multi_tensor.onebit_measure(
            table,
            momenta,
            self._views(previous, params, offset),
            [st["exp_avg_sq_fresh"] for st in states],
            second,
            params,
            torch.stack([st["scaling_coeff"] for st in states]),
            **self._measure_settings(group),
            norms=refresh,
        )
        return self._fused_step(group, states, table, params, measured, refresh)

    # ------------------------------------------------- fused, expanded in the update
    def _overlap_buffer(self, layout, flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """An overlapped step that can read the average in the update folds each gradient
        beside the momentum, into the 1-bit worker's values (:meth:`_fold_summing`), and
        the codec compresses those and leaves the average unexpanded (the buffer it is
        handed, the scratch buffer, is then neither read nor written); otherwise the
        fused buffer, as the base class does."""
        self._folded = None
        if self._expands_in_update(layout):
            feedback = self.codec.fused_feedback(FUSED, self._flat_numel)
            step, buckets = feedback.buckets[0].size, len(feedback.buckets)
            params = [p for _, ps in layout for p in ps]
            key = (tuple(id(p) for p in params), step, buckets)
            if self._folded_plan is None or self._folded_plan.key != key:
                starts = [self._flat_offset(self.state[p]["exp_avg"]) for p in params]
                tables = [
                    self._bucket_table([p], start, step)
                    for p, start in zip(params, starts, strict=True)
                ]
                self._folded_plan = FoldedSquares(key, params, tables, starts, step, buckets)
            self._folded = self._folded_plan
            self._folded.feedback = feedback
            return self._scratch, True
        return flat, False

    def _expands_in_update(self, layout) -> bool:
        """Whether this compression step folds beside the momentum and expands the 1-bit
        average inside the update (:meth:`_fold_and_compress`): every group in the fused
        kernels, and this optimizer's own codec able to leave the expansion to it."""
        return (
            self.expand_in_update
            and self._own_codec
            and getattr(self.codec, "expands_later", False)
            and all(self._fits(params) for _, params in layout if params)
        )

    def _bucket_table(self, params, start: int, step: int):
        """The kernels' table of ``params`` (from element ``start`` of the fused buffer)
        with a block boundary at every bucket boundary."""
        numel = sum(p.numel() for p in params)
        first = start // step + 1
        cuts = [k * step - start for k in range(first, -(-(start + numel) // step))]
        return self._tables.table(params, cuts)

    def _fold_and_compress(self, layout):
        """The fold and the 1-bit average in two passes fewer than :meth:`_fused_fold`
        and the codec's: ``x = (β1·m + (1-β1)·g)·c`` plus the worker's error is written
        over the worker's stored values (:func:`~onebit_bert.kernels.multi_tensor.
        onebit_fold_compensated`), the momentum stays where it is (the update reads it as
        the old one), the worker's sums come out of the same pass, and the average comes
        back as the servers' messages (:class:`~onebit_bert.distributed.codecs.onebit.
        GatheredSigns`) for :meth:`_update_from_signs` to read."""
        feedback = self.codec.fused_feedback(FUSED, self._flat_numel)
        step = feedback.buckets[0].size
        inputs, values, sizes, placed = [], [], [], []
        for group, params in layout:
            if not params:
                continue
            states = [self.state[p] for p in params]
            momenta = [st["exp_avg"] for st in states]
            start = self._flat_offset(momenta[0])
            table = self._bucket_table(params, start, step)
            part_x, part_v, part_abs = multi_tensor.onebit_fold_compensated(
                table,
                self._gradients(params, None),
                momenta,
                self._views(feedback.worker_values, params, start),
                [start + at for at in _starts(params)],
                feedback.worker_scale,
                step,
                torch.stack([st["scaling_coeff"] for st in states]),
                group["betas"][0],
            )
            inputs.append(part_x)
            values.append(part_v)
            sizes.append(part_abs)
            placed.append((table, start))
        segments = self._bucket_segments(placed, step, len(feedback.buckets))
        per_bucket = torch.stack(
            [multi_tensor.segment_sums(torch.cat(parts), *segments) for parts in (values, sizes)]
        )
        before = self.comm.snapshot()
        with self.comm.traffic("momentum"):
            signs, error = self.codec.average_signs(
                self._scratch, self._flat_numel, FUSED, per_bucket, torch.cat(inputs).sum()
            )
        self.last_compression_error = error
        self.last_step_bytes = (self.comm.snapshot() - before).bytes_sent
        self.bytes_sent += self.last_step_bytes
        return signs

    def _bucket_segments(self, placed, step: int, buckets: int):
        """Where each bucket's blocks start among the concatenated block partials of the
        tables in ``placed`` (``(table, start in the fused buffer)``, in buffer order) and
        how many there are, on the device; computed once per layout (a BERT-Large step has
        about 164,000 blocks)."""
        key = (tuple((id(table), start) for table, start in placed), step, buckets)
        cached = self._segments_cache
        if cached is None or cached[0] != key:
            ids = [(start + at) // step for table, start in placed for at in table.block_positions]
            first, count = _segments(ids, buckets)
            device = placed[0][0].device
            segments = (
                multi_tensor.to_device(first, device),
                multi_tensor.to_device(count, device),
            )
            # the tables are kept with their ids, so that no other table takes one of them
            cached = (key, segments, [table for table, _ in placed])
            self._segments_cache = cached
        return cached[1]

    def _update_from_signs(self, group, params, signs, offset):
        """:meth:`_fused_compressed_update` reading the averaged momentum from ``signs``
        (the old momentum from where it still is) instead of an expanded buffer."""
        states = [self.state[p] for p in params]
        momenta = [st["exp_avg"] for st in states]
        second = [st["exp_avg_sq"] for st in states]
        table = self._bucket_table(params, offset, signs.step)
        measured = multi_tensor.onebit_measure_signs(
            table,
            momenta,
            [st["exp_avg_sq_fresh"] for st in states],
            second,
            params,
            [self._full_mask(p) for p in params],
            [offset + at for at in _starts(params)],
            signs,
            torch.stack([st["scaling_coeff"] for st in states]),
            **self._measure_settings(group),
        )
        return self._fused_step(group, states, table, params, measured)

    def _measure_settings(self, group: dict) -> dict:
        """The measuring kernels' settings for ``group``."""
        beta1, beta2 = group["betas"]
        return dict(
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            mask_untrained=self.mask_untrained,
        )

    def _fused_step(self, group, states, table, params, measured, refresh=False):
        """From a measuring kernel's ``(largest drift, norm of u, norm of u + wd·w)``: the
        factor and trust ratio (:meth:`_factor_and_trust`; on a refresh step ``c`` set so
        that ``c·f`` is LAMB's trust ratio, as :meth:`_compressed_update` sets it), then the
        step in one kernel."""
        factor, norm_plain, norm_decayed = measured
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        norms = None if wd == 0.0 else (norm_plain, norm_decayed)
        factor, trust = self._factor_and_trust(group, states, factor, norms)
        if refresh:
            w_norm = torch.stack(torch._foreach_norm(params)).float()
            ratio = trust_ratios_from_norms(
                w_norm, norm_decayed, group["min_coeff"], group["max_coeff"]
            )
            trust = _refreshed_trust(states, ratio, factor)
        momenta = [st["exp_avg"] for st in states]
        second = [st["exp_avg_sq"] for st in states]
        multi_tensor.scaled_step(table, params, momenta, second, trust * -lr, eps, wd)
        return factor, trust

    def _full_mask(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s momentum mask at ``p``'s shape (contiguous fp32), or None."""
        mask = self._masks.get(p)
        if mask is None:
            return None
        full = self._full_masks.get(p)
        if full is None or full[0] is not mask:
            full = self._full_masks[p] = (mask, mask.expand_as(p).contiguous())
        return full[1]


class FoldedSquares:
    """Where an overlapped step's folds, one parameter at a time, put the 1-bit worker's
    sums: each parameter's blocks (cut at the bucket boundaries) have their place in one
    table of block sums, in buffer order, as :meth:`OneBitLamb._fold_and_compress` lays
    out its own; a bucket's sums are its blocks', added in block order (:meth:`bucket`).
    Built once per layout; ``feedback`` (the worker's stored values and pending scales)
    is set each step."""

    def __init__(self, key, params, tables, starts, step: int, buckets: int):
        self.key = key
        self.step = step
        self.feedback = None
        self._places, ids, first = {}, [], 0
        for p, table, start in zip(params, tables, starts, strict=True):
            self._places[id(p)] = (table, first)
            ids.extend((start + at) // step for at in table.block_positions)
            first += table.blocks
        device = params[0].device
        self.sums = torch.empty(3, first, dtype=torch.float32, device=device)
        """Per block, row 0: the sum of ``x²``; row 1: of the values' squares
        (``(x + worker error)²``); row 2: of their sizes."""
        starts_, counts = _segments(ids, buckets)
        rows = [[at + row * first for row in range(3)] for at in starts_]
        self._first = multi_tensor.to_device([v for three in rows for v in three], device)
        self._count = multi_tensor.to_device([c for c in counts for _ in range(3)], device)

    def place(self, p: torch.Tensor):
        """``p``'s block table and where its blocks' sums start."""
        return self._places[id(p)]

    def slices(self, first: int, blocks: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.sums[row, first : first + blocks] for row in range(3))

    def bucket(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s sums of ``x²``, of the values' squares and of their sizes
        (three values), in one launch."""
        three = slice(3 * index, 3 * index + 3)
        return multi_tensor.segment_sums(self.sums.view(-1), self._first[three], self._count[three])


def _refreshed_trust(states: list[dict], ratio: torch.Tensor, factor: torch.Tensor):
    """A refresh step's trust ratios: each layer's ``c`` set to ``ratio / f`` (LAMB's
    trust ratio over the factor), so that ``c·f`` is LAMB's."""
    coeffs = [st["lamb_coeff"] for st in states]
    torch._foreach_copy_(coeffs, list((ratio / factor).unbind(0)))
    return torch.stack(coeffs) * factor


def _segments(ids: list[int], n: int) -> tuple[list[int], list[int]]:
    """For sorted ``ids``: where each of ``0 .. n-1`` first occurs and how often."""
    first, count = [0] * n, [0] * n
    for at, i in enumerate(ids):
        if count[i] == 0:
            first[i] = at
        count[i] += 1
    return first, count


def _starts(params: list[torch.Tensor]) -> list[int]:
    """Where each of ``params`` starts in their concatenation."""
    starts, at = [], 0
    for p in params:
        starts.append(at)
        at += p.numel()
    return starts
