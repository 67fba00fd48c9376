"""1-bit LAMB: warmup = LAMB, compression stage = a plain simulation of p workers, exact
resume, momentum masks, degenerate layers, convergence, and argument checking."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from onebit_bert.distributed import Communicator
from onebit_bert.optim import Lamb, OneBitLamb
from tests.helpers.compression import (
    FLAT_ORDER,
    SimulatedMomentumExchange,
    embedding_steps,
    init_params,
    layer_scales,
    mean_grads,
    param_groups,
    row_mask,
    run_onebit_lamb,
)
from tests.helpers.compression import ONEBIT_LAMB_HP as HP
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.toy import ToyConfig, train_toy

# ----------------------------------------------------------------------------- simulation


class Simulation:
    """The spec's 1-bit LAMB for p workers in one process, one layer at a time."""

    def __init__(
        self,
        world_size,
        groups_wd,
        lr,
        freeze_step,
        max_coeff,
        min_coeff,
        mask_index=None,
        bucket=None,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        coeff_beta=0.9,
        fmax=4.0,
        fmin=0.5,
        fthr=0.1,
    ):
        self.p, self.lr, self.freeze = world_size, lr, freeze_step
        self.hi, self.lo, self.b1, self.b2, self.eps, self.cb = (
            max_coeff,
            min_coeff,
            b1,
            b2,
            eps,
            coeff_beta,
        )
        self.fmax, self.fmin, self.fthr = fmax, fmin, fthr
        self.wd = groups_wd  # per layer
        self.w = [t.clone() for t in init_params()]
        self.m = [torch.zeros_like(t) for t in self.w]
        self.v = [torch.zeros_like(t) for t in self.w]
        self.c = [0.0] * len(self.w)
        self.last_f = [1.0] * len(self.w)
        self.mask_index, self.bucket, self.t = mask_index, bucket, 0
        self.exchange = SimulatedMomentumExchange(world_size, bucket)

    def step(self):
        self.t += 1
        if self.t <= self.freeze:
            for i, g in enumerate(mean_grads(self.p, self.t)):
                self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
                self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
                u = self.m[i] / (self.v[i].sqrt() + self.eps) + self.wd[i] * self.w[i]
                wn, un = self.w[i].norm().item(), u.norm().item()
                r = min(max(wn / un, self.lo), self.hi) if wn > 0 and un > 0 else 1.0
                if r != 1.0:
                    self.c[i] = self.cb * self.c[i] + (1 - self.cb) * r
                self.w[i] = self.w[i] - self.lr * r * u
            if self.t == self.freeze:
                self.vf = [v.clone() for v in self.v]
            return
        if self.t == self.freeze + 1:
            self.scale = layer_scales(self.m)
        prev = [m.clone() for m in self.m]
        averaged = self.exchange(self.m, self.b1, self.t, self.scale)
        for i in FLAT_ORDER:
            w, m = self.w[i], averaged[i]
            if i == self.mask_index:
                m = m * row_mask()
            self.m[i] = m
            gt = (m - self.b1 * prev[i]) / (1 - self.b1)
            self.vf[i] = self.b2 * self.vf[i] + (1 - self.b2) * gt * gt
            u0 = m / (self.v[i].sqrt() + self.eps)
            u = u0 + self.wd[i] * w
            f = ((self.v[i].sqrt() + self.eps) / (self.vf[i].sqrt() + self.eps)).max().item()
            if self.wd[i] > 0:
                rho = min(1.0, u0.norm().item() / u.norm().item())
                f = f * rho + (1 - rho)
            f = min(max(f, self.fmin), self.fmax)
            f = min(max(f, self.last_f[i] * (1 - self.fthr)), self.last_f[i] * (1 + self.fthr))
            self.last_f[i] = f
            self.w[i] = w - self.lr * self.c[i] * f * u


