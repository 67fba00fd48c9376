"""Decentralised strategies (decentlam, dmsgd): the mixing matrices, the special cases
against single-process references on real gloo ranks (exact average = parallel momentum
SGD; beta 0 = decentralised SGD; any doubly stochastic graph keeps the ranks' average on
the momentum-SGD path), bytes per exchange, refusals, configs, and exact resume of a
pretraining run killed after a checkpoint."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.distributed import Communicator, DistContext, LaunchEnv
from onebit_bert.distributed.topology import (
    check_decentlam,
    check_doubly_stochastic,
    check_topology,
    decentlam_growth,
    largest_stable_momentum,
    mixing_at,
    mixing_matrix,
    period,
)
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim import MomentumSGD
from onebit_bert.optim.build import weight_decay_groups
from onebit_bert.strategies import Decentralized, StrategyConfig
from pretrain.config import PretrainConfig
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.toy import STRATEGY_TOY as TOY
from tests.helpers.toy import build_model, flat_params, toy_loss

LR = 0.05
STEPS = 6
WORLD = 4
ATOL = 2e-5
# The pretraining helpers (tests.helpers.runs, pretrain.train) load transformers: they are
# imported inside the pretraining test, so that the spawned ranks start quickly.


def _context(comm: Communicator) -> DistContext:
    launch = LaunchEnv(comm.rank, comm.world_size, comm.rank, "127.0.0.1", 0, "test")
    return DistContext(launch, "gloo" if comm.world_size > 1 else None, torch.device("cpu"), comm)


def _build_time_context(world_size: int) -> DistContext:
    """Rank 0 of ``world_size`` without a process group: enough for the checks a strategy
    makes when it is built."""
    launch = LaunchEnv(0, world_size, 0, "127.0.0.1", 0, "test")
    return DistContext(launch, None, torch.device("cpu"), Communicator(None))


# ----------------------------------------------------------------------------- topologies


def test_ring_and_exponential_weights_follow_bluefog():
    ring = mixing_matrix(mixing_at("ring", 5))
    assert ring[2, 1] == ring[2, 3] == ring[2, 2] == pytest.approx(1 / 3)
    assert ring[2, 0] == ring[2, 4] == 0
    # two ranks: left and right neighbour coincide, counted once (BlueFog's RingGraph(2))
    assert mixing_at("ring", 2).shifts == ((1, 0.5),)
    assert torch.equal(mixing_matrix(mixing_at("ring", 2)), torch.full((2, 2), 0.5).double())
    assert mixing_at("ring", 1).shifts == ()
    # static exponential: receive from i - 1, i - 2, i - 4 (ceil(log2 6) = 3), 1/4 each
    expo = mixing_at("exponential", 6)
    assert expo.shifts == ((1, 0.25), (2, 0.25), (4, 0.25)) and expo.self_weight == 0.25
    assert mixing_matrix(expo)[0].tolist() == [0.25, 0, 0.25, 0, 0.25, 0.25]
    assert mixing_at("exponential", 8).neighbours == 3
    for n in range(1, 10):
        for topology in ("ring", "exponential", "full"):
            check_topology(topology, n)  # doubly stochastic on every world size


def test_one_peer_rounds_multiply_to_the_exact_average():
    for n in (2, 4, 8, 16):
        assert period("one_peer_exponential", n) == n.bit_length() - 1
        for start in (0, 1, 5):
            product = torch.eye(n, dtype=torch.float64)
            for k in range(start, start + period("one_peer_exponential", n)):
                mixing = mixing_at("one_peer_exponential", n, k)
                assert mixing.shifts == ((2 ** (k % period("one_peer_exponential", n)), 0.5),)
                product = mixing_matrix(mixing) @ product
            torch.testing.assert_close(product, torch.full((n, n), 1 / n).double())
    # fewer rounds do not average
    two = mixing_matrix(mixing_at("one_peer_exponential", 8, 0))
    assert not torch.allclose(two @ two, torch.full((8, 8), 1 / 8).double())


def test_topologies_that_cannot_run_are_refused():
    with pytest.raises(ValueError, match="power-of-2 number of ranks, got 6"):
        check_topology("one_peer_exponential", 6)
    check_topology("one_peer_exponential", 8)
    row_stochastic = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    with pytest.raises(ValueError, match="not doubly stochastic"):
        check_doubly_stochastic(row_stochastic.double(), "a test graph")
    # at strategy build, where the world size is known
    ctx = _build_time_context(6)
    model = build_model(TOY)
    cfg = StrategyConfig(name="decentlam", topology="one_peer_exponential")
    with pytest.raises(ValueError, match="use strategy.topology exponential"):
        Decentralized(model, model, _sgd(model, 0.9, 0.0), ctx, cfg, "decentlam")


def _disagreement_growth(topology: str, n: int, beta: float, steps: int = 400) -> float:
    """DecentLaM's textbook update without gradients (x = W x - lr beta m, m = beta m +
    (x - W x) / lr) from a random disagreement: the per-step growth of its norm over the
    second half of ``steps``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    x -= x.mean(0)  # the average stays 0: no rounding floor under the disagreement
    m, lr, norms = torch.zeros_like(x), 0.1, []
    for step in range(steps):
        w = mixing_matrix(mixing_at(topology, n, step))
        mixed = w @ x
        x, m = mixed - lr * beta * m, beta * m + (x - mixed) / lr
        norms.append(torch.linalg.norm(x - x.mean(0)).item())
    half = steps // 2
    return (norms[-1] / norms[half - 1]) ** (1 / (steps - half))


