"""1-bit Adam: against a plain simulation of p workers at world sizes 1, 2, 4 (real gloo
ranks), equal to Adam without bias correction on a world of one, exact resume from each
stage, DeepSpeed config mapping and argument checks, and a pretraining run with
``freeze_step: auto`` killed with SIGKILL in its warmup and again in its compression stage
that resumes bit for bit."""

from __future__ import annotations

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.distributed import Communicator
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim import OneBitAdam
from pretrain.config import PretrainConfig
from tests.helpers.checkpoints import assert_same_checkpoints
from tests.helpers.compression import (
    FLAT_ORDER,
    SimulatedMomentumExchange,
    embedding_steps,
    init_params,
    layer_scales,
    local_grads,
    mean_grads,
    param_groups,
    resumed_toy_runs,
    row_mask,
)
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import (
    run_killing_after_checkpoints,
    tiny_config,
    torchrun_to_end,
    write_cfg,
)

HP = dict(lr=0.05, freeze_step=3, weight_decay=0.0)
DECAY = [0.01, 0.0, 0.01, 0.0]  # per layer, as param_groups sets it
MASKED = 2  # the layer whose row 1 is masked


class AdamSimulation:
    """1-bit Adam for p workers in one process, one layer at a time, as the module
    docstring of onebit_bert.optim.onebit_adam states it."""

    def __init__(self, world_size, lr, freeze_step, compress, bucket=None, b1=0.9, b2=0.999):
        self.p, self.lr, self.freeze, self.compress = world_size, lr, freeze_step, compress
        self.b1, self.b2, self.eps, self.bucket, self.t = b1, b2, 1e-8, bucket, 0
        self.w = [t.clone() for t in init_params()]
        self.m = [torch.zeros_like(t) for t in self.w]
        self.v = [torch.zeros_like(t) for t in self.w]
        self.exchange = SimulatedMomentumExchange(world_size, bucket)

    def _update(self, i):
        u = self.m[i] / (self.v[i].sqrt() + self.eps) + DECAY[i] * self.w[i]
        self.w[i] = self.w[i] - self.lr * u

    def step(self):
        self.t += 1
        if self.t <= self.freeze:
            for i, g in enumerate(mean_grads(self.p, self.t)):
                self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
                self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
                self._update(i)
            return
        if not self.compress:
            for i, g in enumerate(local_grads(0, self.t)):
                self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
                self._update(i)
            return
        if self.t == self.freeze + 1:
            self.scale = layer_scales(self.m)
        self.m = self.exchange(self.m, self.b1, self.t, self.scale)
        for i in FLAT_ORDER:
            if i == MASKED:
                self.m[i] = self.m[i] * row_mask()
            self._update(i)


