"""DiLoCo: its outer step against torch.optim.SGD on the pseudo-gradient (Nesterov and heavy
ball, with and without weight decay) on real gloo ranks, the one-worker control, config
rules, nodes as workers, and an exact resume of a pretraining run killed mid-round."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.metrics_log import read_metrics
from onebit_bert.recipes import get_recipe
from onebit_bert.strategies import LocalSteps, StrategyConfig
from pretrain.config import PretrainConfig
from tests.helpers.checkpoints import assert_same_local_step_runs, load_checkpoint
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
from tests.helpers.toy import build_model, diloco_inner, flat_params, toy_loss


def _diloco_run(comm, cfg: StrategyConfig, steps: int) -> dict:
    """The toy model under DiLoCo with inner AdamW: the anchor at each round's end."""
    torch.set_num_threads(1)
    model = build_model(TOY)
    opt = diloco_inner(model)
    strategy = LocalSteps(model, model, opt, dist_context(comm), cfg, "diloco")
    anchors = []
    for step in range(steps):
        toy_loss(model, comm.rank, step).backward()
        strategy.after_backward()
        strategy.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_step(step + 1)
        if (step + 1) % cfg.outer_every == 0:
            anchors.append(strategy.anchor.clone())
            assert torch.equal(strategy.flat.read(), strategy.anchor)  # x_i = x0
    return {"anchors": anchors, "alpha": strategy.alpha, "beta": strategy.beta}


def _reference(world: int, steps: int, every: int, lr: float, momentum: float,
               nesterov: bool, wd: float) -> list[torch.Tensor]:  # fmt: skip
    """One process: ``world`` models with their own AdamW, averaged every ``every`` steps,
    and torch.optim.SGD on the pseudo-gradient (anchor - average)."""
    workers = [build_model(TOY) for _ in range(world)]
    inner = [diloco_inner(m) for m in workers]
    anchor = nn.Parameter(flat_params(workers[0]).clone())
    outer = torch.optim.SGD([anchor], lr=lr, momentum=momentum, nesterov=nesterov,
                            weight_decay=wd)  # fmt: skip
    anchors = []
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(workers, inner, strict=True)):
            toy_loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % every == 0:
            average = torch.stack([flat_params(m) for m in workers]).mean(0)
            anchor.grad = anchor.detach() - average
            outer.step()
            for model in workers:
                torch.nn.utils.vector_to_parameters(anchor.detach().clone(), model.parameters())
            anchors.append(anchor.detach().clone())
    return anchors


SETTINGS = [
    {"nesterov": True, "outer_weight_decay": 0.0},
    {"nesterov": True, "outer_weight_decay": 0.1},
    {"nesterov": False, "outer_weight_decay": 0.0},
    {"nesterov": True, "outer_weight_decay": 0.0, "outer_lr": 0.5, "outer_momentum": 0.6},
]
"""The outer settings checked against torch.optim.SGD (one spawn runs them all)."""


def _diloco_runs(comm, steps: int, every: int) -> list[dict]:
    return [
        _diloco_run(comm, StrategyConfig(name="diloco", outer_every=every, **s), steps)
        for s in SETTINGS
    ]


@pytest.mark.parametrize("world", [2, 1])
def test_outer_step_is_torch_sgd_on_the_pseudo_gradient(world):
    """Nesterov and heavy ball, with and without weight decay, the paper's defaults and
    other outer settings, on 2 gloo ranks; world 1 is the one-worker control (a
    Lookahead-like outer step on one model's own progress, still SGD on it)."""
    steps, every = 9, 3
    ranks = run_ranks(_diloco_runs, world, steps, every)
    for k, setting in enumerate(SETTINGS):
        lr, momentum = setting.get("outer_lr", 0.7), setting.get("outer_momentum", 0.9)
        assert (ranks[0][k]["alpha"], ranks[0][k]["beta"]) == (lr, momentum)
        want = _reference(world, steps, every, lr, momentum, setting["nesterov"],
                          setting["outer_weight_decay"])  # fmt: skip
        for rank in ranks:
            assert len(rank[k]["anchors"]) == steps // every
            for got, expected in zip(rank[k]["anchors"], want, strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
        for a, b in zip(ranks[0][k]["anchors"], ranks[-1][k]["anchors"], strict=True):
            assert torch.equal(a, b)  # identical on every rank
    if world == 2:  # and it is neither the plain average (local SGD) nor heavy ball
        last = ranks[0][0]["anchors"][-1]
        plain = _reference(world, steps, every, 1.0, 0.0, False, 0.0)
        assert not torch.allclose(last, plain[-1], atol=1e-4)
        assert not torch.allclose(last, ranks[0][2]["anchors"][-1], atol=1e-4)


def _pretrain(corpus, run_dir, **extra) -> dict:
    overrides = {"optimizer.name": "adamw", "optimizer.lr": 0.003, "strategy.name": "diloco",
                 "strategy.outer_every": 3, "schedule.max_steps": 12,
                 "data.validation_every": 5, **extra}  # fmt: skip
    return tiny_config(corpus, run_dir, **overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"optimizer.name": "onebit_lamb"}, "diloco needs optimizer.name lamb or adamw"),
        ({"strategy.asynchronous": True}, "diloco is synchronous"),
        ({"strategy.outer_weight_decay": -1.0}, "outer_weight_decay must be >= 0"),
        ({"strategy.name": "slowmo", "strategy.nesterov": False}, "nesterov"),
    ],
)  # fmt: skip
def test_bad_diloco_configs_fail_at_load(tmp_path, overrides, match):
    with pytest.raises((ValueError, ConfigError), match=match):
        from_dict(PretrainConfig, _pretrain(tmp_path, tmp_path / "run", **overrides))