@pytest.mark.parametrize(
    ("topology", "n", "beta", "stable"),
    [
        ("ring", 4, 0.9, True),
        ("ring", 8, 0.99, True),
        ("exponential", 4, 0.9, False),
        ("exponential", 4, 0.5, True),
        ("one_peer_exponential", 4, 0.9, False),
        ("one_peer_exponential", 8, 0.5, True),
        ("one_peer_exponential", 8, 0.9, False),
    ],
)
def test_decentlam_growth_predicts_the_simulated_disagreement(topology, n, beta, stable):
    """The per-mode analysis equals what the update does, and tells the directed graphs at
    large momentum (growing) from the ring (shrinking at sqrt(beta) per step)."""
    predicted = decentlam_growth(topology, n, beta)
    assert (predicted < 1) == stable
    assert _disagreement_growth(topology, n, beta) == pytest.approx(predicted, rel=0.01)
    if topology == "ring":
        assert predicted == pytest.approx(beta**0.5, rel=1e-6)


def test_unstable_decentlam_graphs_are_refused_with_the_fix():
    check_decentlam("ring", 64, 0.99)
    check_decentlam("one_peer_exponential", 4, 0.5)
    assert largest_stable_momentum("one_peer_exponential", 4) == 0.76
    with pytest.raises(ValueError) as info:
        check_decentlam("one_peer_exponential", 4, 0.9)
    message = str(info.value)
    assert "grows 1.080x per step" in message and "optimizer.betas[0] <= 0.76" in message
    assert "strategy.topology ring" in message and "strategy.name dmsgd" in message
    # at strategy build, with the optimizer's momentum; DmSGD takes the same graph
    ctx = _build_time_context(4)
    model = build_model(TOY)
    cfg = StrategyConfig(name="decentlam", topology="exponential")
    with pytest.raises(ValueError, match="strategy decentlam on strategy.topology exponential"):
        Decentralized(model, model, _sgd(model, 0.9, 0.0), ctx, cfg, "decentlam")
    dmsgd = Decentralized(model, model, _sgd(model, 0.9, 0.0), ctx, cfg, "dmsgd")
    assert dmsgd.topology == "exponential"
    default = StrategyConfig(name="decentlam")
    assert (
        Decentralized(model, model, _sgd(model, 0.9, 0.0), ctx, default, "decentlam").topology
        == "ring"
    )


# ----------------------------------------------------------------------------- toy runs


def _sgd(model: nn.Module, beta: float, wd: float) -> MomentumSGD:
    return MomentumSGD(weight_decay_groups(model.named_parameters(), wd), lr=LR, momentum=beta)


