"""0/1 Adam: its schedules as DeepSpeed's code runs them, against a plain simulation of p
workers at world sizes 1, 2, 4 (real gloo ranks; replicas bit-identical after every
synchronisation), Adam on averaged gradients when every step updates the variance, exact
resume from every kind of step, configs, and a pretraining run killed with SIGKILL in its
variance stage and again between two synchronisations that resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.distributed import Communicator
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim import ZeroOneAdam
from onebit_bert.optim.build import OptimizerConfig
from onebit_bert.strategies import StrategyConfig, build_strategy, resolve_strategy_name
from pretrain.config import PretrainConfig
from tests.helpers.checkpoints import assert_same_checkpoints, load_checkpoint
from tests.helpers.compression import (
    FLAT_ORDER,
    init_params,
    local_grads,
    mean_grads,
    param_groups,
    resumed_toy_runs,
    row_mask,
    simulate,
)
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import (
    dist_context,
    run_killing_after_checkpoints,
    tiny_config,
    torchrun_to_end,
    write_cfg,
)
from tests.helpers.toy import ToyConfig, build_model

DECAY = [0.01, 0.0, 0.01, 0.0]  # per layer, as param_groups sets it
MASKED = 2  # the layer whose row 1 is masked
HP = dict(
    lr=0.05, var_freeze_step=10, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4
)
STEPS = 20
# Steps 1-10: the variance stage (V: variance step, C: 1-bit gradient average), two variance
# steps (kappa) per interval of 1, 2, 4; steps 11-20: local steps (S: ending in the 1-bit
# synchronisation, L: local only), the interval doubling every 2 steps up to 4.
SCHEDULE = "VVCVCVCVCC" + "SSLSLSLLLS"
KIND = {"V": "variance", "C": "compressed", "L": "local", "S": "sync"}


def test_schedules_follow_deepspeeds_rules():
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = ZeroOneAdam(param_groups(params), comm=Communicator(None), **HP)
    kinds, intervals = [], []
    for step in range(1, STEPS + 1):
        assert opt.syncs_internally == (SCHEDULE[step - 1] != "V")
        for p, g in zip(params, local_grads(0, step), strict=True):
            p.grad = g
        opt.step()
        kinds.append(opt.stage)
        intervals.append((opt.var_interval, opt.local_step_interval))
    assert kinds == [KIND[c] for c in SCHEDULE]
    assert [v for v, _ in intervals[:10]] == [1, 2, 2, 2, 2, 4, 4, 4, 4, 4]
    assert [h for _, h in intervals[10:]] == [1, 2, 2, 4, 4, 4, 4, 4, 4, 4]


class ZeroOneSimulation:
    """0/1 Adam for p workers in one process, one layer at a time (module docstring of
    onebit_bert.optim.zero_one_adam); every worker keeps its own x, m and u."""

    def __init__(
        self,
        world_size,
        compress,
        lr,
        var_freeze_step,
        var_update_scaler,
        local_step_scaler,
        local_step_clipper,
        b1=0.9,
        b2=0.999,
    ):
        self.p, self.compress, self.lr = world_size, compress, lr
        self.vfs, self.kappa = var_freeze_step, var_update_scaler
        self.scaler, self.clipper = local_step_scaler, local_step_clipper
        self.b1, self.b2, self.eps, self.t = b1, b2, 1e-8, 0
        start = init_params()
        self.x = [[t.clone() for t in start] for _ in range(world_size)]
        self.m = [[torch.zeros_like(t) for t in start] for _ in range(world_size)]
        self.u = [[torch.zeros_like(t) for t in start] for _ in range(world_size)]
        self.v = [torch.zeros_like(t) for t in start]
        self.var_interval, self.var_counter = 1, 0
        self.interval, self.counter, self.lrs = 1, 0, 0.0
        self.numel = sum(t.numel() for t in start)
        quantum = 8 * world_size
        self.padded = -(-self.numel // quantum) * quantum
        self.scale = None

    def _reset_errors(self):
        self.ew = [torch.zeros(self.padded) for _ in range(self.p)]
        self.es = [torch.zeros(self.padded // self.p) for _ in range(self.p)]

    def _scales(self):
        rms = [m.norm().item() / math.sqrt(m.numel()) for m in self.m[0]]
        return [sum(rms) / len(rms) / r for r in rms]

    def _average(self, per_rank):
        """C(.) over ranks: scaled, fused, 1-bit averaged, unscaled, masked."""
        if not self.compress:
            return per_rank[0]
        inputs = []
        for tensors in per_rank:
            flat = torch.zeros(self.padded)
            flat[: self.numel] = torch.cat(
                [(tensors[i] * self.scale[i]).reshape(-1) for i in FLAT_ORDER]
            )
            inputs.append(flat)
        out = simulate(inputs, self.ew, self.es, self.numel)
        result, offset = [None] * len(FLAT_ORDER), 0
        for i in FLAT_ORDER:
            n = per_rank[0][i].numel()
            result[i] = out[offset : offset + n].view_as(per_rank[0][i]) / self.scale[i]
            offset += n
        result[MASKED] = result[MASKED] * row_mask()
        return result

    def _denom(self, i):
        return self.v[i].sqrt() + self.eps

    def step(self):
        self.t += 1
        t = self.t
        if t == 1:
            self._reset_errors()
        if t <= self.vfs:
            if t % self.var_interval == 0:
                g = mean_grads(self.p, t)
                for i in range(len(g)):
                    self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g[i] * g[i]
            else:
                if self.scale is None:
                    self.scale = self._scales()
                g = self._average([local_grads(r, t) for r in range(self.p)])
            for r in range(self.p):
                for i in range(len(g)):
                    self.m[r][i] = self.b1 * self.m[r][i] + (1 - self.b1) * g[i]
                    d = self.m[r][i] / self._denom(i) + DECAY[i] * self.x[r][i]
                    self.x[r][i] = self.x[r][i] - self.lr * d
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.kappa:
                    self.var_counter, self.var_interval = 0, 2 * self.var_interval
            return
        if t == self.vfs + 1:
            self._reset_errors()
            self.scale = self._scales()
            self.synced = [t.clone() for t in self.x[0]]
        for r in range(self.p):
            for i, g in enumerate(local_grads(r, t)):
                self.m[r][i] = self.b1 * self.m[r][i] + (1 - self.b1) * g
                d = self.m[r][i] / self._denom(i) + DECAY[i] * self.x[r][i]
                self.x[r][i] = self.x[r][i] - self.lr * d
                self.u[r][i] = self.u[r][i] - self.lr * d
        self.lrs += self.lr
        if t % self.interval == 0:
            u = self._average(
                [[u * self._denom(i) for i, u in enumerate(self.u[r])] for r in range(self.p)]
            )
            for r in range(self.p):
                self.m[r] = [-ui / self.lrs for ui in u]
                self.x[r] = [
                    s + ui / self._denom(i)
                    for i, (s, ui) in enumerate(zip(self.synced, u, strict=True))
                ]
                self.u[r] = [torch.zeros_like(ui) for ui in u]
            self.synced = [x.clone() for x in self.x[0]]
            self.lrs = 0.0
        self.counter += 1
        if self.counter == self.scaler:
            self.counter, self.interval = 0, min(self.clipper, 2 * self.interval)


def _run_real(comm, steps, hp, codec=None):
    """The optimizer on real ranks (``codec``: a codec name set in place of the default
    one); per step its stage, the kinds it sent and the parameters."""
    from onebit_bert.distributed.codecs import build_codec

    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = ZeroOneAdam(param_groups(params), comm=comm, **hp)
    opt.set_momentum_mask(params[MASKED], row_mask())
    if codec is not None:
        opt.set_codec(build_codec(codec, comm))
    out = {"params": [], "stages": [], "kinds": []}
    for step in range(1, steps + 1):
        local = opt.syncs_internally
        grads = local_grads(comm.rank, step) if local else mean_grads(comm.world_size, step)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        before = comm.snapshot()
        opt.step()
        delta = comm.snapshot() - before
        out["stages"].append(opt.stage)
        out["kinds"].append({k: v[0] for k, v in delta.by_kind.items()})
        out["params"].append([p.detach().clone() for p in params])
    out["codec_state"] = sorted(opt.state_dict()["per_rank"].get("codec") or {})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_the_simulation_and_replicas_agree_after_every_sync(world_size):
    results = run_ranks(_run_real, world_size, STEPS, HP)
    sim = ZeroOneSimulation(world_size, world_size > 1, **HP)
    for step in range(STEPS):
        sim.step()
        for rank, res in enumerate(results):
            for got, want in zip(res["params"][step], sim.x[rank], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
        if SCHEDULE[step] != "L":
            for res in results[1:]:
                for a, b in zip(res["params"][step], results[0]["params"][step], strict=True):
                    assert torch.equal(a, b), f"replicas differ after step {step + 1}"
    if world_size > 1:  # between synchronisations the ranks step on their own
        assert not torch.equal(results[0]["params"][12][0], results[1]["params"][12][0])
    for res in results:
        assert res["stages"] == [KIND[c] for c in SCHEDULE]
        for kind, sent in zip(SCHEDULE, res["kinds"], strict=True):
            expected = {
                "V": set(),  # the caller averages (here: the test, without sending)
                "C": {"gradients"},  # 1-bit gradients
                "L": set(),
                "S": {"momentum"},  # 1-bit accumulator
            }[kind]
            assert set(sent) == (expected if world_size > 1 else set()), kind
            assert all(b > 0 for b in sent.values())


def _adam_on_averaged_gradients(comm, steps):
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = ZeroOneAdam(
        param_groups(params), comm=comm, lr=0.05, var_freeze_step=10**6, var_update_scaler=10**6
    )
    for step in range(1, steps + 1):
        assert not opt.syncs_internally
        for p, g in zip(params, mean_grads(comm.world_size, step), strict=True):
            p.grad = g
        opt.step()
    return {"params": [p.detach() for p in params], "sent": opt.bytes_sent}


def test_every_step_a_variance_step_is_adam_on_averaged_gradients():
    steps = 6
    results = run_ranks(_adam_on_averaged_gradients, 2, steps)
    w = [t.clone() for t in init_params()]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    for step in range(1, steps + 1):
        for i, g in enumerate(mean_grads(2, step)):  # Adam, no bias correction
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            w[i] = w[i] - 0.05 * (m[i] / (v[i].sqrt() + 1e-8) + DECAY[i] * w[i])
    for res in results:
        assert res["sent"] == 0
        for got, want in zip(res["params"], w, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- resume


def _resume_run(comm, save_points):
    """The uninterrupted trajectory; then, for each save point, a fresh optimizer that
    loads this rank's saved parameters and state (through torch.save) and continues."""

    def make():
        params = [torch.nn.Parameter(t) for t in init_params()]
        opt = ZeroOneAdam(param_groups(params), comm=comm, bucket_numel=64, **HP)
        opt.set_momentum_mask(params[MASKED], row_mask())
        return params, opt

    return resumed_toy_runs(comm, make, STEPS, save_points)


