"""Local-step strategies (co2, slowmo, local_sgd): their special cases against reference
trajectories on real gloo ranks, agreement across ranks, clipping and the gap penalty,
the background all-reduce, configs, and exact resume of a pretraining run killed mid-round
with an average in flight."""

from __future__ import annotations

import time

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.metrics_log import read_metrics
from onebit_bert.strategies import LocalSteps, StrategyConfig
from onebit_bert.strategies.local_steps import default_outer_momentum
from pretrain.config import PretrainConfig
from tests.helpers.checkpoints import assert_equal, assert_same_local_step_runs, load_checkpoint
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import (
    dist_context,
    run_killing_after_checkpoints,
    tiny_config,
    torchrun_to_end,
    train_in_process,
    train_on_nodes,
    write_cfg,
)
from tests.helpers.toy import STRATEGY_TOY as TOY
from tests.helpers.toy import build_model, flat_params, toy_loss

LR = 0.05


def _local_run(comm, name: str, cfg: StrategyConfig, steps: int, inner: str = "sgd") -> dict:
    """Train the toy model with a local-step strategy; the anchor, outer momentum and
    parameters after every step."""
    torch.set_num_threads(1)
    model = build_model(TOY)
    if inner == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    strategy = LocalSteps(model, model, opt, dist_context(comm), cfg, name)
    out = {"anchor": [], "momentum": [], "params": [], "inner": [], "metrics": None}
    for step in range(steps):
        toy_loss(model, comm.rank, step).backward()
        strategy.after_backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        out["inner"].append(strategy.flat.read())
        strategy.after_step(step + 1)
        out["anchor"].append(strategy.anchor.clone())
        out["momentum"].append(strategy.momentum.clone())
        out["params"].append(strategy.flat.read())
    out["metrics"] = strategy.metrics()
    strategy.drain()
    return out


def _mean_grad(point: torch.Tensor, step: int, world: int) -> torch.Tensor:
    """The gradient at ``point`` averaged over ``world`` ranks' batches of ``step``."""
    model = build_model(TOY)
    grads = []
    for rank in range(world):
        torch.nn.utils.vector_to_parameters(point, model.parameters())
        model.zero_grad()
        toy_loss(model, rank, step).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(grads).mean(0)


def _dp_sgd(steps: int, world: int, momentum: float = 0.0) -> list[torch.Tensor]:
    """Synchronous data-parallel (heavy-ball) SGD on the averaged gradient."""
    x = flat_params(build_model(TOY))
    buf, out = torch.zeros_like(x), []
    for step in range(steps):
        buf = momentum * buf + _mean_grad(x, step, world)
        x = x - LR * buf
        out.append(x)
    return out


def _cfg(**kw) -> StrategyConfig:
    return StrategyConfig(**kw)