def _one_run(comm, name, topology, beta=0.9, wd=0.0, layerwise="none", lrs=None) -> dict:
    """Train the toy model; per step this rank's parameters before and after, gradient,
    momentum after, and bytes by kind; at the end the metrics and the evaluation model."""
    model = build_model(TOY)
    opt = _sgd(model, beta, wd)
    cfg = StrategyConfig(name=name, topology=topology, layerwise=layerwise, consensus_every=STEPS)
    strategy = Decentralized(model, model, opt, _context(comm), cfg, name, (0.05, 2.0))
    out = {k: [] for k in ("before", "grad", "momentum", "after", "bytes")}
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = LR if lrs is None else lrs[step]
        out["before"].append(strategy.flat.read())
        toy_loss(model, comm.rank, step).backward()
        out["grad"].append(strategy.flat.read_grads())
        before = comm.snapshot()
        strategy.after_backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        out["after"].append(strategy.flat.read())
        out["momentum"].append(strategy.momentum.clone())
        strategy.after_step(step + 1)
        out["bytes"].append({k: v[0] for k, v in (comm.snapshot() - before).by_kind.items()})
    out["metrics"] = strategy.metrics()
    out["eval"] = flat_params(strategy.eval_model())
    out["local_after_eval"] = strategy.flat.read()
    return out


RUNS = {
    "decentlam_full": ("decentlam", "full"),
    "dmsgd_full": ("dmsgd", "full"),
    "decentlam_ring_b0": ("decentlam", "ring", 0.0),
    "dmsgd_ring_b0": ("dmsgd", "ring", 0.0),
    "decentlam_ring": ("decentlam", "ring", 0.9, 0.1),
    "dmsgd_ring": ("dmsgd", "ring", 0.9, 0.1),
    # beta 0.5: at 0.9 DecentLaM diverges on the directed one-peer graph (refused)
    "decentlam_one_peer": ("decentlam", "one_peer_exponential", 0.5, 0.1),
    "dmsgd_exponential": ("dmsgd", "exponential", 0.5),
    "decentlam_ring_lamb": ("decentlam", "ring", 0.9, 0.1, "lamb"),
    "decentlam_ring_warmup": ("decentlam", "ring", 0.9, 0.0, "none", [0.0] + [LR] * 5),
}


def _resumed_run(comm) -> dict:
    """decentlam_ring's run, stopped after 3 steps: its state into fresh objects, then 3
    more steps."""
    half = STEPS // 2
    model = build_model(TOY)
    opt = _sgd(model, 0.9, 0.1)
    cfg = StrategyConfig(name="decentlam", topology="ring", consensus_every=STEPS)
    strategy = Decentralized(model, model, opt, _context(comm), cfg, "decentlam")
    out = {}
    for step in range(STEPS):
        if step == half:  # what a checkpoint keeps, loaded as a resume loads it
            shared, per_rank = copy.deepcopy(strategy.state_dict())
            average = copy.deepcopy(strategy.shared_model_state())
            model = build_model(TOY)
            opt = _sgd(model, 0.9, 0.1)
            strategy = Decentralized(model, model, opt, _context(comm), cfg, "decentlam")
            model.load_state_dict(average)
            strategy.load_state_dict(shared, per_rank)
        toy_loss(model, comm.rank, step).backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(step + 1)
    out["params"], out["momentum"] = strategy.flat.read(), strategy.momentum
    out["metrics"] = strategy.metrics()
    return out