def test_the_diloco_recipe_is_adamw_inside():
    recipe = get_recipe("diloco")
    assert (recipe.optimizer, recipe.strategy, recipe.measure) == ("adamw", "diloco", "local_steps")


@pytest.mark.slow
def test_nodes_as_workers_equal_one_rank_per_node(tiny_corpus, tmp_path):
    """comm.hierarchy node: 2 nodes x 2 ranks are DiLoCo over 2 workers (up to summation
    order): the trajectory of 2 ranks that each take the node's two micro-batches."""
    common = {"schedule.max_steps": 5, "data.validation_every": 0, "model.dropout": 0.0,
              "checkpoint.every": 5}  # fmt: skip
    run_ranks(train_in_process, 2, _pretrain(tiny_corpus, tmp_path / "two", **common))
    nodes = _pretrain(tiny_corpus, tmp_path / "nodes", **common, **{"comm.hierarchy": "node"})
    run_ranks(train_on_nodes, 4, nodes, 2)
    flat, node = ([r for r in read_metrics(tmp_path / d / "metrics.jsonl") if "loss" in r]
                  for d in ("two", "nodes"))  # fmt: skip
    for a, b in zip(flat, node, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    shared_two, _ = load_checkpoint(tmp_path / "two", 5)
    shared_nodes, _ = load_checkpoint(tmp_path / "nodes", 5)
    for key in ("anchor", "momentum"):
        torch.testing.assert_close(
            shared_nodes["local_steps"][key], shared_two["local_steps"][key], rtol=1e-4, atol=1e-6
        )


@pytest.mark.slow
def test_killed_diloco_run_resumes_mid_round_bit_exact(tiny_corpus, tmp_path):
    """Rounds end at steps 3, 6, 9, 12; kill -9 after the checkpoint at step 8 (mid-round),
    resume: the same weights, anchor, outer momentum, inner AdamW state and losses as the
    uninterrupted run."""
    torchrun_to_end(write_cfg(_pretrain(tiny_corpus, tmp_path / "a"), tmp_path / "a.yaml"))
    path_b = write_cfg(_pretrain(tiny_corpus, tmp_path / "b"), tmp_path / "b.yaml")
    run_killing_after_checkpoints(path_b, tmp_path / "b", [8], 12)
    assert_same_local_step_runs(
        tmp_path / "a", tmp_path / "b", (8, 12),
        logged=("loss", "val_mlm_loss", "outer_rounds", "outer_momentum_norm"),
    )  # fmt: skip


@pytest.mark.slow
def test_int4_pseudo_gradients_count_their_wire_bytes_and_stay_close(tiny_corpus, tmp_path):
    """comm.compression.outer int4: each round sends the pseudo-gradient at 4 bits plus one
    fp32 scale per 128 elements (about 0.13 of fp32's bytes, padding aside), and the run
    stays close to the fp32 one."""
    common = {"schedule.max_steps": 4, "strategy.outer_every": 2, "data.validation_every": 0}
    run_ranks(train_in_process, 2, _pretrain(tiny_corpus, tmp_path / "fp32", **common))
    int4 = _pretrain(tiny_corpus, tmp_path / "int4", **common, **{"comm.compression.outer": "int4"})
    run_ranks(train_in_process, 2, int4)
    a, b = ([r.get("comm_bytes_parameters", 0) for r in read_metrics(tmp_path / d / "metrics.jsonl")
             if "loss" in r] for d in ("fp32", "int4"))  # fmt: skip
    assert [x > 0 for x in a] == [False, True, False, True] == [y > 0 for y in b]
    for x, y in zip(a[1::2], b[1::2], strict=True):
        assert y / x == pytest.approx((4 + 32 / 128) / 32, rel=0.01)
    la, lb = ([r["loss"] for r in read_metrics(tmp_path / d / "metrics.jsonl") if "loss" in r]
              for d in ("fp32", "int4"))  # fmt: skip
    assert la[:2] == lb[:2] and abs(la[-1] - lb[-1]) < 0.05