# ----------------------------------------------------------------------------- special cases


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("co2", _cfg(outer_every=1, outer_momentum=0.0, gap_penalty=0.0, asynchronous=False)),
        ("slowmo", _cfg(outer_every=1, outer_momentum=0.0)),
        ("local_sgd", _cfg(outer_every=1)),
    ],
)
def test_one_step_rounds_without_momentum_are_synchronous_sgd(name, cfg):
    steps, world = 6, 2
    reference = _dp_sgd(steps, world)
    ranks = run_ranks(_local_run, world, name, cfg, steps)
    for rank in ranks:
        for got, want in zip(rank["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_slowmo_with_one_step_rounds_is_heavy_ball_sgd():
    steps, world, beta = 6, 2, 0.7
    reference = _dp_sgd(steps, world, momentum=beta)
    ranks = run_ranks(_local_run, world, "slowmo", _cfg(outer_every=1, outer_momentum=beta), steps)
    for got, want in zip(ranks[0]["params"], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_stale_co2_with_one_step_rounds_is_delayed_sgd():
    """Anchors a_1 = a_0 and a_{t+1} = a_t - lr * mean gradient at a_{t-1}."""
    steps, world = 7, 2
    cfg = _cfg(outer_every=1, outer_momentum=0.0, gap_penalty=0.0)
    ranks = run_ranks(_local_run, world, "co2", cfg, steps)
    anchors = [flat_params(build_model(TOY))] * 2
    for t in range(1, steps):
        anchors.append(anchors[t] - LR * _mean_grad(anchors[t - 1], t - 1, world))
    for t, got in enumerate(ranks[0]["anchor"]):
        torch.testing.assert_close(got, anchors[t + 1], rtol=0, atol=1e-6)
    # and it is not synchronous SGD
    assert not torch.allclose(ranks[0]["anchor"][-1], _dp_sgd(steps, world)[-2], atol=1e-4)


def test_local_sgd_rounds_end_at_the_average_and_equal_slowmo_special_case():
    steps, world = 8, 2
    local = run_ranks(_local_run, world, "local_sgd", _cfg(outer_every=4), steps)
    slowmo = run_ranks(_local_run, world, "slowmo", _cfg(outer_every=4, outer_momentum=0.0), steps)
    for a, b in zip(local[0]["anchor"], slowmo[0]["anchor"], strict=True):
        assert torch.equal(a, b)
    # within a round the ranks differ; at its end every rank restarts from the average
    assert not torch.equal(local[0]["params"][2], local[1]["params"][2])
    for step in (3, 7):
        mean = (local[0]["inner"][step] + local[1]["inner"][step]) / 2
        torch.testing.assert_close(local[0]["anchor"][step], mean, rtol=0, atol=1e-6)
        assert torch.equal(local[0]["params"][step], local[0]["anchor"][step])
        assert torch.equal(local[0]["params"][step], local[1]["params"][step])


def test_slowmo_on_one_rank_is_lookahead():
    steps, every, alpha = 6, 3, 0.5
    got = run_ranks(
        _local_run, 1, "slowmo", _cfg(outer_every=every, outer_lr=alpha, outer_momentum=0.0),
        steps,
    )[0]  # fmt: skip
    slow = fast = flat_params(build_model(TOY))
    for step in range(steps):
        fast = fast - LR * _mean_grad(fast, step, 1)
        if (step + 1) % every == 0:
            slow = slow + alpha * (fast - slow)
            fast = slow
    torch.testing.assert_close(got["anchor"][-1], slow, rtol=0, atol=1e-6)


def test_anchor_and_momentum_are_identical_on_every_rank():
    cfg = _cfg(outer_every=2, outer_momentum=0.5, gap_penalty=1.0, clip_threshold=0.05)
    ranks = run_ranks(_local_run, 3, "co2", cfg, 9, "adamw")
    for other in ranks[1:]:
        for a, b in zip(ranks[0]["anchor"], other["anchor"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(ranks[0]["momentum"], other["momentum"], strict=True):
            assert torch.equal(a, b)
    assert ranks[0]["metrics"]["outer_rounds"] == 4
    assert 0 < ranks[0]["metrics"]["gap_penalty_min"] < 1


# ----------------------------------------------------------------------------- clip, penalty


def _clipping_runs(comm) -> dict:
    """co2 without clipping, with an infinite threshold, with a quarter of the largest
    unclipped momentum norm, and elementwise at 2^-10: one spawn for all four."""
    base = {"outer_every": 2, "outer_momentum": 0.5, "gap_penalty": 0.0}
    free = _local_run(comm, "co2", _cfg(**base), 8)
    phi = max(float(m.norm()) for m in free["momentum"]) / 4  # identical on every rank
    return {
        "free": free,
        "infinite": _local_run(comm, "co2", _cfg(**base, clip_threshold=1e30), 8),
        "phi": phi,
        "norm": _local_run(comm, "co2", _cfg(**base, clip_threshold=phi), 8),
        "value": _local_run(comm, "co2", _cfg(**base, clip_threshold=2**-10, clip_mode="value"), 8),
    }


@pytest.mark.slow
def test_clipping_infinite_threshold_changes_nothing_and_a_small_one_bounds_momentum():
    runs = run_ranks(_clipping_runs, 2)[0]
    free, phi = runs["free"], runs["phi"]
    for a, b in zip(free["anchor"], runs["infinite"]["anchor"], strict=True):
        assert torch.equal(a, b)
    clipped = runs["norm"]
    assert max(float(m.norm()) for m in clipped["momentum"]) <= phi * (1 + 1e-5)
    assert not torch.equal(clipped["anchor"][-1], free["anchor"][-1])
    value = runs["value"]
    assert max(float(m.abs().max()) for m in value["momentum"]) <= 2**-10
    assert not torch.equal(value["anchor"][-1], free["anchor"][-1])


def _penalty_runs(comm) -> tuple[dict, dict]:
    base = {"outer_every": 2, "outer_momentum": 0.0}
    return (
        _local_run(comm, "co2", _cfg(**base, gap_penalty=0.0), 8),
        _local_run(comm, "co2", _cfg(**base, gap_penalty=5.0), 8),
    )


def test_gap_penalty_zero_is_no_penalty_and_positive_shrinks_the_stale_update():
    none, strong = run_ranks(_penalty_runs, 2)[0]
    # rounds 0 and 1 have no anchor movement yet (gap 0): identical up to step 4
    for step in range(4):
        assert torch.equal(none["anchor"][step], strong["anchor"][step])
    assert strong["momentum"][-1].norm() < none["momentum"][-1].norm()
    assert "gap_penalty_min" not in none["metrics"]
    assert strong["metrics"]["gap_penalty_min"] < 1


def test_staleness_penalty_reads_the_anchors_move_against_its_usual_move():
    from onebit_bert.strategies.local_steps import staleness_penalty

    def run(moves, lam=1.0):
        average, out = torch.zeros(2), []
        for rounds, move in enumerate(moves):
            penalty, average = staleness_penalty(torch.tensor(move), average, rounds, lam)
            out.append(penalty)
        return out

    # an anchor moving by its usual amount: 1 / (1 + lambda) from the first round on,
    # whatever the size of the move (the old definition settled at 0.618 for lambda 1)
    for scale in (1e-3, 1.0, 50.0):
        for penalty in run([[scale, 2 * scale]] * 6):
            torch.testing.assert_close(penalty, torch.full((2,), 0.5))
    assert torch.allclose(run([[1.0, 1.0]] * 3, lam=3.0)[-1], torch.full((2,), 0.25))
    # a round whose move is four times the usual: a stronger penalty, then back
    surge = run([[1.0, 1.0]] * 10 + [[4.0, 1.0]] + [[1.0, 1.0]] * 30)
    assert surge[10][0] < 0.3 and surge[10][1] == surge[9][1]
    assert torch.allclose(surge[-1], torch.full((2,), 0.5), atol=0.01)
    # a tensor whose anchor did not move is not stale
    assert run([[1.0, 0.0]] * 2)[-1][1] == 1.0
    # shrinking moves (a decaying learning rate) are penalised less than steady ones
    assert run([[0.5**k, 1.0] for k in range(8)])[-1][0] > 0.5


def _sync_and_async_penalty(comm) -> dict:
    base = {"outer_every": 2, "outer_momentum": 0.5, "gap_penalty": 1.0}
    return {
        "sync": _local_run(comm, "co2", _cfg(**base, asynchronous=False), 8),
        "async": _local_run(comm, "co2", _cfg(**base), 12),
    }


def test_the_penalty_is_one_when_nothing_is_stale_and_below_when_the_anchor_moved():
    runs = run_ranks(_sync_and_async_penalty, 2)[0]
    assert "gap_penalty_min" not in runs["sync"]["metrics"]  # synchronous: nothing stale
    metrics = runs["async"]["metrics"]
    assert 0 < metrics["gap_penalty_min"] <= metrics["gap_penalty_mean"] < 1


# ----------------------------------------------------------------------------- overlap


def _overlap(comm) -> dict:
    """Start a background average of a large buffer, then compute (never waiting) until
    the collective reports done."""
    torch.set_num_threads(1)
    side = comm.side_channel()
    buffer = torch.full((8_000_000,), float(comm.rank + 1))
    with side.traffic("parameters"):
        handle = side.all_reduce_async(buffer)
    a = torch.randn(200, 200)
    computed = 0
    deadline = time.monotonic() + 60
    while not handle.is_completed() and time.monotonic() < deadline:
        a = torch.tanh(a @ a)  # the main thread is busy: no wait, no collective
        computed += 1
    completed = handle.is_completed()
    waited = handle.wait()
    return {
        "completed_before_wait": completed,
        "computed": computed,
        "waited": waited,
        "value": float(buffer[0]),
        "stats": comm.stats.by_kind.get("parameters"),
    }


def test_background_all_reduce_progresses_while_the_main_thread_computes():
    results = run_ranks(_overlap, 2)
    for r in results:
        assert r["completed_before_wait"], "the all-reduce did not progress on its own"
        assert r["computed"] > 0
        assert r["value"] == 1.5  # averaged, once
        nbytes, _seconds, calls = r["stats"]
        assert (nbytes, calls) == (8_000_000 * 4, 1)  # ring: 2 (p-1)/p of the buffer


# ----------------------------------------------------------------------------- configs


def test_outer_momentum_defaults_by_world_size():
    assert [default_outer_momentum(n) for n in (1, 16, 17, 32, 33, 64, 65, 512)] == [
        0.0, 0.0, 0.2, 0.2, 0.5, 0.5, 0.6, 0.6,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "optimizer", "match"),
    [
        ({"name": "co2"}, "onebit_lamb", "set optimizer.name to lamb or adamw"),
        ({"name": "local_sgd", "outer_momentum": 0.5}, "lamb", "use strategy.name=slowmo"),
        ({"name": "slowmo", "gap_penalty": 1.0}, "lamb", "does not apply to strategy slowmo"),
        ({"name": "slowmo", "asynchronous": True}, "adamw", "is synchronous"),
        ({"name": "co2", "outer_every": 0}, "lamb", "outer_every must be >= 1"),
        ({"name": "co2", "clip_threshold": 0}, "lamb", "clip_threshold must be > 0"),
        ({"name": "co2", "outer_momentum": 1.0}, "lamb", r"outer_momentum must be in \[0, 1\)"),
    ],
)
def test_bad_local_step_configs_fail_at_load(strategy, optimizer, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, {"optimizer": {"name": optimizer}, "strategy": strategy})


# ----------------------------------------------------------------------------- pretraining


def _pretrain_cfg(corpus, run_dir, **extra) -> dict:
    overrides = {
        "optimizer.name": "lamb",
        "strategy.name": "co2",
        "strategy.outer_every": 3,
        "strategy.outer_momentum": 0.3,
        "strategy.clip_threshold": 1.0,
        "schedule.max_steps": 12,
        "data.validation_every": 5,  # mid-round
        **extra,
    }
    cfg = tiny_config(corpus, run_dir, **{k: v for k, v in overrides.items() if "." in k})
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        cfg.setdefault(section, {})[field] = value
    return cfg


@pytest.mark.slow
def test_killed_co2_run_resumes_mid_round_with_an_average_in_flight(tiny_corpus, tmp_path):
    """Rounds end at steps 3, 6, 9, 12; the checkpoint at step 8 is taken mid-round while
    round 2's average (started at step 6) is in flight. Kill -9 after it, resume: the same
    weights, anchors, momentum, per-rank state and losses as the uninterrupted run."""
    cfg_a = _pretrain_cfg(tiny_corpus, tmp_path / "a")
    torchrun_to_end(write_cfg(cfg_a, tmp_path / "a.yaml"))

    cfg_b = _pretrain_cfg(tiny_corpus, tmp_path / "b")
    path_b = write_cfg(cfg_b, tmp_path / "b.yaml")
    run_killing_after_checkpoints(path_b, tmp_path / "b", [8], 12)
    assert_same_local_step_runs(
        tmp_path / "a", tmp_path / "b", (8, 12),
        logged=("loss", "val_mlm_loss", "outer_rounds", "outer_momentum_norm"),
    )  # fmt: skip
    shared, ranks = load_checkpoint(tmp_path / "a", 8)
    assert not torch.equal(ranks[0]["params"], ranks[1]["params"])  # mid-round: local
    assert shared["local_steps"]["rounds"] == 2


def _train_and_average(comm, cfg: dict) -> dict:
    return train_in_process(comm, cfg)["summary"]


def test_co2_pretraining_counts_parameter_bytes_and_exports_the_average(tiny_corpus, tmp_path):
    cfg = _pretrain_cfg(
        tiny_corpus,
        tmp_path / "run",
        **{"schedule.max_steps": 8, "strategy.outer_every": 4, "data.validation_every": 0},
    )
    run_ranks(_train_and_average, 2, cfg)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    shared, _ranks = load_checkpoint(tmp_path / "run", 8)
    average = shared["local_steps"]["average"]
    # two rounds, one average each (2 ranks: a ring sends the whole buffer once)
    per_step = [r.get("comm_bytes_parameters", 0) for r in records]
    assert per_step == [0, 0, 0, 4 * average.numel(), 0, 0, 0, 4 * average.numel()]
    assert all("comm_bytes_gradients" not in r for r in records)
    assert records[-1]["stage"] == "local" and records[-1]["outer_rounds"] == 2
    assert records[-1]["outer_wait_seconds"] >= 0
    # at a round's end the exported model is the average the outer step computed
    from transformers import BertForPreTraining

    exported = BertForPreTraining.from_pretrained(tmp_path / "run" / "final")
    exported_flat = torch.cat(
        [p.detach().reshape(-1) for p in exported.parameters() if p.requires_grad]
    )
    assert torch.equal(exported_flat, average)
    assert not torch.equal(average, shared["local_steps"]["anchor"])


@pytest.mark.slow
def test_nodes_as_workers_equal_one_rank_per_node(tiny_corpus, tmp_path):
    """comm.hierarchy node: 2 nodes x 2 ranks average gradients inside each node and step
    identical copies, so the run is CO2 over 2 workers: the trajectory of 2 ranks that each
    take the node's two micro-batches (up to summation order)."""
    common = {"schedule.max_steps": 5, "data.validation_every": 0, "model.dropout": 0.0,
              "checkpoint.every": 5}  # fmt: skip
    two = _pretrain_cfg(tiny_corpus, tmp_path / "two", **common)
    run_ranks(_train_and_average, 2, two)
    nodes = _pretrain_cfg(tiny_corpus, tmp_path / "nodes", **common, **{"comm.hierarchy": "node"})
    run_ranks(train_on_nodes, 4, nodes, 2)
    flat, node = ([r for r in read_metrics(tmp_path / d / "metrics.jsonl") if "loss" in r]
                  for d in ("two", "nodes"))  # fmt: skip
    assert [r["grad_sync"] for r in node] == ["node"] * 5
    for a, b in zip(flat, node, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["comm_bytes_intra_node"] > 0 and "comm_bytes_intra_node" not in a
    shared_two, _ = load_checkpoint(tmp_path / "two", 5)
    shared_nodes, per_rank = load_checkpoint(tmp_path / "nodes", 5)
    for key in ("anchor", "momentum", "average"):
        torch.testing.assert_close(
            shared_nodes["local_steps"][key], shared_two["local_steps"][key], rtol=1e-4, atol=1e-6
        )
    # node-mates hold the same model and inner state (their random streams differ); the
    # two nodes do not
    for a, b in ((0, 1), (2, 3)):
        assert_equal(per_rank[a]["params"], per_rank[b]["params"])
        assert_equal(per_rank[a]["optimizer"], per_rank[b]["optimizer"])
    assert not torch.equal(per_rank[0]["params"], per_rank[2]["params"])


def _eval_mid_round(comm) -> dict:
    torch.set_num_threads(1)
    model = build_model(TOY)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    strategy = LocalSteps(model, model, opt, dist_context(comm), _cfg(outer_every=4), "co2")
    for step in range(6):  # a round's end at 4, then two local steps
        toy_loss(model, comm.rank, step).backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(step + 1)
    local = strategy.flat.read()
    evaluated = flat_params(strategy.eval_model())
    return {"local": local, "eval": evaluated, "after": strategy.flat.read()}


def test_evaluation_model_is_the_average_of_the_ranks_models():
    ranks = run_ranks(_eval_mid_round, 2)
    mean = (ranks[0]["local"] + ranks[1]["local"]) / 2
    for r in ranks:
        assert torch.equal(r["eval"], mean)
        assert torch.equal(r["after"], r["local"])  # training state untouched
    assert not torch.equal(ranks[0]["local"], ranks[1]["local"])
