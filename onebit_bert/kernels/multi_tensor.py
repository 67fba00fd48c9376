"""LAMB's and 1-bit LAMB's updates as multi-tensor Triton kernels: every tensor of a
parameter group in one launch per pass, the per-tensor norms from block partials.

LAMB (:func:`lamb_step`) in three launches and a few on one value per tensor: the moments
and the blocks' sums of ``w²`` and ``u²`` (one pass: reads ``g, m, v, w``, writes ``m,
v``), the per-tensor sums, the trust ratios as the reference computes them from the norms
(:func:`onebit_bert.optim.lamb.trust_ratios_from_norms`), and the step ``w += -lr·r·u``
with ``u`` recomputed from ``m, v, w`` (reads 3, writes 1) instead of stored: 40 bytes
per fp32 parameter against 28 for the least any LAMB step moves.

1-bit LAMB's compression step: :func:`onebit_fold_compensated` (the folded, scaled
momentum plus the worker's error written over the worker's stored values, with the
worker's sums: one pass), the 1-bit all-reduce (:mod:`onebit_bert.kernels.signs`: the
worker's signs of those values, the server's one pass) without its expansion, then
:func:`onebit_measure_signs` (the average read from the servers' messages, unscaled and
masked over the old momentum, the fresh second moment updated, the blocks' largest drift
and, with weight decay, the two norms of the update: one pass), the per-tensor reductions,
the factor as the reference computes it, and :func:`scaled_step`: 68.6 bytes per fp32
parameter at one rank against a floor of 56.5. With the fold and the expansion as passes
of their own (:func:`onebit_fold`, the codec's expansion, :func:`onebit_measure`) it moves
16 more.

The tensors are addressed through tables of pointers (:class:`TensorTable`): every
tensor must be contiguous fp32 on one device; the optimizers fall back to the reference
for a group where one is not.
"""

from __future__ import annotations

import torch

from onebit_bert.kernels import COMPILE_OPTIONS, triton_module

BLOCK = 2048
"""Elements per program of the element-wise passes."""
REDUCE_BLOCK = 1024
"""Block partials one program of the per-tensor reduction reads at a time."""
MAX_RUNS = 8
"""The most launches one element-wise pass is split into by its tensors' alignment."""


def fits(*lists: list[torch.Tensor]) -> bool:
    """Whether every tensor can go through the kernels: contiguous fp32 on one device."""
    devices = set()
    for tensors in lists:
        for t in tensors:
            if t.dtype != torch.float32 or not t.is_contiguous():
                return False
            devices.add(t.device)
    return len(devices) == 1


