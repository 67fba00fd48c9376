"""The fused kernels (onebit_bert.kernels) against the reference: checks that run in a
process whose Triton interprets (tests/core/distributed/test_kernels.py starts it with
``TRITON_INTERPRET=1``) or on a GPU (tests/test_gpu.py, ``device="cuda:0"``).

Where the arithmetic is exact (signs, packing, the server's sum of ±scales, unpacking)
the kernels must give the reference's bits; a scale is a sum of squares in another order,
so scales and what they enter are compared within rounding. Inputs are made on the CPU
and moved to ``device``; the reference runs on the CPU.
"""

from __future__ import annotations

import torch

from onebit_bert.distributed.codecs import compressed_all_reduce
from onebit_bert.distributed.codecs.compression import SCALE_BYTES, ErrorFeedback, SignOps
from onebit_bert.distributed.codecs.packing import pack_signs, sign_table, unpack_signs
from onebit_bert.distributed.comm import Communicator
from onebit_bert.optim import Lamb
from tests.helpers.compression import rank_inputs, run_onebit_lamb
from tests.helpers.distributed_harness import run_ranks

TABLE = sign_table("cpu")


def fused_ops():
    from onebit_bert.kernels.signs import FusedSignOps

    return FusedSignOps()


def scale_of(message: torch.Tensor) -> torch.Tensor:
    tails = message.reshape(-1, message.shape[-1])[:, -SCALE_BYTES:]
    return torch.tensor(tails.tolist(), dtype=torch.uint8).view(torch.float32).view(-1)


def check_worker_signs(device: str = "cpu") -> None:
    """Worker compression: the reference's signs bit for bit (also for values that are
    exactly 0, ±0, NaN and ±inf), its scale within rounding, and the error exactly
    ``x+e - s·sign(x+e)`` for the kernel's own scale."""
    for ranks, numel, real in [(1, 8 * 300, 8 * 300 - 5), (3, 24 * 97, 2000)]:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 3
        x[real:] = 0
        error = torch.randn(numel, generator=torch.Generator().manual_seed(2)) * 0.1
        error[real:] = 0
        error[::5] = -x[::5]  # x + error == 0 exactly: sign +1
        e_ref = error.clone()
        want = SignOps().compress(x.clone(), e_ref, real, TABLE, ranks)
        e_new = error.clone().to(device)
        got = fused_ops().compress(x.to(device), e_new, real, None, ranks).cpu()
        e_new = e_new.cpu()
        assert got.shape == want.shape
        assert torch.equal(got[:, :-SCALE_BYTES], want[:, :-SCALE_BYTES]), "signs differ"
        torch.testing.assert_close(scale_of(got), scale_of(want), rtol=1e-6, atol=0)
        value = x + error
        s = scale_of(got)[0]
        expected = value - unpack_signs(pack_signs(value), s, table=TABLE)
        expected[real:] = 0
        assert torch.equal(e_new, expected), "error is not x+e - s·sign(x+e)"
        torch.testing.assert_close(e_new, e_ref, rtol=0, atol=1e-6 * s.item())

    numel = 8 * 64
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    x[::7] = 0.0
    x[1::11] = -0.0
    x[2::13] = float("nan")
    x[3::17] = float("inf")
    x[4::19] = float("-inf")
    got = fused_ops().compress(x.to(device), torch.zeros(numel, device=device), numel, None, 1)
    assert torch.equal(got[0, :-SCALE_BYTES].cpu(), pack_signs(x)), "special values"


def check_server_step(device: str = "cpu") -> None:
    """The server's average of ``±s_i`` over 1 to 4 ranks is the reference's exactly: the
    same signs, and the error exactly ``y - t·sign(y)`` for the kernel's own scale ``t``."""
    chunk = 8 * 50
    for ranks, real_cut in [(1, 0), (2, 3), (4, 40)]:
        messages = []
        for r in range(ranks):
            x = rank_inputs(r, 0, chunk * ranks, chunk * ranks)
            messages.append(SignOps().compress(x, torch.zeros_like(x), x.numel(), TABLE, ranks))
        incoming = torch.stack([m[ranks - 1] for m in messages])  # the last rank's chunk
        real = chunk - real_cut
        error = torch.randn(chunk, generator=torch.Generator().manual_seed(4)) * 0.05
        error[real:] = 0
        e_ref = error.clone()
        want = SignOps().serve(incoming, e_ref, real, TABLE)
        e_new = error.clone().to(device)
        got = fused_ops().serve(incoming.to(device), e_new, real, None).cpu()
        e_new = e_new.cpu()
        assert torch.equal(got[:-SCALE_BYTES], want[:-SCALE_BYTES]), "signs differ"
        torch.testing.assert_close(scale_of(got), scale_of(want), rtol=1e-6, atol=0)
        combined = torch.zeros(chunk)
        for row in incoming:
            body = row[:-SCALE_BYTES].contiguous()
            combined += unpack_signs(body, scale_of(row)[0], table=TABLE)
        combined = combined / ranks
        combined[real:] = 0
        value = combined + error
        expected = value - unpack_signs(pack_signs(value), scale_of(got)[0], table=TABLE)
        expected[real:] = 0
        assert torch.equal(e_new, expected), f"server error at {ranks} ranks"


