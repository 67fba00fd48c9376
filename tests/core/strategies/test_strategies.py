"""The sync-strategy layer: which strategy a config selects, 1-bit LAMB on one process,
and traffic counted per kind."""

from __future__ import annotations

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.distributed import TRAFFIC_KINDS
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim.build import OptimizerConfig
from onebit_bert.strategies import StrategyConfig, resolve_strategy_name
from pretrain.config import PretrainConfig
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process


@pytest.mark.parametrize(
    ("strategy", "optimizer", "expected"),
    [
        ("auto", "lamb", "data_parallel"),
        ("auto", "adamw", "data_parallel"),
        ("auto", "onebit_lamb", "onebit_lamb"),
        ("onebit_lamb", "onebit_lamb", "onebit_lamb"),
        ("data_parallel", "lamb", "data_parallel"),
    ],
)
def test_strategy_names_resolve(strategy, optimizer, expected):
    cfg = StrategyConfig(name=strategy)
    assert resolve_strategy_name(cfg, OptimizerConfig(name=optimizer)) == expected


@pytest.mark.parametrize(
    ("strategy", "optimizer", "match"),
    [
        ("onebit_lamb", "lamb", "needs optimizer.name onebit_lamb"),
        ("data_parallel", "onebit_lamb", "use strategy.name=onebit_lamb"),
    ],
)
def test_mismatched_strategy_and_optimizer_fail_at_config_time(strategy, optimizer, match):
    raw = {"optimizer": {"name": optimizer}, "strategy": {"name": strategy}}
    with pytest.raises(ConfigError, match=match):
        from_dict(PretrainConfig, raw)


def _run(corpus, run_dir, **overrides):
    common = {"schedule.max_steps": 8, "model.dropout": 0.0, **overrides}
    result = run_ranks(train_in_process, 1, tiny_config(corpus, run_dir, **common))[0]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    return result["model"], records


def test_onebit_lamb_on_one_process_is_exact_lamb(tiny_corpus, tmp_path):
    lamb_model, lamb = _run(tiny_corpus, tmp_path / "lamb", **{"optimizer.name": "lamb"})
    onebit_model, onebit = _run(
        tiny_corpus, tmp_path / "onebit", **{"optimizer.name": "onebit_lamb"}
    )
    assert [r["loss"] for r in onebit] == [r["loss"] for r in lamb]
    assert {r["stage"] for r in onebit} == {"full"}
    for name, value in lamb_model.items():
        assert torch.equal(value, onebit_model[name]), name

    forced_model, forced = _run(
        tiny_corpus,
        tmp_path / "forced",
        **{"optimizer.name": "onebit_lamb", "strategy.force_compression": True},
    )
    # freeze_step 4 (tiny_config): LAMB to the last bit in warmup, compressed after it
    assert [r["stage"] for r in forced] == ["warmup"] * 4 + ["compression"] * 4
    assert [r["loss"] for r in forced[:5]] == [r["loss"] for r in lamb[:5]]
    assert [r["loss"] for r in forced[5:]] != [r["loss"] for r in lamb[5:]]
    assert all(r["comm_bytes"] == 0 for r in forced)  # a world of one sends nothing


def _kinds(comm):
    data = torch.ones(1000)
    with comm.traffic("gradients"):
        comm.all_reduce(data)
        with comm.traffic("momentum"):
            comm.all_reduce(data[:10])
        comm.all_reduce(data[:100])
    comm.all_reduce(data[:1])
    with pytest.raises(ValueError, match="traffic kind"), comm.traffic("weights"):
        pass
    before = comm.snapshot()
    with comm.traffic("statistics"):
        comm.all_reduce(data[:4])
    delta = comm.snapshot() - before
    return comm.stats.by_kind, comm.stats.bytes_sent, delta.by_kind


def test_traffic_is_counted_per_kind():
    by_kind, total, delta = run_ranks(_kinds, 2)[0]
    # ring all-reduce on 2 ranks: each rank sends its tensor's bytes once
    assert by_kind["gradients"][0] == 4 * 1100 and by_kind["gradients"][2] == 2
    assert by_kind["momentum"][0] == 40 and by_kind["other"][0] == 4
    assert by_kind["statistics"][0] == 16
    assert total == sum(v[0] for v in by_kind.values())
    assert delta == {"statistics": [16, delta["statistics"][1], 1]}
    assert set(by_kind) <= set(TRAFFIC_KINDS)