def test_resume_from_every_kind_of_step_continues_bit_for_bit():
    # 2: V (interval doubles), 3: C, 10: last of the variance stage, 11: S, 13 and 17:
    # L (between synchronisations: per-rank parameters, momentum and accumulator)
    for res in run_ranks(_resume_run, 2, (2, 3, 10, 11, 13, 17)):
        for step, params in res["resumed"].items():
            for a, b in zip(res["straight"], params, strict=True):
                assert torch.equal(a, b), f"resumed from step {step}"


def test_state_without_this_ranks_part_restarts_from_the_last_sync():
    params = [torch.nn.Parameter(t) for t in init_params()]
    opt = ZeroOneAdam(param_groups(params), comm=Communicator(None), **HP)
    for step in range(1, 14):  # step 13 is local: the ranks would disagree here
        for p, g in zip(params, local_grads(0, step), strict=True):
            p.grad = g
        opt.step()
    assert not opt.replicas_agree
    synced = [opt.synced_parameter(p).clone() for p in params]
    state = opt.state_dict()
    state["per_rank"] = None
    fresh = [torch.nn.Parameter(t) for t in init_params()]
    other = ZeroOneAdam(param_groups(fresh), comm=Communicator(None), **HP)
    with pytest.warns(UserWarning, match="restarting from the last synchronisation"):
        other.load_state_dict(state)
    assert other.replicas_agree
    for p, want in zip(fresh, synced, strict=True):
        assert torch.equal(p.detach(), want)