POINTER_ARGUMENTS = {
    "params": "p_ptrs",
    "grads": "g_ptrs",
    "exp_avg": "m_ptrs",
    "exp_avg_sq": "v_ptrs",
    "exp_avg_sq_fresh": "fresh_ptrs",
    "previous": "prev_ptrs",
    "worker_error": "e_ptrs",
    "masks": "mask_ptrs",
}
"""Each operand's role (its pointer table is cached by role) -> the kernels' argument."""


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` without making the host wait (through
    pinned memory on CUDA, which torch keeps alive until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class TensorTable:
    """The block table of a list of tensors (their sizes, in order) and the pointer tables
    of the operands that share that layout (parameters, gradients, moments), each rebuilt
    only when an address changes.

    A block covers at most ``block`` elements of one tensor. ``cuts``: positions in the
    tensors' concatenation where a block must also end (the bucket boundaries of a
    compressed buffer), so that every block lies inside one bucket.

    :meth:`launch` runs a pass as one launch per run of consecutive tensors that agree on
    16-byte accesses (:meth:`runs`), so that a tensor that does not allow them (one whose
    size is not a multiple of 4, or a gradient DDP's bucket view places 8 bytes off) takes
    them from no other."""

    def __init__(self, tensors: list[torch.Tensor], block: int = BLOCK, cuts=()):
        self.device = tensors[0].device
        self.block = block
        numels = [t.numel() for t in tensors]
        self.count = len(numels)
        self.cuts = tuple(cuts)
        tensor_of, starts, ends, first, counts, positions = [], [], [], [], [], []
        pending = sorted(self.cuts)
        origin = 0
        for i, n in enumerate(numels):
            first.append(len(starts))
            start = 0
            while True:
                end = min(start + block, n)
                while pending and pending[0] <= origin + start:
                    pending.pop(0)
                if pending and origin + start < pending[0] < origin + end:
                    end = pending[0] - origin
                tensor_of.append(i)
                starts.append(start)
                ends.append(end)
                positions.append(origin + start)
                start = end
                if start >= n:
                    break
            counts.append(len(starts) - first[-1])
            origin += n
        self.blocks = len(starts)
        self._first = first
        self._tensor_blocks_aligned = [
            all(starts[b] % 4 == 0 and ends[b] % 4 == 0 for b in range(f, f + c))
            for f, c in zip(first, counts, strict=True)
        ]
        """Per tensor: whether its blocks start and end at multiples of 4 elements."""
        self.blocks_aligned = all(self._tensor_blocks_aligned)
        """Whether every block starts and ends at a multiple of 4 elements (16 bytes)."""
        self.block_positions = positions
        """Where each block starts in the tensors' concatenation (on the host)."""
        self.block_tensor = to_device(tensor_of, self.device)
        self.block_start = to_device(starts, self.device)
        self.block_end = to_device(ends, self.device)
        self.first_block = to_device(first, self.device)
        self.block_count = to_device(counts, self.device)
        self._sizes = numels
        self._pointers: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._aligned: dict[str, list[bool]] = {}
        """Per operand role, per tensor: whether its address is a multiple of 16 bytes."""

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        return [t.numel() for t in tensors] == self._sizes

    def pointers(self, role: str, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """The addresses of ``tensors`` (laid out as this table's; 0 for None) on the
        device."""
        addresses = [0 if t is None else t.data_ptr() for t in tensors]
        self._aligned[role] = [a % 16 == 0 for a in addresses]
        return self.values(role, addresses)

    def runs(self, roles) -> list[tuple[int, int, bool]]:
        """The launches that cover every block for operands of ``roles`` (whose pointers
        were last set): ``(first block, blocks, aligned)`` for each run of consecutive
        tensors that agree on whether 16-byte accesses are safe (every operand's address a
        multiple of 16 bytes, every block's bounds a multiple of 4 elements). A tensor
        misaligned among aligned ones (a gradient that DDP's bucket view places 8 bytes
        off, say) then costs the others nothing; past :data:`MAX_RUNS` runs, one launch
        without 16-byte accesses."""
        flags = [
            blocks and all(self._aligned[role][t] for role in roles)
            for t, blocks in enumerate(self._tensor_blocks_aligned)
        ]
        heads = [t for t in range(self.count) if t == 0 or flags[t] != flags[t - 1]]
        bounds = [self._first[t] for t in heads] + [self.blocks]  # each run's first block
        runs = [(a, b - a, flags[t]) for t, a, b in zip(heads, bounds, bounds[1:], strict=False)]
        if len(runs) > MAX_RUNS:
            return [(0, self.blocks, False)]
        return runs

    def values(self, role: str, values: list[int]) -> torch.Tensor:
        """``values`` (one int per tensor) as an int64 tensor on the device, copied only
        when they change."""
        key = tuple(values)
        cached = self._pointers.get(role)
        if cached is None or cached[0] != key:
            cached = (key, to_device(list(key), self.device))
            self._pointers[role] = cached
        return cached[1]

    def partials(self) -> torch.Tensor:
        return torch.empty(self.blocks, dtype=torch.float32, device=self.device)

    def reduce(self, partial: torch.Tensor, maximum: bool = False) -> torch.Tensor:
        """Per tensor, the sum (or maximum) of its blocks' partials, in block order."""
        out = torch.empty(self.count, dtype=torch.float32, device=self.device)
        triton_module("multi_tensor").segment_reduce[(self.count,)](
            self.first_block,
            self.block_count,
            partial,
            out,
            MAX=maximum,
            BLOCK=REDUCE_BLOCK,
            **COMPILE_OPTIONS,
        )
        return out

    def launch(self, kernel: str, operands: dict[str, list[torch.Tensor]], **arguments) -> None:
        """Kernel ``kernel`` of ``triton_src/multi_tensor.py`` over this table's blocks: the
        block table, each operand's pointer table (keyed by role, :data:`POINTER_ARGUMENTS`)
        and the kernel's other ``arguments``."""
        pointers = {POINTER_ARGUMENTS[role]: self.pointers(role, t) for role, t in operands.items()}
        fn = getattr(triton_module("multi_tensor"), kernel)
        # 16-byte accesses on each run of tensors whose operands and blocks all allow them
        for first, blocks, aligned in self.runs(operands):
            fn[(blocks,)](
                block_tensor=self.block_tensor,
                block_start=self.block_start,
                block_end=self.block_end,
                block0=first,
                ALIGNED=aligned,
                BLOCK=self.block,
                **pointers,
                **arguments,
                **COMPILE_OPTIONS,
            )


class TableCache:
    """One :class:`TensorTable` per list of parameters (by identity and sizes) and cuts."""

    def __init__(self):
        self._tables: dict[tuple, TensorTable] = {}

    def table(self, params: list[torch.Tensor], cuts=()) -> TensorTable:
        key = (tuple(id(p) for p in params), tuple(cuts))
        table = self._tables.get(key)
        if table is None or not table.matches(params) or table.device != params[0].device:
            table = self._tables[key] = TensorTable(params, cuts=cuts)
        return table


def _bias(step: int, beta1: float, beta2: float, bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1**step, (1.0 - beta2**step) ** 0.5


def _decay(name: str, beta: float) -> dict[str, float]:
    """A moment's decay ``β`` and ``1 - β`` under the kernels' names (``beta1``, ``beta2``)."""
    return {name: beta, f"one_minus_{name}": 1.0 - beta}


def lamb_step(
    table: TensorTable,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
    ratios_from_norms,
) -> torch.Tensor:
    """One LAMB step (:func:`onebit_bert.optim.lamb.lamb_update`'s arithmetic); returns the
    trust ratios, from ``ratios_from_norms(w_norm, u_norm)``."""
    bc1, bc2_sqrt = _bias(step, beta1, beta2, bias_correction)
    part_w, part_u = table.partials(), table.partials()
    table.launch(
        "lamb_measure",
        {"params": params, "grads": grads, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs},
        part_w=part_w,
        part_u=part_u,
        **_decay("beta1", beta1),
        **_decay("beta2", beta2),
        eps=eps,
        bc1=bc1,
        bc2_sqrt=bc2_sqrt,
        wd=weight_decay,
        BIAS=bias_correction,
        WD=weight_decay != 0.0,
    )
    ratios = ratios_from_norms(table.reduce(part_w).sqrt(), table.reduce(part_u).sqrt())
    scaled_step(
        table, params, exp_avgs, exp_avg_sqs, ratios * -lr, eps, weight_decay, bc1, bc2_sqrt
    )
    return ratios


def scaled_step(
    table: TensorTable,
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    coef: torch.Tensor,
    eps: float,
    weight_decay: float,
    bc1: float = 1.0,
    bc2_sqrt: float = 1.0,
) -> None:
    """``w += coef[t] · (m/(sqrt(v)+eps) + wd·w)`` for every tensor ``t`` (bias corrected
    unless both corrections are 1)."""
    table.launch(
        "scaled_step",
        {"params": params, "exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs},
        coef=coef.float().contiguous(),
        eps=eps,
        bc1=bc1,
        bc2_sqrt=bc2_sqrt,
        wd=weight_decay,
        BIAS=(bc1, bc2_sqrt) != (1.0, 1.0),
        WD=weight_decay != 0.0,
    )


def onebit_fold(
    table: TensorTable,
    grads: list[torch.Tensor],
    momenta: list[torch.Tensor],
    previous: list[torch.Tensor],
    coeffs: torch.Tensor,
    beta1: float,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """``previous = m``; ``m = (β1·m + (1-β1)·g·grad_scale) · coeffs[t]``."""
    table.launch(
        "onebit_fold",
        {"grads": grads, "exp_avg": momenta, "previous": previous},
        coeffs=coeffs,
        grad_scale=grad_scale.float() if grad_scale is not None else coeffs,
        **_decay("beta1", beta1),
        HAS_SCALE=grad_scale is not None,
    )


def onebit_measure(
    table: TensorTable,
    momenta: list[torch.Tensor],
    previous: list[torch.Tensor],
    fresh: list[torch.Tensor],
    second: list[torch.Tensor],
    params: list[torch.Tensor],
    coeffs: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mask_untrained: bool,
    norms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per tensor: the largest drift, and with weight decay (or ``norms``) the norms of
    ``u`` and of ``u + wd·w`` (else None); the momentum unscaled and masked, the fresh
    second moment updated."""
    operands = {
        "exp_avg": momenta,
        "previous": previous,
        "exp_avg_sq_fresh": fresh,
        "exp_avg_sq": second,
        "params": params,
    }
    settings = dict(
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, mask_untrained=mask_untrained
    )
    return _measured(table, "onebit_measure", operands, settings, norms, coeffs=coeffs)


def _measured(
    table: TensorTable,
    kernel: str,
    operands: dict,
    settings: dict,
    norms: bool = False,
    **arguments,
):
    """Launch one of the 1-bit update's measuring kernels (``settings``: ``beta1``,
    ``beta2``, ``eps``, ``weight_decay``, ``mask_untrained``) and reduce its block partials:
    per tensor the largest drift and, with weight decay or ``norms``, the two norms (else
    None)."""
    drift, part_u, part_ud = table.partials(), table.partials(), table.partials()
    with_decay = settings["weight_decay"] != 0.0 or norms
    table.launch(
        kernel,
        operands,
        part_drift=drift,
        part_u=part_u,
        part_ud=part_ud,
        neg_beta1=-settings["beta1"],
        one_minus_beta1=1.0 - settings["beta1"],
        **_decay("beta2", settings["beta2"]),
        eps=settings["eps"],
        wd=settings["weight_decay"],
        MASK_UNTRAINED=settings["mask_untrained"],
        WD=with_decay,
        **arguments,
    )
    largest = table.reduce(drift, maximum=True)
    if not with_decay:
        return largest, None, None
    return largest, table.reduce(part_u).sqrt(), table.reduce(part_ud).sqrt()


def onebit_fold_compensated(
    table: TensorTable,
    grads: list[torch.Tensor],
    momenta: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    pending: torch.Tensor,
    step: int,
    coeffs: torch.Tensor,
    beta1: float,
    grad_scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 1-bit worker's values ``v = x + e`` written over ``values`` (each tensor's slice
    of the worker's stored values, :class:`~onebit_bert.distributed.codecs.compression.
    ErrorFeedback`), where ``x = (β1·m + (1-β1)·g·grad_scale) · coeffs[t]`` (the momenta
    are left as they are) and ``e`` the error the stored values stand for with
    ``pending[k]``, the pending scale of bucket ``k`` (``step`` elements each;
    ``positions``: where each tensor starts in the compressed buffer). Returns per block
    the sums of ``x²``, ``v²`` and ``|v|``, written to ``out`` when given (three
    contiguous fp32 tensors of ``table.blocks`` elements, e.g. slices of a larger table's
    partials)."""
    if out is not None and (
        len(out) != 3 or any(t.numel() != table.blocks or not t.is_contiguous() for t in out)
    ):
        raise ValueError(f"out: three contiguous tensors of {table.blocks} block sums")
    sums = out if out is not None else (table.partials(), table.partials(), table.partials())
    table.launch(
        "onebit_fold_compensated",
        {"grads": grads, "exp_avg": momenta, "worker_error": values},
        coeffs=coeffs,
        grad_scale=grad_scale.float() if grad_scale is not None else coeffs,
        positions=table.values("positions", positions),
        step=step,
        pending=pending,
        part_x=sums[0],
        part_v=sums[1],
        part_abs=sums[2],
        **_decay("beta1", beta1),
        HAS_SCALE=grad_scale is not None,
    )
    return sums


def onebit_measure_signs(
    table: TensorTable,
    momenta: list[torch.Tensor],
    fresh: list[torch.Tensor],
    second: list[torch.Tensor],
    params: list[torch.Tensor],
    masks: list[torch.Tensor | None],
    positions: list[int],
    signs,
    coeffs: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    mask_untrained: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`onebit_measure` with the averaged momentum read from ``signs`` (the 1-bit
    all-reduce's gathered messages, :class:`~onebit_bert.distributed.codecs.onebit.
    GatheredSigns`) and the old one from ``momenta``, which it overwrites. ``positions``:
    where each tensor starts in the compressed buffer; ``masks``: each tensor's momentum
    mask at its shape, or None."""
    operands = {
        "exp_avg": momenta,
        "exp_avg_sq_fresh": fresh,
        "exp_avg_sq": second,
        "params": params,
        "masks": masks,
    }
    settings = dict(
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, mask_untrained=mask_untrained
    )
    return _measured(
        table,
        "onebit_measure_signs",
        operands,
        settings,
        positions=table.values("positions", positions),
        messages=signs.addresses,
        scales=signs.scales,
        step=signs.step,
        padded=signs.padded,
        ranks=signs.ranks,
        coeffs=coeffs,
    )


def segment_sums(partial: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``out[i]``: the sum of ``partial[first[i] : first[i] + count[i]]``, in order (the
    same bits on every run)."""
    out = torch.empty(first.numel(), dtype=torch.float32, device=partial.device)
    triton_module("multi_tensor").segment_reduce[(first.numel(),)](
        first, count, partial, out, MAX=False, BLOCK=REDUCE_BLOCK, **COMPILE_OPTIONS
    )
    return out