def _run_real(comm, steps, bucket, force):
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = OneBitAdam(
        param_groups(params), comm=comm, bucket_numel=bucket, force_compression=force, **HP
    )
    opt.set_momentum_mask(params[MASKED], row_mask())
    stages, byte_counts, params_by_step = [], [], []
    for step in range(1, steps + 1):
        local = opt.syncs_internally
        grads = local_grads(comm.rank, step) if local else mean_grads(comm.world_size, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        stages.append(opt.stage)
        byte_counts.append(opt.last_step_bytes)
        params_by_step.append([p.detach().clone() for p in params])
    return {
        "params": params_by_step,
        "stages": stages,
        "bytes": byte_counts,
        "v": [opt.state[p]["exp_avg_sq"].clone() for p in params],
    }


@pytest.mark.slow
@pytest.mark.parametrize("world_size,bucket", [(1, None), (2, None), (4, 64)])
def test_matches_the_simulation_and_replicas_agree_every_step(world_size, bucket):
    steps = 8
    results = run_ranks(_run_real, world_size, steps, bucket, False)
    sim = AdamSimulation(world_size, HP["lr"], HP["freeze_step"], world_size > 1, bucket)
    for step in range(steps):
        sim.step()
        for res in results:
            for got, want in zip(res["params"][step], sim.w, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for res in results[1:]:
            for a, b in zip(res["params"][step], results[0]["params"][step], strict=True):
                assert torch.equal(a, b), f"replicas differ after step {step + 1}"
    for res in results:
        assert res["stages"] == ["warmup"] * 3 + ["compression"] * 5
        assert all(b == 0 for b in res["bytes"][:3])
        assert all((b > 0) == (world_size > 1) for b in res["bytes"][3:])
        for v_final, v_sim in zip(res["v"], sim.v, strict=True):  # frozen at step 3
            torch.testing.assert_close(v_final, v_sim, rtol=1e-6, atol=0)


def test_world_of_one_is_adam_without_bias_correction_with_v_frozen():
    steps, freeze = 9, 4
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = OneBitAdam(param_groups(params), lr=0.05, freeze_step=freeze, comm=Communicator(None))
    w = [t.clone() for t in init_params()]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    for step in range(1, steps + 1):
        grads = local_grads(0, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):  # Adam, no bias correction; v stops at freeze_step
            m[i] = 0.9 * m[i] + 0.1 * g
            if step <= freeze:
                v[i] = 0.999 * v[i] + 0.001 * g * g
            w[i] = w[i] - 0.05 * (m[i] / (v[i].sqrt() + 1e-8) + DECAY[i] * w[i])
        for p, want in zip(params, w, strict=True):
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    assert opt.stage == "compression" and opt.bytes_sent == 0
    assert opt.last_compression_error is None  # nothing compressed on a world of one
    assert not any("scaling_coeff" in opt.state[p] for p in params)


def test_bias_correction_gives_adamw_steps_then_keeps_the_frozen_correction():
    """With ``bias_correction``: warmup steps are torch's AdamW's; after the freeze, ``m``
    keeps being corrected and ``v`` keeps the correction it had at the freeze."""
    steps, freeze, lr = 9, 4, 0.05
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = OneBitAdam(param_groups(params), lr=lr, freeze_step=freeze, comm=Communicator(None),
                     bias_correction=True)  # fmt: skip
    reference = [torch.nn.Parameter(t) for t in init_params()]
    adamw = torch.optim.AdamW(
        [{"params": [p], "weight_decay": d} for p, d in zip(reference, DECAY, strict=True)],
        lr=lr, betas=(0.9, 0.999), eps=1e-8,
    )  # fmt: skip
    w = [t.clone() for t in init_params()]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    for step in range(1, steps + 1):
        grads = local_grads(0, step)
        for p, q, g in zip(params, reference, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        if step <= freeze:
            adamw.step()
            for p, q in zip(params, reference, strict=True):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        c2 = 1 - 0.999 ** min(step, freeze)
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            if step <= freeze:
                v[i] = 0.999 * v[i] + 0.001 * g * g
            m_hat = m[i] / (1 - 0.9**step)
            w[i] = w[i] - lr * (m_hat / ((v[i] / c2).sqrt() + 1e-8) + DECAY[i] * w[i])
        for p, want in zip(params, w, strict=True):
            torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
    assert opt.stage == "compression"
    # without the correction the same run takes larger steps after the freeze
    plain = [torch.nn.Parameter(t) for t in init_params()]
    uncorrected = OneBitAdam(param_groups(plain), lr=lr, freeze_step=freeze,
                             comm=Communicator(None))  # fmt: skip
    for step in range(1, steps + 1):
        for p, g in zip(plain, local_grads(0, step), strict=True):
            p.grad = g.clone()
        uncorrected.step()
    assert not all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))


# ----------------------------------------------------------------------------- resume


def _resume_run(comm, steps, save_points):
    """The uninterrupted trajectory, then for each save point a fresh optimizer that loads
    the state saved there (through torch.save) and continues; all final parameters."""

    def make():
        params = [torch.nn.Parameter(t) for t in init_params()]
        opt = OneBitAdam(param_groups(params), comm=comm, lr=0.05, freeze_step=3, bucket_numel=64)
        opt.set_momentum_mask(params[MASKED], row_mask())
        return params, opt

    return resumed_toy_runs(comm, make, steps, save_points)


def test_resume_from_either_stage_continues_bit_for_bit():
    # 2: warmup; 3: the last warmup step; 5: compressing, with errors that matter
    for res in run_ranks(_resume_run, 2, 8, (2, 3, 5)):
        for step, params in res["resumed"].items():
            for a, b in zip(res["straight"], params, strict=True):
                assert torch.equal(a, b), f"resumed from step {step}"


# ----------------------------------------------------------------------------- arguments


def _unused_rows_run(comm, which, mask_untrained):
    """An embedding whose rows 8..11 are never looked up, through every stage of 1-bit
    Adam or 0/1 Adam; returns whether those rows moved and the used rows' values."""
    from onebit_bert.optim import ZeroOneAdam

    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 4)
    head = torch.nn.Linear(4, 1)
    params = list(emb.parameters()) + list(head.parameters())
    if which == "onebit_adam":
        opt = OneBitAdam(params, lr=0.01, freeze_step=3, comm=comm)
    else:
        opt = ZeroOneAdam(
            params,
            lr=0.01,
            var_freeze_step=6,
            var_update_scaler=1,
            local_step_scaler=2,
            comm=comm,
        )
    opt.mask_untrained = mask_untrained
    start = emb.weight.detach()[8:].clone()
    embedding_steps(comm, opt, emb, head, 12)
    return {
        "moved": float((emb.weight.detach()[8:] - start).abs().max()),
        "used": emb.weight.detach()[:8].clone(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("which", ["onebit_adam", "zero_one_adam"])
def test_rows_without_gradient_stay_put_under_compression(which):
    # v = 0 there, so DeepSpeed's update m/(sqrt(v)+eps) turns the 1-bit noise into
    # scale/eps; the default masks those elements, and the trained rows still train.
    masked = run_ranks(_unused_rows_run, 2, which, True)
    for res in masked:
        assert res["moved"] == 0.0
    assert torch.equal(masked[0]["used"], masked[1]["used"])
    unmasked = run_ranks(_unused_rows_run, 2, which, False)[0]
    assert unmasked["moved"] > 1.0  # thrown far from their initial values (about 1)
    assert not torch.equal(masked[0]["used"], unmasked["used"])


def test_deepspeed_config_maps_one_to_one():
    params = [torch.nn.Parameter(torch.ones(3))]
    config = {  # DeepSpeedExamples' 1-bit Adam BERT seq-128 settings
        "lr": 4e-4,
        "freeze_step": 23000,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.01,
        "bias_correction": False,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    opt = OneBitAdam.from_deepspeed_config(params, config, comm=Communicator(None))
    assert opt.freeze_step == 23000
    group = opt.param_groups[0]
    assert group["lr"] == 4e-4 and group["weight_decay"] == 0.01 and group["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="unknown 1-bit Adam option"):
        OneBitAdam.from_deepspeed_config(params, {"var_freeze_step": 5})
    with pytest.raises(ValueError, match="AMSGrad"):
        OneBitAdam.from_deepspeed_config(params, {"amsgrad": True})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(freeze_step=0), "freeze_step must be an integer >= 1"),
        (dict(freeze_step="soon"), "or 'auto'"),
        (dict(freeze_step="auto"), "total_steps=schedule.max_steps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(eps=0.0), "eps"),
        (dict(bucket_numel=0), "bucket_numel"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.parametrize(
    "optimizer,strategy,match",
    [
        ({"name": "onebit_adam"}, {"name": "data_parallel"}, "use strategy.name=onebit_adam"),
        ({"name": "lamb"}, {"name": "onebit_adam"}, "needs optimizer.name onebit_adam"),
        ({"name": "onebit_adam", "freeze_step": 0}, {}, "freeze_step must be >= 1"),
        (
            {"name": "onebit_adam", "freeze_step": "later"},
            {},
            r"optimizer\.freeze_step must be int \| \{auto\}, got 'later'",
        ),
    ],
)
def test_bad_configs_name_the_field(optimizer, strategy, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, {"optimizer": optimizer, "strategy": strategy})


# ----------------------------------------------------------------------------- pretraining


def _adam_config(corpus, run_dir):
    # freeze_step auto on a 12-step run: a check every step, and the warmup ends at step 6
    # (min_fraction) if the last check was calm, else at step 7 (max_fraction); a run killed
    # after its step-4 checkpoint resumes with the detector's history and must decide as
    # the straight one, and its step-8 checkpoint is in the compression stage.
    cfg = tiny_config(
        corpus,
        run_dir,
        **{
            "optimizer.name": "onebit_adam",
            "optimizer.lr": 2e-3,
            "optimizer.freeze_step": "auto",
            "schedule.max_steps": 12,
            "checkpoint.every": 4,
            "checkpoint.keep_last": 3,
            "data.validation_every": 6,
        },
    )
    cfg["optimizer"]["auto_freeze"] = {
        "window": 1,
        "threshold": 0.5,
        "patience": 1,
        "min_fraction": 0.5,
        "max_fraction": 0.59,
    }
    return cfg


@pytest.mark.slow
def test_killed_onebit_adam_run_resumes_bit_for_bit(tiny_corpus, tmp_path):
    straight = write_cfg(_adam_config(tiny_corpus, tmp_path / "a"), tmp_path / "a.yaml")
    torchrun_to_end(straight)

    records = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    freeze = records[-1]["freeze_step"]
    assert freeze in (6, 7)
    assert [r["stage"] for r in records] == ["warmup"] * freeze + ["compression"] * (12 - freeze)
    assert [r["grad_sync"] for r in records] == (
        ["allreduce"] * freeze + ["optimizer"] * (12 - freeze)
    )
    assert all(r["freeze_statistic"] >= 0 for r in records[1:])
    warm, compressed = records[0], records[-1]
    assert warm["comm_bytes_gradients"] > 0 and "comm_bytes_momentum" not in warm
    assert "comm_bytes_gradients" not in compressed
    assert 0 < compressed["comm_bytes_momentum"] < warm["comm_bytes_gradients"] / 10

    # killed in the warmup (after checkpoint 4), then in the compression stage (after 8)
    killed = write_cfg(_adam_config(tiny_corpus, tmp_path / "b"), tmp_path / "b.yaml")
    run_killing_after_checkpoints(killed, tmp_path / "b", (4, 8), 12)

    assert_same_checkpoints(
        tmp_path / "a", tmp_path / "b", (4, 8, 12), ("model", "optimizer"), ("optimizer",)
    )
    by_step = {r["step"]: r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r}
    for record in records:
        assert by_step[record["step"]]["loss"] == record["loss"], record["step"]