# ----------------------------------------------------------------------------- configs


def test_deepspeed_config_maps_one_to_one():
    params = [torch.nn.Parameter(torch.ones(3))]
    config = {  # DeepSpeedExamples' 0/1 Adam BERT seq-128 settings
        "lr": 4e-4,
        "weight_decay": 0.01,
        "bias_correction": False,
        "var_freeze_step": 12500,
        "local_step_scaler": 32678,
        "cuda_aware": False,
        "comm_backend_name": "nccl",
    }
    opt = ZeroOneAdam.from_deepspeed_config(params, config, comm=Communicator(None))
    assert (opt.var_freeze_step, opt.local_step_scaler) == (12500, 32678)
    assert (opt.var_update_scaler, opt.local_step_clipper) == (16, 16)  # DeepSpeed's defaults
    assert opt.param_groups[0]["lr"] == 4e-4
    with pytest.raises(ValueError, match="unknown 0/1 Adam option"):
        ZeroOneAdam.from_deepspeed_config(params, {"freeze_step": 5})


@pytest.mark.parametrize(
    "optimizer,strategy,match",
    [
        ({"var_update_scaler": 0}, {}, r"optimizer: var_update_scaler must be an integer >= 1"),
        ({"local_step_clipper": 0}, {}, "DeepSpeed's default is 16"),
        ({"var_freeze_step": -1}, {}, "var_freeze_step must be an integer >= 1"),
        ({"freeze_step": "auto"}, {}, "set optimizer.var_freeze_step instead"),
        ({}, {"name": "data_parallel"}, "use strategy.name=zero_one_adam"),
        ({}, {"name": "onebit_adam"}, "needs optimizer.name onebit_adam"),
    ],
)
def test_bad_configs_name_the_field(optimizer, strategy, match):
    raw = {"optimizer": {"name": "zero_one_adam", **optimizer}, "strategy": strategy}
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, raw)