@pytest.mark.parametrize("world_size,bucket,mask", [(1, None, None), (2, None, 2), (4, 64, 2)])
def test_compression_stage_matches_simulation(world_size, bucket, mask):
    steps = 8
    results = run_ranks(run_onebit_lamb, world_size, steps, mask, bucket)
    sim = Simulation(
        world_size,
        [0.01, 0.0, 0.01, 0.0],
        mask_index=mask,
        bucket=bucket,
        lr=HP["lr"],
        freeze_step=HP["freeze_step"],
        max_coeff=HP["max_coeff"],
        min_coeff=HP["min_coeff"],
    )
    for _ in range(steps):
        sim.step()
    for res in results:
        assert res["stages"] == ["warmup"] * 3 + ["compression"] * 5
        for got, want in zip(res["params"], sim.w, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert all(b == 0 for b in res["bytes"][:3])
        if world_size > 1:
            assert all(b > 0 for b in res["bytes"][3:])
        if mask is not None:
            assert torch.all(res["masked_momentum"] == 0)
    for res in results[1:]:
        for a, b in zip(res["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), "replicas diverged"


# ----------------------------------------------------------------------------- warmup == LAMB


def test_warmup_equals_lamb_bit_for_bit():
    a = [torch.nn.Parameter(t) for t in init_params()]
    b = [torch.nn.Parameter(t) for t in init_params()]
    lamb = Lamb(param_groups(a), lr=0.05, max_coeff=0.3, min_coeff=0.01)
    onebit = OneBitLamb(param_groups(b), lr=0.05, max_coeff=0.3, min_coeff=0.01, freeze_step=6)
    for step in range(1, 7):
        for pa, pb, g in zip(a, b, mean_grads(2, step), strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        assert not onebit.syncs_internally
        lamb.step()
        onebit.step()
        assert onebit.stage == "warmup"
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb)
            assert torch.equal(lamb.state[pa]["exp_avg"], onebit.state[pb]["exp_avg"])
            assert torch.equal(lamb.state[pa]["exp_avg_sq"], onebit.state[pb]["exp_avg_sq"])
        assert torch.equal(lamb.last_trust_ratios, onebit.last_trust_ratios)
    assert onebit.syncs_internally  # step 7 compresses
    assert onebit.bytes_sent == 0


# ----------------------------------------------------------------------------- resume


def _toy_run(comm, ckpt_dir, steps, save_at, load, drop_errors):
    """Data-parallel toy training; optionally save at ``save_at`` or start from a save."""
    from tests.helpers.toy import ToyConfig, _batch, _teacher, build_model

    cfg = ToyConfig(seed=3)
    model = build_model(cfg)
    opt = OneBitLamb(model.parameters(), lr=0.02, freeze_step=4, comm=comm, bucket_numel=512)
    path = os.path.join(ckpt_dir, f"rank{comm.rank}.pt")
    start = 0
    if load:
        saved = torch.load(path, weights_only=False)
        if drop_errors:
            saved["optim"]["per_rank"] = None
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = saved["step"]
    teacher = _teacher(cfg)
    for step in range(start, steps):
        x, y = _batch(cfg, teacher, comm.rank, step, 16)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if not opt.syncs_internally:
            comm.all_reduce_coalesced([p.grad for p in model.parameters()], op="avg")
        opt.step()
        if step + 1 == save_at:
            torch.save(
                {"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1}, path
            )
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,save_at", [(1, 6), (2, 3), (2, 7)])
def test_save_load_continue_equals_uninterrupted(tmp_path, world_size, save_at):
    steps = 10
    straight = run_ranks(_toy_run, world_size, str(tmp_path), steps, save_at, False, False)
    resumed = run_ranks(_toy_run, world_size, str(tmp_path), steps, None, True, False)
    for a, b in zip(straight, resumed, strict=True):
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb)
    if save_at > 4:
        # The saved errors matter: resuming without them leaves the trajectory.
        # One rank runs in this process, where the warning can be checked.
        warns = pytest.warns(UserWarning, match="no compression errors")
        with warns if world_size == 1 else contextlib.nullcontext():
            lossy = run_ranks(_toy_run, world_size, str(tmp_path), steps, None, True, True)
        assert not all(torch.equal(pa, pb) for pa, pb in zip(straight[0], lossy[0], strict=True))


def test_state_from_another_world_size_resets_errors_with_warning(tmp_path):
    run_ranks(_toy_run, 2, str(tmp_path), 7, 7, False, False)
    with pytest.warns(UserWarning, match="world size 2"):
        params = run_ranks(_toy_run, 1, str(tmp_path), 10, None, True, False)[0]
    assert all(torch.isfinite(p).all() for p in params)


def test_state_of_a_different_model_is_refused():
    a = torch.nn.Parameter(torch.randn(10))
    opt = OneBitLamb([a], freeze_step=1)
    for _ in range(2):
        a.grad = torch.randn(10)
        opt.step()
    b = torch.nn.Parameter(torch.randn(12))
    other = OneBitLamb([b], freeze_step=1)
    with pytest.raises(ValueError, match="different model"):
        other.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="no 1-bit LAMB section"):
        other.load_state_dict(Lamb([b]).state_dict())


# ----------------------------------------------------------------------------- masks, zeros


def _masked_embedding_run(comm, use_mask, mask_untrained=False):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 4)
    head = torch.nn.Linear(4, 1)
    params = list(emb.parameters()) + list(head.parameters())
    opt = OneBitLamb(params, lr=0.05, freeze_step=3, comm=comm)
    opt.mask_untrained = mask_untrained
    mask = torch.ones(12, 1)
    mask[8:] = 0.0  # rows 8..11 are never looked up
    if use_mask:
        opt.set_momentum_mask(emb.weight, mask)
    start = emb.weight.detach()[8:].clone()
    masked_rows = []
    embedding_steps(comm, opt, emb, head, 10, lambda: masked_rows.append(
        opt.state[emb.weight]["exp_avg"][8:].clone()))  # fmt: skip
    return {
        "rows": masked_rows,
        "weights_moved": not torch.equal(emb.weight.detach()[8:], start),
        "params": [p.detach().clone() for p in params],
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_masked_rows_stay_exactly_zero(world_size):
    for res in run_ranks(_masked_embedding_run, world_size, True):
        assert all(torch.all(r == 0) for r in res["rows"])
        assert not res["weights_moved"]
    # Without the mask, compression noise leaks into those rows.
    unmasked = run_ranks(_masked_embedding_run, world_size, False)[0]
    assert any(torch.any(r != 0) for r in unmasked["rows"])
    assert unmasked["weights_moved"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_rows_without_gradient_are_masked_by_default(world_size):
    # Rows 8..11 never had a gradient, so their second moment is 0: the default masks them
    # without an explicit mask, and the rest of the model trains as with the explicit one.
    auto = run_ranks(_masked_embedding_run, world_size, False, True)
    explicit = run_ranks(_masked_embedding_run, world_size, True, True)
    for res, ref in zip(auto, explicit, strict=True):
        assert all(torch.all(r == 0) for r in res["rows"])
        assert not res["weights_moved"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ref["params"], strict=True))


def _zero_layer_run(comm):
    live = torch.nn.Parameter(torch.randn(20, generator=torch.Generator().manual_seed(1)))
    dead = torch.nn.Parameter(torch.zeros(7))
    opt = OneBitLamb([live, dead], lr=0.05, freeze_step=2, comm=comm)
    for step in range(6):
        live.grad = torch.randn(20, generator=torch.Generator().manual_seed(step + comm.rank))
        dead.grad = torch.zeros(7)
        opt.step()
    return {
        "live": live.detach(),
        "dead": dead.detach(),
        "factors": opt.last_factors,
        "ratios": opt.last_trust_ratios,
        "scale": opt.state[dead]["scaling_coeff"],
    }


def _compression_error_run(comm):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64))
    opt = OneBitLamb([param], lr=0.01, freeze_step=2, comm=comm)
    errors = []
    for step in range(4):
        param.grad = torch.randn(64, generator=torch.Generator().manual_seed(step + comm.rank))
        opt.step()
        errors.append(opt.last_compression_error)
    return {"errors": errors}