def check_errors_kept_as_values(device: str = "cpu") -> None:
    """Worker and server steps that keep what they compressed with the scale pending (as
    the codec keeps its errors) send the same messages as steps that write the errors
    each time, over three calls on one set of errors, and settle to the same errors bit
    for bit; their error figure (from the pass's sums) is the written errors' within
    rounding."""
    from onebit_bert.distributed.codecs.packing import settle

    ranks, numel, real = 2, 16 * 150, 16 * 150 - 9
    g = torch.Generator().manual_seed(6)
    start = torch.randn(numel, generator=g) * 0.1
    start[real:] = 0
    written, kept = start.clone().to(device), start.clone().to(device)
    pending = torch.zeros(1, device=device)
    ops = fused_ops()
    for call in range(3):
        x = torch.randn(numel, generator=g).to(device)
        x[real:] = 0
        if call == 2:  # every value the same: no error left, and an error figure of 0
            x[:real] = 1.0
            written[:real], kept[:real], pending[0] = 0.0, 0.0, 0.0
        with ops.measure(device) as eager:
            want = ops.compress(x, written, real, None, ranks)
        with ops.measure(device) as lazy:
            got = ops.compress(x, kept, real, None, ranks, pending=pending)
        assert torch.equal(got.cpu(), want.cpu()), f"worker call {call}: messages differ"
        direct = torch.linalg.vector_norm(written.cpu()) / torch.linalg.vector_norm(x.cpu())
        # the figure's ‖e‖² = 2·Σv² - 2s·Σ|v| rounds to about 1e-7 of Σv²: a figure near 0
        # comes out near sqrt(1e-7) at most
        atol = 1e-3 if call == 2 else 0.0
        for figure in (eager, lazy):
            torch.testing.assert_close(figure.relative_error().cpu(), direct, rtol=1e-5, atol=atol)
    settled = kept.clone()
    settle(settled, pending, real)
    assert torch.equal(settled.cpu(), written.cpu()), "worker errors differ"

    chunk = numel // ranks
    messages = [
        SignOps().compress(rank_inputs(r, 0, numel, numel), torch.zeros(numel), numel, TABLE, ranks)
        for r in range(ranks)
    ]
    incoming = torch.stack([m[1] for m in messages]).to(device)
    written = (torch.randn(chunk, generator=g) * 0.05).to(device)
    kept, pending = written.clone(), torch.zeros(1, device=device)
    for call in range(3):
        want = ops.serve(incoming, written, chunk - 5, None)
        got = ops.serve(incoming, kept, chunk - 5, None, pending=pending)
        assert torch.equal(got.cpu(), want.cpu()), f"server call {call}: messages differ"
    settle(kept, pending, chunk - 5)
    assert torch.equal(kept.cpu(), written.cpu()), "server errors differ"


def check_expansion(device: str = "cpu") -> None:
    """Expansion gives the reference's values bit for bit, 0 past the real elements."""
    chunk, body = 8 * 33, 33
    for ranks in (1, 3):
        g = torch.Generator().manual_seed(ranks)
        gathered = torch.randint(
            0, 256, (ranks, body + SCALE_BYTES), dtype=torch.uint8, generator=g
        )
        scales = torch.rand(ranks, generator=g) + 0.5
        gathered[:, body:] = scales.view(torch.uint8).view(ranks, SCALE_BYTES)
        real = ranks * chunk - 13
        want = torch.full((ranks * chunk,), 7.0)
        SignOps().expand(gathered, want, real, TABLE)
        got = torch.full((ranks * chunk,), 7.0, device=device)
        fused_ops().expand(gathered.to(device), got, real, None)
        assert torch.equal(got.cpu(), want), f"expansion at {ranks} ranks"


