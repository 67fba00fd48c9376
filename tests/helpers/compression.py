"""The compressed all-reduce written out plainly (:func:`simulate`) and run on real ranks
(:func:`compressed_calls`), and the toy problem the 1-bit optimizers are checked on: four
layers of fixed shapes in two BERT-style groups, per-rank and averaged gradients, a row
mask, the optimizers' flat momentum order, the compression stage's momentum exchange
simulated (:class:`SimulatedMomentumExchange`), optimizer steps with saves and resumes
(:func:`toy_steps`, :func:`resumed_toy_runs`), and 1-bit LAMB run on it."""

from __future__ import annotations

import io
import math

import torch

from onebit_bert.distributed import ErrorFeedback
from onebit_bert.distributed.codecs import compressed_all_reduce
from onebit_bert.optim import OneBitLamb

# ----------------------------------------------------------------------------- all-reduce


def simulate(inputs, worker_errors, server_errors, numel, bucket=None):
    """The spec's two phases for p workers in one process, written out plainly.

    ``inputs``/``worker_errors``: p padded fp32 tensors; ``server_errors``: p tensors of
    padded/p elements. Updates the errors in place, returns the common output."""
    p = len(inputs)
    quantum = 8 * p
    padded = inputs[0].numel()
    step = padded if bucket is None or bucket >= padded else bucket // quantum * quantum
    out = torch.zeros(padded)
    for a in range(0, padded, step):
        size = min(step, padded - a)
        real = max(0, min(size, numel - a))
        chunk = size // p
        scales, signs = [], []
        for i in range(p):
            x = inputs[i][a : a + size] + worker_errors[i][a : a + size]
            s = x[:real].norm() / math.sqrt(real) if real else torch.tensor(0.0)
            sign = torch.where(x >= 0, 1.0, -1.0)
            err = x - s * sign
            err[real:] = 0
            worker_errors[i][a : a + size] = err
            scales.append(s)
            signs.append(sign)
        for j in range(p):
            acc = torch.zeros(chunk)
            for i in range(p):
                acc = acc + scales[i] * signs[i][j * chunk : (j + 1) * chunk]
            y = acc / p + server_errors[j][a // p : (a + size) // p]
            real_j = max(0, min(chunk, real - j * chunk))
            y[real_j:] = 0
            t = y[:real_j].norm() / math.sqrt(real_j) if real_j else torch.tensor(0.0)
            sign = torch.where(y >= 0, 1.0, -1.0)
            err = y - t * sign
            err[real_j:] = 0
            server_errors[j][a // p : (a + size) // p] = err
            out[a + j * chunk : a + (j + 1) * chunk] = t * sign
        out[a + real : a + size] = 0
    return out


def rank_inputs(rank, call, numel, padded):
    g = torch.Generator().manual_seed(1000 * call + rank)
    x = torch.zeros(padded)
    x[:numel] = torch.randn(numel, generator=g) * (1 + rank)
    return x


def compressed_calls(comm, numel, calls, bucket):
    """``calls`` compressed all-reduces on ``comm.device``; results on the CPU."""
    feedback = ErrorFeedback(
        numel, comm.world_size, rank=comm.rank, device=comm.device, bucket_numel=bucket
    )
    outs = []
    for call in range(calls):
        x = rank_inputs(comm.rank, call, numel, feedback.padded_numel).to(comm.device)
        compressed_all_reduce(comm, x, feedback)
        outs.append(x.cpu().clone())
    return {
        "outs": outs,
        "worker_error": feedback.worker_error.cpu().clone(),
        "server_error": feedback.server_error.cpu().clone(),
        "bytes": comm.stats.bytes_sent,
    }


# ----------------------------------------------------------------------------- toy problem

SHAPES = [(6, 5), (5,), (3, 7), (1,)]


def init_params():
    g = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=g) for s in SHAPES]


def local_grads(rank, step):
    g = torch.Generator().manual_seed(97 * step + rank)
    # Per-rank offsets make the ranks disagree, as data-parallel shards do.
    return [torch.randn(s, generator=g) * (1 + 0.5 * rank) + 0.1 * rank for s in SHAPES]


def mean_grads(world_size, step):
    per_rank = [local_grads(r, step) for r in range(world_size)]
    total = [sum(gs[i] for gs in per_rank) for i in range(len(SHAPES))]
    return [t / world_size for t in total]