def _all_runs(comm) -> dict:
    torch.set_num_threads(1)
    out = {key: _one_run(comm, *spec) for key, spec in RUNS.items()}
    out["resumed"] = _resumed_run(comm)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every toy run on 4 gloo ranks, in one process group: ``runs[key][rank]``."""
    ranks = run_ranks(_all_runs, WORLD)
    return {key: [r[key] for r in ranks] for key in [*RUNS, "resumed"]}


def _grad(point: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    model = build_model(TOY)
    torch.nn.utils.vector_to_parameters(point, model.parameters())
    toy_loss(model, rank, step).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _decay_mask(wd: float) -> torch.Tensor:
    model = build_model(TOY)
    return torch.cat(
        [torch.full((p.numel(),), 0.0 if n.endswith("bias") else wd) for n, p in
         model.named_parameters()]
    )  # fmt: skip


def _simulate(method: str, topology: str, beta: float, wd: float) -> list[torch.Tensor]:
    """The textbook updates with the matrices W in one process: rows are ranks."""
    n, decay = WORLD, _decay_mask(wd)
    x = flat_params(build_model(TOY)).repeat(n, 1)
    m = torch.zeros_like(x)
    out = []
    for step in range(STEPS):
        w = mixing_matrix(mixing_at(topology, n, step)).float()
        g = torch.stack([_grad(x[i], i, step) for i in range(n)])
        if method == "decentlam":
            mixed = w @ (x - LR * g)
            m = beta * m + (x - mixed) / LR
            x = x - LR * (m + decay * x)
        elif method == "dmsgd":
            m = beta * m + g
            x = w @ (x - LR * (m + decay * x))
        else:  # decentralised SGD, adapt then combine
            x = w @ (x - LR * g)
        out.append(x)
    return out


def _parallel_momentum_sgd(beta: float) -> list[torch.Tensor]:
    x = flat_params(build_model(TOY))
    m, out = torch.zeros_like(x), []
    for step in range(STEPS):
        m = beta * m + torch.stack([_grad(x, r, step) for r in range(WORLD)]).mean(0)
        x = x - LR * m
        out.append(x)
    return out


def test_exact_average_makes_both_methods_parallel_momentum_sgd(runs):
    reference = _parallel_momentum_sgd(0.9)
    for key in ("decentlam_full", "dmsgd_full"):
        for rank in runs[key]:
            for got, want in zip(rank["after"], reference, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_without_momentum_both_methods_are_decentralised_sgd(runs):
    reference = _simulate("dsgd", "ring", 0.0, 0.0)
    for r in range(WORLD):
        for step in range(STEPS):
            want = reference[step][r]
            for key in ("decentlam_ring_b0", "dmsgd_ring_b0"):
                torch.testing.assert_close(runs[key][r]["after"][step], want, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("key", "method", "topology", "beta", "wd"),
    [
        ("decentlam_ring", "decentlam", "ring", 0.9, 0.1),
        ("dmsgd_ring", "dmsgd", "ring", 0.9, 0.1),
        ("decentlam_one_peer", "decentlam", "one_peer_exponential", 0.5, 0.1),
        ("dmsgd_exponential", "dmsgd", "exponential", 0.5, 0.0),
    ],
)
def test_ranks_follow_the_single_process_reference(runs, key, method, topology, beta, wd):
    reference = _simulate(method, topology, beta, wd)
    for r in range(WORLD):
        for step in range(STEPS):
            torch.testing.assert_close(
                runs[key][r]["after"][step], reference[step][r], rtol=0, atol=ATOL
            )
    # a graph that is not the exact average lets the ranks drift apart
    assert not torch.allclose(runs[key][0]["after"][-1], runs[key][1]["after"][-1], atol=1e-4)


@pytest.mark.parametrize("key", ["decentlam_ring", "dmsgd_ring", "decentlam_one_peer"])
def test_average_of_the_ranks_follows_momentum_sgd_step_by_step(runs, key):
    """m̄ ← β m̄ + ḡ and x̄ ← x̄ − γ (m̄ + wd x̄), with ḡ the mean of the ranks' gradients."""
    ranks, beta, decay = runs[key], RUNS[key][2], _decay_mask(0.1)
    momentum = torch.zeros_like(ranks[0]["before"][0])
    for step in range(STEPS):
        mean_x = torch.stack([r["before"][step] for r in ranks]).mean(0)
        mean_g = torch.stack([r["grad"][step] for r in ranks]).mean(0)
        momentum = beta * momentum + mean_g
        got_m = torch.stack([r["momentum"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(got_m, momentum, rtol=0, atol=ATOL)
        momentum = got_m  # per step: no accumulation of rounding
        want = mean_x - LR * (momentum + decay * mean_x)
        got = torch.stack([r["after"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_a_zero_learning_rate_step_moves_nothing_and_keeps_the_mixed_gradient(runs):
    ranks = runs["decentlam_ring_warmup"]
    w = mixing_matrix(mixing_at("ring", WORLD)).float()
    grads = torch.stack([r["grad"][0] for r in ranks])
    for r, rank in enumerate(ranks):
        assert torch.equal(rank["after"][0], rank["before"][0])
        torch.testing.assert_close(rank["momentum"][0], w[r] @ grads, rtol=0, atol=1e-6)
    assert all(torch.isfinite(rank["after"][-1]).all() for rank in ranks)


def test_exchanged_bytes_are_neighbours_times_parameter_bytes(runs):
    nbytes = 4 * runs["dmsgd_full"][0]["before"][0].numel()
    expected = {"full": 3, "ring": 2, "exponential": 2, "one_peer_exponential": 1}
    for key, (_name, topology, *_rest) in RUNS.items():
        for rank in runs[key]:
            per_step = [b.get("neighbour", 0) for b in rank["bytes"]]
            assert per_step == [expected[topology] * nbytes] * STEPS, key
            assert all("gradients" not in b for b in rank["bytes"])
            assert rank["metrics"]["neighbours"] == expected[topology]


def test_evaluation_uses_the_average_and_the_consensus_distance_is_logged(runs):
    ranks = runs["decentlam_ring"]
    finals = torch.stack([r["after"][-1] for r in ranks])
    mean = finals.mean(0)
    distance = float(((finals - mean).norm(dim=1) / mean.norm()).mean())
    for r, rank in enumerate(ranks):
        torch.testing.assert_close(rank["eval"], mean, rtol=0, atol=1e-6)
        assert torch.equal(rank["local_after_eval"], finals[r])  # training state untouched
        assert rank["metrics"]["consensus_step"] == STEPS
        assert rank["metrics"]["consensus_distance"] == pytest.approx(distance, rel=1e-4)
        # the consensus step's all-reduce: ring of 4 sends 2 (p-1)/p of the parameters
        assert rank["bytes"][-1]["parameters"] == 4 * mean.numel() * 3 // 2
    assert distance > 0


def test_state_dict_round_trip_continues_the_trajectory_bit_for_bit(runs):
    for straight, resumed in zip(runs["decentlam_ring"], runs["resumed"], strict=True):
        assert torch.equal(resumed["params"], straight["after"][-1])
        assert torch.equal(resumed["momentum"], straight["momentum"][-1])
        assert resumed["metrics"] == straight["metrics"]
    assert not torch.equal(runs["resumed"][0]["params"], runs["resumed"][1]["params"])


def test_layerwise_trust_ratio_scales_decentlam_within_its_bounds(runs):
    plain, scaled = runs["decentlam_ring"][0], runs["decentlam_ring_lamb"][0]
    metrics = scaled["metrics"]
    assert 0.05 <= metrics["trust_ratio_min"] <= metrics["trust_ratio_max"] <= 2.0
    assert "trust_ratio_min" not in plain["metrics"]
    assert not torch.allclose(plain["after"][-1], scaled["after"][-1], atol=1e-4)


def test_momentum_sgd_optimizer_is_heavy_ball_with_decoupled_decay():
    model = build_model(TOY)
    opt = _sgd(model, 0.8, 0.1)
    x, m, decay = flat_params(model), None, _decay_mask(0.1)
    for step in range(3):
        g = _grad(x, 0, step)
        m = g if m is None else 0.8 * m + g
        x = x - LR * (m + decay * x)
        toy_loss(model, 0, step).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(flat_params(model), x, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("strategy", "optimizer", "match"),
    [
        ({"name": "decentlam"}, "lamb", "set optimizer.name to sgd"),
        ({"name": "dmsgd"}, "adamw", "set optimizer.name to sgd"),
        (
            {"name": "decentlam", "outer_momentum": 0.5},
            "sgd",
            "outer_momentum does not apply to strategy decentlam; it applies to co2, slowmo",
        ),
        (
            {"name": "auto", "topology": "ring"},
            "lamb",
            "topology does not apply to strategy data_parallel; it applies to decentlam, dmsgd",
        ),
        ({"name": "co2", "layerwise": "lamb"}, "lamb", "it applies to decentlam, dmsgd"),
        ({"name": "dmsgd", "outer_every": 4}, "sgd", "outer_every does not apply to strategy"),
        ({"name": "no_such"}, "lamb", "not a registered strategy; choose one of auto,"),
        ({"name": "slowmo"}, "sgd", "set optimizer.name to lamb or adamw"),
        ({"name": "dmsgd", "topology": "star"}, "sgd", "must be one of"),
        ({"name": "dmsgd", "consensus_every": -1}, "sgd", "consensus_every must be >= 0"),
    ],
)
def test_bad_decentralised_configs_fail_at_load(strategy, optimizer, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, {"optimizer": {"name": optimizer}, "strategy": strategy})


def test_sgd_with_data_parallel_is_a_valid_config():
    cfg = from_dict(PretrainConfig, {"optimizer": {"name": "sgd"}})
    assert cfg.strategy.name == "auto"


# ----------------------------------------------------------------------------- pretraining


def _pretrain_cfg(corpus, run_dir) -> dict:
    from tests.helpers.runs import tiny_config

    return tiny_config(
        corpus,
        run_dir,
        **{
            "optimizer.name": "sgd",
            "optimizer.lr": 0.05,
            "strategy.name": "dmsgd",
            "strategy.topology": "ring",
            "strategy.layerwise": "lamb",
            "strategy.consensus_every": 2,
            "schedule.max_steps": 12,
            "data.validation_every": 5,
        },
    )


@pytest.mark.slow
def test_killed_dmsgd_run_resumes_to_the_same_trajectory(tiny_corpus, tmp_path):
    """DmSGD with trust ratios on two ranks on a ring (the left and right neighbour are
    the same rank: the exact average, so the parameters agree and the momenta, each rank's
    own gradients, differ). Checkpoints at 4, 8, 12; kill -9 after 8, resume: per-rank
    parameters and momenta, the average model and every logged figure as the
    uninterrupted run. Also: bytes per step, the exported average, and a resume on one
    rank refused. (Ranks that drift apart: the 4-rank round trip above.)"""
    from pretrain.train import train
    from tests.helpers.checkpoints import assert_same_checkpoints, load_checkpoint
    from tests.helpers.runs import launch_and_kill_at, torchrun_to_end, write_cfg

    torchrun_to_end(write_cfg(_pretrain_cfg(tiny_corpus, tmp_path / "a"), tmp_path / "a.yaml"))
    path_b = write_cfg(_pretrain_cfg(tiny_corpus, tmp_path / "b"), tmp_path / "b.yaml")
    launch_and_kill_at(path_b, tmp_path / "b", 8)
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) < 12, "not cut short"
    torchrun_to_end(path_b)

    assert_same_checkpoints(
        tmp_path / "a", tmp_path / "b", (8, 12), ("model", "decentralized"), ("params", "momentum")
    )
    logs_a, logs_b = (
        {(r["step"], "loss" in r): r for r in read_metrics(tmp_path / run / "metrics.jsonl")}
        for run in "ab"
    )  # a step's record and its validation record; the resumed run's last of each
    assert sorted(logs_a) == sorted(logs_b)
    for at, record in logs_a.items():
        for key in ("loss", "val_mlm_loss", "consensus_distance", "trust_ratio_mean"):
            assert record.get(key) == logs_b[at].get(key), (at, key)

    shared, ranks = load_checkpoint(tmp_path / "a", 12)
    assert shared["decentralized"]["steps"] == 12
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert not torch.equal(ranks[0]["momentum"], ranks[1]["momentum"])
    nbytes = 4 * ranks[0]["params"].numel()
    records = [r for at, r in sorted(logs_a.items()) if at[1]]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["comm_bytes_neighbour"] for r in records] == [nbytes] * 12  # one neighbour
    assert [r.get("comm_bytes_parameters", 0) for r in records] == [0, nbytes] * 6
    assert all("comm_bytes_gradients" not in r for r in records)
    assert records[-1]["consensus_distance"] == 0.0 and records[-1]["consensus_step"] == 12
    low, high = records[-1]["trust_ratio_min"], records[-1]["trust_ratio_max"]
    assert 0.01 * (1 - 1e-6) <= low <= high <= 0.3 * (1 + 1e-6)  # fp32 bounds
    from transformers import BertForPreTraining

    exported = BertForPreTraining.from_pretrained(tmp_path / "a" / "final")
    flat = torch.cat([p.detach().reshape(-1) for p in exported.parameters() if p.requires_grad])
    assert torch.equal(flat, (ranks[0]["params"] + ranks[1]["params"]) / 2)

    with pytest.raises(ValueError, match="written by 2 ranks and this run has 1"):
        train(from_dict(PretrainConfig, _pretrain_cfg(tiny_corpus, tmp_path / "b")),
              _context(Communicator(None)))  # fmt: skip