def check_all_reduce(device: str = "cpu") -> None:
    """Three calls of the 1-bit all-reduce (world size 1, one bucket and several) with the
    fused kernels track the reference's: the first call's signs equal, the outputs and
    errors within rounding, the padding 0."""
    numel, calls = 1001, 3
    for bucket in (None, 64):
        results = {}
        for name, ops, where in (("reference", SignOps(), "cpu"), ("fused", fused_ops(), device)):
            comm = Communicator(None, device=where)
            feedback = ErrorFeedback(numel, 1, device=where, bucket_numel=bucket)
            outs = []
            for call in range(calls):
                x = rank_inputs(0, call, numel, feedback.padded_numel).to(where)
                compressed_all_reduce(comm, x, feedback, ops)
                outs.append(x.cpu())
            results[name] = outs, feedback.worker_error.cpu(), feedback.server_error.cpu()
        (want, w_ref, s_ref), (got, w_new, s_new) = results["reference"], results["fused"]
        assert torch.equal(torch.sign(got[0]), torch.sign(want[0]))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert torch.all(a[numel:] == 0), "padding picked up a value"
        torch.testing.assert_close(w_new, w_ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(s_new, s_ref, rtol=0, atol=1e-5)


def check_lamb(device: str = "cpu") -> None:
    """Fused LAMB (two groups, with and without weight decay and bias correction, a zero
    parameter) tracks the reference on the CPU within rounding: parameters, trust ratios,
    moments."""
    g = torch.Generator().manual_seed(0)
    shapes = [(30, 50), (50,), (3000,), (7,), (1,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    init[3].zero_()  # ‖w‖ = 0: ratio 1
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(kernels, where, bias_correction):
        params = [t.clone().to(where).requires_grad_(True) for t in init]
        groups = [
            {"params": params[:2], "weight_decay": 0.01},
            {"params": params[2:], "weight_decay": 0.0},
        ]
        opt = Lamb(groups, lr=0.01, bias_correction=bias_correction, kernels=kernels)
        ratios = []
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone().to(where)
            opt.step()
            ratios.append(opt.last_trust_ratios.cpu())
        moments = [[opt.state[p][k].cpu() for k in ("exp_avg", "exp_avg_sq")] for p in params]
        return [p.detach().cpu() for p in params], ratios, moments

    for bias_correction in (False, True):
        want = run("reference", "cpu", bias_correction)
        got = run("fused", device, bias_correction)
        for a, b in zip(got[0], want[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(got[2], want[2], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def check_gradients_in_one_buffer(device: str = "cpu") -> None:
    """Gradients as views into one flat buffer, back to back as DDP's bucket views lay
    them (a 2-element bias first puts the next ones 8 bytes off 16): fused LAMB and 1-bit
    LAMB split each pass into runs of tensors with and without 16-byte accesses, and track
    the reference within rounding."""
    from onebit_bert.kernels.multi_tensor import TensorTable
    from onebit_bert.optim import OneBitLamb

    g = torch.Generator().manual_seed(11)
    shapes = [(64, 16), (300,), (2,), (32, 8), (5000,), (12,), (33,), (4100,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    runs_seen = []

    def run(name, kernels, where):
        params = [t.clone().to(where).requires_grad_(True) for t in init]
        flat = torch.zeros(sum(t.numel() for t in init), device=where)
        views = list(torch.split(flat, [t.numel() for t in init]))
        groups = [
            {"params": params[:5], "weight_decay": 0.01},
            {"params": params[5:], "weight_decay": 0.0},
        ]
        if name == "lamb":
            opt = Lamb(groups, lr=0.01, kernels=kernels)
        else:
            comm = Communicator(None, device=where)
            opt = OneBitLamb(groups, lr=0.01, freeze_step=2, kernels=kernels, comm=comm)
        for step_grads in grads:
            for p, view, grad in zip(params, views, step_grads, strict=True):
                view.copy_(grad.reshape(-1))
                p.grad = view.view(p.shape)
            opt.step()
        return [p.detach().cpu() for p in params]

    runs = TensorTable.runs

    def recording(self, roles):
        out = runs(self, roles)
        runs_seen.append(out)
        return out

    for name in ("lamb", "onebit_lamb"):
        want = run(name, "reference", "cpu")
        TensorTable.runs = recording
        try:
            got = run(name, "fused", device)
        finally:
            TensorTable.runs = runs
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # the gradients' passes ran an aligned run beside an unaligned one
        assert any(len(r) > 1 and {a for *_, a in r} == {True, False} for r in runs_seen), (
            name,
            runs_seen,
        )
        runs_seen.clear()


def check_a_nan_gradient_reaches_the_factors(device: str = "cpu") -> None:
    """A NaN in a gradient after the freeze: the fused step's factors are NaN where the
    reference's are (the largest drift taken as torch takes it, NaN if any element is),
    not a finite value that hides it."""
    from onebit_bert.optim import OneBitLamb

    g = torch.Generator().manual_seed(5)
    shapes = [(40, 30), (3000,), (9,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    grads[3][1][17] = float("nan")  # the last step, a compression step

    def run(kernels, where):
        params = [t.clone().to(where).requires_grad_(True) for t in init]
        comm = Communicator(None, device=where)
        opt = OneBitLamb(params, lr=0.01, freeze_step=2, kernels=kernels, comm=comm)
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone().to(where)
            opt.step()
        return opt.last_factors.cpu(), opt.last_step_kernels

    want, want_path = run("reference", "cpu")
    got, path = run("fused", device)
    assert (want_path, path[:5]) == ("reference", "fused")
    assert want.isnan().any(), want  # the reference's factors carry the NaN
    torch.testing.assert_close(got, want, equal_nan=True)


def check_onebit_lamb(device: str = "cpu") -> None:
    """1-bit LAMB with the fused kernels: 3 warmup steps (LAMB's reference either way),
    then 3 compressed ones, with a momentum mask on one layer, at world size 1 (which
    still compresses), one bucket and several; tracks the reference on the CPU."""
    steps, mask = 6, 2
    for bucket in (None, 64):
        want = run_onebit_lamb(Communicator(None), steps, mask, bucket, "reference")
        got = run_onebit_lamb(Communicator(None, device=device), steps, mask, bucket, "fused")
        assert got["stages"] == want["stages"] == ["warmup"] * 3 + ["compression"] * 3
        assert got["bytes"] == want["bytes"]
        for a, b in zip(got["params"], want["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["factors"], want["factors"], rtol=1e-5, atol=1e-6)
        error, expected = got["compression_error"], want["compression_error"]
        torch.testing.assert_close(error, expected, rtol=1e-4, atol=0)  # summed as it goes
        assert torch.all(got["masked_momentum"] == 0)


def _three_ways(comm, steps, mask, bucket):
    """:func:`run_onebit_lamb` on this rank with the reference, the fused kernels with the
    fold and the expansion in passes of their own, and the fused kernels reading the
    average from the servers' messages in the update."""
    return {
        "reference": run_onebit_lamb(comm, steps, mask, bucket, "reference"),
        "separate": run_onebit_lamb(comm, steps, mask, bucket, "fused", False),
        "in_update": run_onebit_lamb(comm, steps, mask, bucket, "fused", True),
    }


def check_onebit_lamb_expanded_in_the_update(device: str = "cpu") -> None:
    """The fused compression step that folds beside the momentum and reads the 1-bit
    average from the servers' messages in the update, on 1, 2 and 3 gloo ranks, with one
    bucket and with bucket boundaries inside tensors (and a momentum mask): it runs where
    it should, tracks the reference and the separate passes within rounding, and every
    rank ends with the same parameters."""
    for world, bucket, mask in ((1, None, None), (1, 24, 2), (2, 48, 2), (3, 48, None)):
        ranks = run_ranks(_three_ways, world, 6, mask, bucket, device=device)
        for result in ranks:
            ref, separate, new = result["reference"], result["separate"], result["in_update"]
            assert new["kernels"][3:] == ["fused, expanded in the update"] * 3, new["kernels"]
            assert separate["kernels"][3:] == ["fused"] * 3, separate["kernels"]
            assert new["bytes"] == ref["bytes"]
            for other in (ref, separate):
                for a, b in zip(new["params"], other["params"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(new["factors"], other["factors"], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(
                    new["compression_error"], other["compression_error"], rtol=1e-4, atol=0
                )
            if mask is not None:
                assert torch.all(new["masked_momentum"] == 0)
        for other in ranks[1:]:
            mine, first = other["in_update"]["params"], ranks[0]["in_update"]["params"]
            for a, b in zip(mine, first, strict=True):
                assert torch.equal(a, b), "the ranks' parameters differ"


def check_onebit_lamb_refresh_steps(device: str = "cpu") -> None:
    """Refresh steps (``coeff_refresh``: an exact momentum average, and ``c`` set so that
    ``c·f`` is LAMB's trust ratio) run in the fused kernels too, with and without weight
    decay, at world size 1 (the exact average is the same code on either path): with a
    refresh at compression steps 1 and 3 of 5 they track the reference (parameters,
    factors and coefficients), and the steps between them read the average in the
    update."""
    ref = run_onebit_lamb(Communicator(None), 8, 2, 48, "reference", coeff_refresh=1)
    new = run_onebit_lamb(Communicator(None, device=device), 8, 2, 48, "fused", coeff_refresh=1)
    refreshes = [False] * 3 + [True, False, True, False, False]
    paths = ["fused" if refreshed else "fused, expanded in the update" for refreshed in refreshes]
    assert new["refreshed"] == ref["refreshed"] == refreshes, new["refreshed"]
    assert new["kernels"][3:] == paths[3:], new["kernels"]
    assert new["bytes"] == ref["bytes"]
    for a, b in zip(new["params"], ref["params"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["factors"], ref["factors"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new["coefficients"], ref["coefficients"], rtol=1e-5, atol=0)
    assert torch.all(new["masked_momentum"] == 0)


def check_onebit_lamb_blocks_cut_by_buckets(device: str = "cpu") -> None:
    """The same on tensors of several kernel blocks (2,048 elements) with bucket
    boundaries inside blocks (every 2,000 elements), one rank: reading the average from
    the messages in the update tracks the reference."""
    from onebit_bert.optim import OneBitLamb

    g = torch.Generator().manual_seed(3)
    shapes = [(3000,), (60, 70), (9,), (4100,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(5)]

    def run(kernels, where):
        params = [t.clone().to(where).requires_grad_(True) for t in init]
        groups = [
            {"params": params[:2], "weight_decay": 0.01},
            {"params": params[2:], "weight_decay": 0.0},
        ]
        opt = OneBitLamb(groups, lr=0.01, freeze_step=2, bucket_numel=2000, kernels=kernels)
        paths = []
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone().to(where)
            opt.step()
            paths.append(opt.last_step_kernels if opt.stage == "compression" else None)
        return [p.detach().cpu() for p in params], opt.last_factors.cpu(), paths

    want, want_factors, _ = run("reference", "cpu")
    got, got_factors, paths = run("fused", device)
    assert paths == [None, None] + ["fused, expanded in the update"] * 3, paths
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_factors, want_factors, rtol=1e-5, atol=1e-6)


def check_onebit_lamb_fused_resume(device: str = "cpu") -> None:
    """A fused 1-bit LAMB run saved after its second compressing step and continued by a
    new optimizer from that state ends bit for bit where the uninterrupted run ends (the
    scratch buffer is not state, and the errors kept as values with their scales pending
    are saved as the errors they stand for); so does a run whose state is taken after
    every step."""
    import copy

    from onebit_bert.optim import OneBitLamb

    g = torch.Generator().manual_seed(5)
    shapes = [(3000,), (40, 30), (7,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]

    def build(values):
        params = [t.clone().to(device).requires_grad_(True) for t in values]
        groups = [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:]}]
        opt = OneBitLamb(groups, lr=0.01, freeze_step=2, bucket_numel=1000, kernels="fused")
        return params, opt

    def steps(params, opt, todo, save=False):
        for step_grads in todo:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone().to(device)
            opt.step()
            if save:  # as a run that checkpoints every step: the errors settle each time
                opt.state_dict()

    params, opt = build(init)
    steps(params, opt, grads)
    straight = [p.detach().cpu() for p in params]
    assert opt.last_step_kernels == "fused, expanded in the update"
    params, opt = build(init)
    steps(params, opt, grads, save=True)
    for a, b in zip(params, straight, strict=True):
        assert torch.equal(a.detach().cpu(), b), "saving the state changed the run"
    params, opt = build(init)
    steps(params, opt, grads[:4])
    saved = copy.deepcopy(opt.state_dict())
    values = [p.detach().cpu() for p in params]
    params, opt = build(values)
    opt.load_state_dict(saved)
    steps(params, opt, grads[4:])
    assert opt.last_step_kernels == "fused, expanded in the update"
    for a, b in zip(params, straight, strict=True):
        assert torch.equal(a.detach().cpu(), b), "the resumed run left the straight one"


def _overlapped_steps(comm, kernels: str, clip: bool, expand: bool, overlap: bool = True) -> dict:
    """Six steps of a small model with 1-bit LAMB (freeze at 2, buckets of 64 elements)
    whose compression steps start their bucket all-reduces during the backward pass
    (unless not ``overlap``: the same steps after it); ``clip``: clipped bucket by bucket
    to a norm of 0.05 (OverlapClip; the gradients' norms are above it); ``expand``:
    :attr:`OneBitLamb.expand_in_update`. Counts the launches of each fused fold and of
    the codec's own sums of squares, and names each step's path."""
    from unittest.mock import patch

    from onebit_bert.kernels import multi_tensor
    from onebit_bert.kernels.signs import FusedSignOps
    from onebit_bert.optim import OneBitLamb
    from onebit_bert.optim.compressed import OverlapClip

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(
        comm.device
    )
    params = list(model.parameters())
    opt = OneBitLamb(params, lr=0.02, freeze_step=2, comm=comm, bucket_numel=64, kernels=kernels)
    opt.expand_in_update = expand
    if overlap:
        opt.enable_overlap(comm.side_channel())
    g = torch.Generator().manual_seed(comm.rank)
    folds = {"onebit_fold": 0, "onebit_fold_compensated": 0, "sum_squares": 0}
    armed, paths, previous = [], [], [None] * len(params)

    def counted(name):
        kernel = getattr(multi_tensor, name)

        def call(*args, **kwargs):
            folds[name] += 1
            return kernel(*args, **kwargs)

        return call

    def worker_sums(encode):
        def call(*args, **kwargs):  # a worker's compression without the caller's squares
            # (self, x, values, pending, message, body, real, received, scales, ranks,
            # stride, server, squares)
            server = args[11] if len(args) > 11 else kwargs["server"]
            squares = args[12] if len(args) > 12 else kwargs.get("squares")
            folds["sum_squares"] += not server and squares is None
            return encode(*args, **kwargs)

        return call

    with (
        patch.object(multi_tensor, "onebit_fold", counted("onebit_fold")),
        patch.object(multi_tensor, "onebit_fold_compensated", counted("onebit_fold_compensated")),
        patch.object(FusedSignOps, "_encode", worker_sums(FusedSignOps._encode)),
    ):
        for _ in range(6):
            x = torch.randn(32, 8, generator=g).to(comm.device)
            y = torch.randn(32, 4, generator=g).to(comm.device)
            opt.zero_grad()
            overlap_clip = OverlapClip(0.05, params, previous) if clip else None
            armed.append(opt.begin_overlap(overlap_clip) if overlap else False)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if not opt.syncs_internally:
                comm.all_reduce_coalesced([p.grad for p in params], op="avg")
            opt.step()
            paths.append(opt.last_step_kernels if opt.stage == "compression" else None)
            if armed[-1] and overlap_clip is not None:
                previous = overlap_clip.norms()
    return {
        "params": [p.detach().cpu() for p in params],
        "armed": armed,
        "folds": folds,
        "paths": paths,
        "compression_error": opt.last_compression_error.cpu(),
    }


def _overlap_variants(comm) -> dict:
    """:func:`_overlapped_steps` on this rank, with and without clipping, with the
    reference and with the fused kernels on both paths (one start of the ranks for all)."""
    runs = {
        (clip, kernels, expand): _overlapped_steps(comm, kernels, clip, expand)
        for clip in (False, True)
        for kernels, expand in (("reference", True), ("fused", True), ("fused", False))
    }
    runs["not overlapped"] = _overlapped_steps(comm, "fused", False, True, overlap=False)
    return runs


def check_onebit_lamb_overlapped_folds(device: str = "cpu") -> None:
    """Steps that overlap the 1-bit all-reduce with the backward pass, on 2 gloo ranks,
    with and without bucket-by-bucket clipping: with the fused kernels each gradient is
    folded in a kernel as it arrives, beside the momentum with the average read in the
    update (by default) or into it with the separate expansion; both track the
    reference's overlapped steps (parameters and error figure), and the ranks agree."""
    expected = {True: "fused, expanded in the update", False: "fused"}
    kernel = {True: "onebit_fold_compensated", False: "onebit_fold"}
    ranks = run_ranks(_overlap_variants, 2, device=device)
    for clip in (False, True):
        for expand in (True, False):
            for runs in ranks:
                new, ref = runs[(clip, "fused", expand)], runs[(clip, "reference", True)]
                assert new["armed"] == ref["armed"] == [False] * 2 + [True] * 4, new["armed"]
                assert new["paths"][2:] == [expected[expand]] * 4, new["paths"]
                assert new["folds"][kernel[expand]] > 0, new["folds"]
                assert new["folds"][kernel[not expand]] == 0, new["folds"]
                # beside the momentum the folds sum the worker's squares: no pass of its own
                assert (new["folds"]["sum_squares"] == 0) == expand, new["folds"]
                assert ref["folds"]["onebit_fold"] == ref["folds"]["onebit_fold_compensated"] == 0
                for a, b in zip(new["params"], ref["params"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                # the fused buckets sum the error figure's squares as they compress
                error, want = new["compression_error"], ref["compression_error"]
                torch.testing.assert_close(error, want, rtol=1e-4, atol=0)
            first, second = (runs[(clip, "fused", expand)]["params"] for runs in ranks)
            for a, b in zip(first, second, strict=True):
                assert torch.equal(a, b), "the ranks' parameters differ"
    # without clipping, the overlapped steps are the plain ones: the folds' block sums add
    # up per bucket as the plain step's fold adds them up. Bit for bit in the interpreter;
    # on a GPU a parameter folded on its own may launch with 16-byte accesses where its
    # group does not, and the compiler may then add a block's squares in another order.
    for runs in ranks:
        plain, overlapped = runs["not overlapped"], runs[(False, "fused", True)]
        assert plain["armed"] == [False] * 6 and plain["folds"]["sum_squares"] == 0
        assert plain["paths"] == overlapped["paths"]
        for a, b in zip(overlapped["params"], plain["params"], strict=True):
            if device == "cpu":
                assert torch.equal(a, b), "the overlapped steps left the plain ones"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        error, want = overlapped["compression_error"], plain["compression_error"]
        torch.testing.assert_close(error, want, rtol=1e-5, atol=0)


def check_onebit_lamb_set_codec_keeps_the_separate_passes(device: str = "cpu") -> None:
    """With a codec set from the communication policy (here the 1-bit codec with per-tensor
    scales, on the fused per-bucket kernels) the fused step keeps its fold and expansion
    as passes of their own, and matches the reference with the same codec (at world size
    one, where that codec leaves the folded momentum as it is)."""
    from onebit_bert.distributed.codecs import OneBitCodec
    from onebit_bert.kernels.signs import FusedSignOps
    from onebit_bert.optim import OneBitLamb

    g = torch.Generator().manual_seed(7)
    shapes = [(300,), (20, 30), (5,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]

    def run(kernels, where):
        params = [t.clone().to(where).requires_grad_(True) for t in init]
        comm = Communicator(None, device=where)
        opt = OneBitLamb(params, lr=0.01, freeze_step=2, kernels=kernels, comm=comm)
        ops = FusedSignOps() if kernels == "fused" else SignOps()
        opt.set_codec(OneBitCodec(comm, per_tensor=True, sign_ops=ops))
        for step_grads in grads:
            for p, grad in zip(params, step_grads, strict=True):
                p.grad = grad.clone().to(where)
            opt.step()
        return [p.detach().cpu() for p in params], opt.last_step_kernels

    want, want_path = run("reference", "cpu")
    got, path = run("fused", device)
    assert (want_path, path) == ("reference", "fused")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


CHECKS = {
    f.__name__: f
    for f in (
        check_worker_signs,
        check_server_step,
        check_errors_kept_as_values,
        check_expansion,
        check_all_reduce,
        check_lamb,
        check_gradients_in_one_buffer,
        check_a_nan_gradient_reaches_the_factors,
        check_onebit_lamb,
        check_onebit_lamb_expanded_in_the_update,
        check_onebit_lamb_blocks_cut_by_buckets,
        check_onebit_lamb_refresh_steps,
        check_onebit_lamb_fused_resume,
        check_onebit_lamb_overlapped_folds,
        check_onebit_lamb_set_codec_keeps_the_separate_passes,
    )
}