def row_mask():
    m = torch.ones(3, 7)
    m[1] = 0.0
    return m


ONEBIT_LAMB_HP = dict(lr=0.05, freeze_step=3, max_coeff=0.3, min_coeff=0.01)
# The optimizer lays momenta out group by group: layers 0 and 2, then 1 and 3.
FLAT_ORDER = [0, 2, 1, 3]


def param_groups(params):
    # BERT-style groups: weight decay on matrices only.
    return [
        {"params": [params[0], params[2]], "weight_decay": 0.01},
        {"params": [params[1], params[3]], "weight_decay": 0.0},
    ]


def layer_scales(momenta) -> list[float]:
    """The per-layer scales a 1-bit optimizer fixes when compression starts: the mean of the
    layers' RMS over each layer's own (1.0 for a layer that is all zeros)."""
    rms = [m.norm().item() / math.sqrt(m.numel()) for m in momenta]
    mean = sum(rms) / len(rms)
    return [mean / r if r > 0 else 1.0 for r in rms]


class SimulatedMomentumExchange:
    """The compression stage's momentum exchange for ``world_size`` workers in one process:
    each rank's momentum step on its own gradients, scaled per layer, laid out in
    :data:`FLAT_ORDER` and averaged by :func:`simulate` (whose error buffers this keeps
    across calls); returns the averaged momenta, unscaled, in layer order."""

    def __init__(self, world_size: int, bucket=None):
        self.p, self.bucket = world_size, bucket
        self.numel = sum(math.prod(s) for s in SHAPES)
        quantum = 8 * world_size
        self.padded = -(-self.numel // quantum) * quantum
        self.ew = [torch.zeros(self.padded) for _ in range(world_size)]
        self.es = [torch.zeros(self.padded // world_size) for _ in range(world_size)]

    def __call__(self, momenta, b1: float, step: int, scales) -> list[torch.Tensor]:
        inputs = []
        for rank in range(self.p):
            local = [
                (b1 * m + (1 - b1) * g) * s
                for m, g, s in zip(momenta, local_grads(rank, step), scales, strict=True)
            ]
            flat = torch.zeros(self.padded)
            flat[: self.numel] = torch.cat([local[i].reshape(-1) for i in FLAT_ORDER])
            inputs.append(flat)
        out = simulate(inputs, self.ew, self.es, self.numel, self.bucket)
        averaged, offset = [None] * len(momenta), 0
        for i in FLAT_ORDER:
            n = momenta[i].numel()
            averaged[i] = out[offset : offset + n].view_as(momenta[i]) / scales[i]
            offset += n
        return averaged


def toy_steps(comm, params, opt, start: int, stop: int, saves=()) -> dict[int, bytes]:
    """Steps ``start + 1`` to ``stop`` of ``opt`` on the toy problem: this rank's own
    gradients when the optimizer averages them itself, their average otherwise. Returns
    the parameters and optimizer state after each step in ``saves``, through torch.save."""
    blobs = {}
    for step in range(start + 1, stop + 1):
        local = opt.syncs_internally
        grads = local_grads(comm.rank, step) if local else mean_grads(comm.world_size, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        if step in saves:
            buffer = io.BytesIO()
            torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
            blobs[step] = buffer.getvalue()
    return blobs


def load_toy_state(params, opt, blob: bytes) -> None:
    """Parameters and optimizer state as :func:`toy_steps` saved them."""
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    with torch.no_grad():
        for p, value in zip(params, saved["params"], strict=True):
            p.copy_(value)
    opt.load_state_dict(saved["opt"])


def resumed_toy_runs(comm, make, stop: int, save_points) -> dict:
    """``make() -> (params, optimizer)`` run uninterrupted to ``stop``; then, for each save
    point, a fresh pair that loads this rank's parameters and state saved there and
    continues. ``{"straight": final parameters, "resumed": {save point: final parameters}}``."""
    params, opt = make()
    blobs = toy_steps(comm, params, opt, 0, stop, save_points)
    out = {"straight": [p.detach().clone() for p in params], "resumed": {}}
    for step, blob in blobs.items():
        params, opt = make()
        load_toy_state(params, opt, blob)
        toy_steps(comm, params, opt, step, stop)
        out["resumed"][step] = [p.detach().clone() for p in params]
    return out


def run_onebit_lamb(
    comm, steps, mask_index, bucket, kernels="auto", expand_in_update=True, coeff_refresh=0
):
    """1-bit LAMB on ``comm.device`` (the same inputs on every device) with ``kernels``
    (and :attr:`OneBitLamb.expand_in_update`, ``coeff_refresh``); results on the CPU."""
    params = [torch.nn.Parameter(t.to(comm.device)) for t in init_params()]
    opt = OneBitLamb(
        param_groups(params),
        comm=comm,
        bucket_numel=bucket,
        kernels=kernels,
        coeff_refresh=coeff_refresh,
        coeff_refresh_max=max(coeff_refresh, 4),
        **ONEBIT_LAMB_HP,
    )
    opt.expand_in_update = expand_in_update
    if mask_index is not None:
        opt.set_momentum_mask(params[mask_index], row_mask())
    stages, byte_counts, paths, refreshed = [], [], [], []
    for step in range(1, steps + 1):
        grads = (
            local_grads(comm.rank, step)
            if opt.syncs_internally
            else mean_grads(comm.world_size, step)
        )
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(comm.device)
        opt.step()
        stages.append(opt.stage)
        byte_counts.append(opt.last_step_bytes)
        paths.append(
            getattr(opt, "last_step_kernels", None) if opt.stage == "compression" else None
        )
        refreshed.append(opt.last_refreshed)
    error = opt.last_compression_error
    return {
        "params": [p.detach().cpu() for p in params],
        "stages": stages,
        "bytes": byte_counts,
        "factors": opt.last_factors.cpu(),
        "compression_error": None if error is None else error.cpu(),
        "masked_momentum": opt.state[params[2]]["exp_avg"][1].cpu(),
        "kernels": paths,
        "refreshed": refreshed,
        "coefficients": torch.stack([opt.state[p]["lamb_coeff"] for p in params]).cpu(),
    }


def embedding_steps(comm, opt, emb, head, steps, after_step=None):
    """``steps`` optimizer steps of ``head(emb(idx))**2`` with lookups of rows 0..7 only
    (rows 8.. never get a gradient), gradients averaged whenever the optimizer asks."""
    params = list(emb.parameters()) + list(head.parameters())
    g = torch.Generator().manual_seed(comm.rank)
    for _ in range(steps):
        idx = torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        head(emb(idx)).pow(2).mean().backward()
        if not opt.syncs_internally:
            comm.all_reduce_coalesced([p.grad for p in params], op="avg")
        opt.step()
        if after_step is not None:
            after_step()


def per_tensor_calls(comm, sizes, steps, bucket):
    """The onebit_tensor codec on tensors of ``sizes`` (all in one exchange) and the fused
    codec on each tensor alone, ``steps`` times on ``comm.device`` so that the errors carry
    over; results on the CPU, with the collectives the per-tensor codec issued each step."""
    from onebit_bert.distributed.codecs import OneBitCodec, build_codec

    per_tensor = build_codec("onebit_tensor", comm, bucket_numel=bucket)
    alone = OneBitCodec(comm, bucket_numel=bucket)
    issued = []
    for name in ("all_to_all_async", "all_gather_async"):
        original = getattr(comm, name)

        def counted(*args, _original=original, _name=name):
            issued.append(_name)
            return _original(*args)

        setattr(comm, name, counted)
    batched_out, alone_out, collectives = [], [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + comm.rank)
        inputs = [(torch.randn(n, generator=g) * 10.0**i).to(comm.device) for i, n in
                  enumerate(sizes)]  # fmt: skip
        batched = [t.clone() for t in inputs]
        issued.clear()
        per_tensor.all_reduce(batched, "m")
        collectives.append(list(issued))
        separate = [t.clone() for t in inputs]
        for i, t in enumerate(separate):
            alone.all_reduce([t], f"m/{i}")
        batched_out.append([t.cpu() for t in batched])
        alone_out.append([t.cpu() for t in separate])
    return {
        "batched": batched_out,
        "alone": alone_out,
        "collectives": collectives,
        "errors": {k: f.worker_error.cpu().clone() for k, f in per_tensor.feedback.items()},
        "alone_errors": {k: f.worker_error.cpu().clone() for k, f in alone.feedback.items()},
        "bytes": comm.stats.bytes_sent,
    }