def test_relative_compression_error_is_reported_after_the_switch():
    # None in warmup; after it, 1-bit rounding of a Gaussian-like vector loses a fair share
    # of its norm (about 0.6), never all of it
    for res in run_ranks(_compression_error_run, 2):
        assert res["errors"][:2] == [None, None]
        for e in res["errors"][2:]:
            assert e is not None and 0 < float(e) < 1.5


@pytest.mark.parametrize("world_size", [1, 2])
def test_all_zero_momentum_layer_gives_no_nan(world_size):
    for res in run_ranks(_zero_layer_run, world_size):
        assert res["scale"].item() == 1.0
        for key in ("live", "dead", "factors", "ratios"):
            assert torch.isfinite(res[key]).all(), key
        assert torch.all(res["dead"] == 0)


# ----------------------------------------------------------------------------- convergence


def _converge(comm, cfg):
    return (
        train_toy(comm, "lamb", cfg)["val_loss"],
        train_toy(comm, "onebit_lamb", cfg)["val_loss"],
    )


@pytest.mark.slow
def test_onebit_lamb_on_4_ranks_converges_like_lamb():
    cfg = ToyConfig(steps=1000, freeze_step=200, lr=0.02)
    lamb, onebit = run_ranks(_converge, 4, cfg)[0]
    assert lamb < 0.02 and onebit < 0.02, "neither got near the noise floor (0.01)"
    assert abs(onebit - lamb) / lamb < 0.05


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("freeze_step", [0, -3, 2.5, True])
def test_freeze_step_must_be_a_positive_integer(freeze_step):
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitLamb([torch.nn.Parameter(torch.ones(2))], freeze_step=freeze_step)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(coeff_beta=1.0), "coeff_beta"),
        (dict(factor_min=5.0, factor_max=4.0), "factor_min"),
        (dict(factor_threshold=-0.1), "factor_threshold"),
        (dict(max_coeff=0.001), "min_coeff"),
        (dict(bucket_numel=0), "bucket_numel"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitLamb([torch.nn.Parameter(torch.ones(2))], **kwargs)


def test_a_bucket_too_small_for_the_ranks_is_refused_when_built():
    """Below 8 × world size elements a bucket cannot be cut into one byte of signs per
    rank: refused by the constructor, with either implementation, not at the freeze."""
    with pytest.raises(ValueError, match=r"1-bit LAMB: bucket size 4 is below the minimum"):
        OneBitLamb([torch.nn.Parameter(torch.ones(40))], bucket_numel=4, kernels="reference")


def _buckets_after_overlapped_steps(comm, built, overlap_bucket):
    """The bucket count of the compressed momentum after compression steps of an optimizer
    built with ``built`` and overlapped with ``overlap_bucket``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    opt = OneBitLamb(model.parameters(), comm=comm, lr=0.01, freeze_step=1, bucket_numel=built)
    opt.enable_overlap(comm.side_channel(), overlap_bucket)
    armed = []
    for _ in range(3):
        opt.zero_grad()
        armed.append(opt.begin_overlap())
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
    late = OneBitLamb(model.parameters(), comm=comm, lr=0.01, freeze_step=1)
    for _ in range(2):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        late.step()
    try:
        late.enable_overlap(comm.side_channel(), 512)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    return armed, len(opt.codec.feedback["fused"].buckets), opt.bucket_numel, refused


def test_overlap_compresses_in_the_buckets_it_is_given_where_none_were_built():
    """``enable_overlap(comm, bucket_numel)`` (what ``comm.bucket_mb`` sets) cuts the
    momentum of an optimizer built without a bucket size into buckets, so that its
    all-reduces can start during the backward pass (one bucket can start only when every
    gradient is folded); one built with a size keeps it; one that has compressed already
    refuses a size (its errors are laid out by bucket)."""
    # 2,112 parameters: buckets of 512 (a multiple of 16) make 5
    given = run_ranks(_buckets_after_overlapped_steps, 2, None, 512)[0]
    assert given[:3] == ([False, True, True], 5, 512)
    assert "only before the first compression step" in given[3]
    built = run_ranks(_buckets_after_overlapped_steps, 2, 1024, 512)[0]
    assert built[:3] == ([False, True, True], 3, 1024)


def test_rejects_non_float_and_half_params():
    with pytest.raises(TypeError, match="floating-point"):
        OneBitLamb([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(TypeError, match="fp32 master weights"):
        OneBitLamb([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))])


def test_rejects_sparse_grads():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OneBitLamb(emb.parameters(), freeze_step=2)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse=False"):
        opt.step()


def test_rejects_first_gradient_after_freeze_step():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = OneBitLamb([a, b], freeze_step=1)
    a.grad = torch.ones(4)
    opt.step()
    b.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="after freeze_step=1"):
        opt.step()


def test_mask_arguments_are_checked():
    a = torch.nn.Parameter(torch.ones(4, 3))
    opt = OneBitLamb([a], freeze_step=1)
    with pytest.raises(ValueError, match="not a parameter"):
        opt.set_momentum_mask(torch.nn.Parameter(torch.ones(4, 3)), torch.ones(4, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        opt.set_momentum_mask(a, torch.ones(5, 3))
    with pytest.raises(ValueError, match="only 0"):
        opt.set_momentum_mask(a, torch.full((4, 1), 0.5))
    opt.set_momentum_mask(a, torch.ones(4, 1))
    assert "momentum_mask" not in str(opt.state_dict())
    opt.set_momentum_mask(a, None)


def test_deepspeed_config_maps_one_to_one():
    params = [torch.nn.Parameter(torch.ones(3))]
    config = {
        "lr": 11e-3,
        "freeze_step": 1000,
        "max_coeff": 0.3,
        "min_coeff": 0.01,
        "weight_decay": 0.01,
        "bias_correction": False,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "coeff_beta": 0.9,
        "factor_max": 4.0,
        "factor_min": 0.5,
        "factor_threshold": 0.1,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    opt = OneBitLamb.from_deepspeed_config(params, config, comm=Communicator(None))
    assert opt.freeze_step == 1000
    group = opt.param_groups[0]
    assert group["lr"] == 11e-3 and group["max_coeff"] == 0.3 and group["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="unknown 1-bit LAMB option"):
        OneBitLamb.from_deepspeed_config(params, {"lr": 1e-3, "frezee_step": 5})
    with pytest.raises(ValueError, match="AMSGrad"):
        OneBitLamb.from_deepspeed_config(params, {"amsgrad": True})
    with pytest.raises(ValueError, match="clip gradients in the trainer"):
        OneBitLamb.from_deepspeed_config(params, {"max_grad_norm": 1.0})


def test_stage_is_the_last_steps_and_next_stage_the_coming_ones():
    w = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
    opt = OneBitLamb([w], lr=0.01, freeze_step=2, comm=Communicator(None))
    seen = [(opt.stage, opt.next_stage)]
    for _ in range(3):
        w.grad = torch.ones_like(w)
        opt.step()
        seen.append((opt.stage, opt.next_stage))
    assert seen == [
        ("warmup", "warmup"),  # before any step
        ("warmup", "warmup"),  # after step 1
        ("warmup", "compression"),  # after step 2, the last of the warmup
        ("compression", "compression"),
    ]