@pytest.mark.parametrize("value", [0, 2.5, True])
def test_bad_arguments(value):
    with pytest.raises(ValueError, match="local_step_scaler must be an integer >= 1"):
        ZeroOneAdam([torch.nn.Parameter(torch.ones(2))], local_step_scaler=value)


def _answers(strategy_name, optimizer, steps, **optimizer_fields):
    """``gradient_sync()`` before each of ``steps`` steps of a toy model on one process."""
    model = build_model(ToyConfig(width=4, inputs=3))
    strategy = build_strategy(
        StrategyConfig(name=strategy_name, force_compression=True),
        OptimizerConfig(name=optimizer, **optimizer_fields),
        model,
        model,
        dist_context(Communicator(None)),
    )
    answers = []
    for _ in range(steps):
        answers.append(strategy.gradient_sync())
        model(torch.ones(2, 3)).sum().backward()
        strategy.after_backward()
        strategy.step()
        strategy.optimizer.zero_grad(set_to_none=True)
        strategy.after_step(len(answers))
    return answers


def test_each_strategy_says_how_its_gradients_are_synced():
    assert _answers("auto", "lamb", 3) == ["allreduce"] * 3
    assert _answers("slowmo", "lamb", 3) == ["none"] * 3  # the base strategy's default
    assert (
        _answers("auto", "onebit_lamb", 4, freeze_step=2) == ["allreduce"] * 2 + ["optimizer"] * 2
    )
    assert _answers("auto", "onebit_adam", 4, freeze_step=3) == ["allreduce"] * 3 + ["optimizer"]
    zero_one = _answers("auto", "zero_one_adam", STEPS, **HP)
    assert zero_one == ["allreduce" if c == "V" else "optimizer" for c in SCHEDULE]
    for name in ("onebit_lamb", "onebit_adam", "zero_one_adam"):
        optimizer = OptimizerConfig(name=name)
        assert resolve_strategy_name(StrategyConfig(name="auto"), optimizer) == name


# ----------------------------------------------------------------------------- pretraining

# var_update_scaler 1: variance steps at 1, 2, 4 (C at 3); local steps from 5 with the
# interval 1, 1 | 2, 2 | 4, ...: S S L S L L L S. Checkpoints every 3 steps: 3 (C), 6 (S),
# 9 (L, between synchronisations); validation at 5 (S) and 10 (L: the synced model).
PRETRAIN_SCHEDULE = "VVCV" + "SSLSLLLS"


def _zero_one_config(corpus, run_dir):
    return tiny_config(
        corpus,
        run_dir,
        **{
            "optimizer.name": "zero_one_adam",
            "optimizer.lr": 2e-3,
            "optimizer.var_freeze_step": 4,
            "optimizer.var_update_scaler": 1,
            "optimizer.local_step_scaler": 2,
            "optimizer.local_step_clipper": 4,
            "schedule.max_steps": 12,
            "checkpoint.every": 3,
            "checkpoint.keep_last": 4,
            "data.validation_every": 5,
        },
    )


@pytest.mark.slow
def test_killed_zero_one_adam_run_resumes_in_each_stage(tiny_corpus, tmp_path):
    straight = write_cfg(_zero_one_config(tiny_corpus, tmp_path / "a"), tmp_path / "a.yaml")
    torchrun_to_end(straight)

    records = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert [r["stage"] for r in records] == [KIND[c] for c in PRETRAIN_SCHEDULE]
    assert [r["grad_sync"] for r in records] == [
        "allreduce" if c == "V" else "optimizer" for c in PRETRAIN_SCHEDULE
    ]
    full = records[0]["comm_bytes_gradients"]  # fp32 gradients, 2 ranks: their size once
    for kind, r in zip(PRETRAIN_SCHEDULE, records, strict=True):
        sent = {k[len("comm_bytes_") :]: v for k, v in r.items() if k.startswith("comm_bytes_")}
        sent.pop("statistics", None)  # counted after the step, if at all
        if kind == "V":
            assert sent == {"gradients": full}
        elif kind == "C":
            assert set(sent) == {"gradients"} and 0 < sent["gradients"] < full / 10
        elif kind == "S":
            assert set(sent) == {"momentum"} and 0 < sent["momentum"] < full / 10
        else:
            assert sent == {}
    assert records[-1]["var_interval"] == 8 and records[-1]["local_step_interval"] == 4

    # killed in the variance stage (after checkpoint 3, a 1-bit gradient step), then between
    # two synchronisations (after 9)
    killed = write_cfg(_zero_one_config(tiny_corpus, tmp_path / "b"), tmp_path / "b.yaml")
    run_killing_after_checkpoints(killed, tmp_path / "b", (3, 9), 12)

    shared, ranks = load_checkpoint(tmp_path / "a", 9)
    assert not torch.equal(ranks[0]["params"], ranks[1]["params"])  # between two syncs
    assert_same_checkpoints(
        tmp_path / "a",
        tmp_path / "b",
        (3, 6, 9, 12),
        ("model", "optimizer"),
        ("optimizer",),
        optional_rank_keys=("params",),
    )

    def by_step(run, key):
        records = read_metrics(tmp_path / run / "metrics.jsonl")
        return {r["step"]: r[key] for r in records if key in r}

    for key in ("loss", "val_mlm_loss"):
        assert by_step("a", key) == by_step("b", key), key


def test_per_tensor_scales_compress_each_layer_on_its_own():
    """``comm.compression.momentum: onebit_tensor``: 0/1 Adam's 1-bit gradient averages
    and synchronisations compress every layer with scales of its own; replicas agree after
    every synchronisation and the trajectory differs from the fused buffer's."""
    ranks = run_ranks(_run_real, 2, STEPS, HP, "onebit_tensor")
    fused = run_ranks(_run_real, 2, STEPS, HP)
    for step, kind in enumerate(SCHEDULE):
        if kind != "L":
            for a, b in zip(ranks[0]["params"][step], ranks[1]["params"][step], strict=True):
                assert torch.equal(a, b)
        if kind in "CS":
            assert set(ranks[0]["kinds"][step]) == {"gradients" if kind == "C" else "momentum"}
    layers = len(init_params())
    assert ranks[0]["codec_state"] == sorted(
        [f"gradients/{i}" for i in range(layers)] + [f"momentum/{i}" for i in range(layers)]
    )
    assert not torch.equal(ranks[0]["params"][-1][0], fused[0]["params"][-1][0])
