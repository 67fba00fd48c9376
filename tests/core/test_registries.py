"""The strategy and optimizer registries: the built-in tables, a toy strategy added with
nothing but a class and one registry entry (checked at config time, trained on two gloo
ranks), and a toy optimizer the same way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from onebit_bert.config import ConfigError, from_dict
from onebit_bert.distributed.policy import CommConfig, CompressionConfig
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from onebit_bert.optim.registry import (
    OPTIMIZERS,
    OptimizerSpec,
    compressed_optimizers,
    optimizer_spec,
    register_optimizer,
)
from onebit_bert.optim.surface import OverlappingOptimizer, SelfSyncingOptimizer
from onebit_bert.strategies import (
    STRATEGIES,
    Strategy,
    StrategyConfig,
    StrategySpec,
    check_comm_config,
    family,
    register_strategy,
    strategy_spec,
)
from onebit_bert.strategies.registry import COMMON_FIELDS, unregister_strategy
from pretrain.config import PretrainConfig
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process


# ----------------------------------------------------------------------------- the toy
class ToyAverage(Strategy):
    """Averages every gradient tensor by itself (one all-reduce per tensor), then steps."""

    name = "toy_average"

    def gradient_sync(self):
        return "allreduce"

    def after_backward(self) -> None:
        with self.comm.traffic("gradients"):
            for p in self.params:
                if p.grad is not None:
                    self.comm.all_reduce(p.grad, op="avg")


def _build_toy(args) -> Strategy:
    return ToyAverage(args.model, args.loss_module, args.optimizer, args.ctx)


TOY = StrategySpec(
    "toy_average",
    _build_toy,
    "average each gradient tensor by itself, then step",
    family="toy",
    optimizers=("lamb", "adamw"),
    traffic=("grad",),
)


@pytest.fixture
def toy():
    register_strategy(TOY)
    try:
        yield TOY
    finally:
        unregister_strategy(TOY.name)


def _train_with_toy(comm, cfg):
    """In a spawned rank: the registry entry is this process's too."""
    if TOY.name not in STRATEGIES:
        register_strategy(TOY)
    return train_in_process(comm, cfg)


# ----------------------------------------------------------------------------- the table
def test_every_builtin_strategy_is_registered_once_with_a_family():
    names = list(STRATEGIES)
    assert len(names) == len(set(names))
    assert {
        "data_parallel",
        "onebit_lamb",
        "onebit_adam",
        "zero_one_adam",
        "co2",
        "slowmo",
        "local_sgd",
        "diloco",
        "streaming_diloco",
        "decentlam",
        "dmsgd",
    } <= set(names)
    assert family("local_steps") == ("co2", "slowmo", "local_sgd", "diloco", "streaming_diloco")
    assert family("decentralized") == ("decentlam", "dmsgd")
    declared = {f.name for f in dataclasses.fields(StrategyConfig)}
    read = set(COMMON_FIELDS).union(*(spec.fields for spec in STRATEGIES.values()))
    assert read == declared, "every strategy.* field is read by some strategy"


def test_registry_refuses_duplicates_auto_and_unknown_fields(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(toy)
    with pytest.raises(ValueError, match="reserved"):
        register_strategy(dataclasses.replace(toy, name="auto"))
    with pytest.raises(ValueError, match="not fields of StrategyConfig"):
        dataclasses.replace(toy, fields=("outer_everyy",))
    with pytest.raises(ValueError, match="unknown traffic kind"):
        dataclasses.replace(toy, traffic=("gradient",))
    with pytest.raises(ValueError, match="not a registered strategy; choose one of auto, data_"):
        strategy_spec("toy_averag")


# ----------------------------------------------------------------------------- the toy
def test_toy_strategy_is_checked_at_config_time_from_its_entry(toy):
    cfg = from_dict(PretrainConfig, {"strategy": {"name": "toy_average"}})
    assert cfg.strategy.name == "toy_average"
    with pytest.raises(ConfigError, match="needs optimizer.name lamb or adamw"):
        from_dict(
            PretrainConfig, {"strategy": {"name": "toy_average"}, "optimizer": {"name": "sgd"}}
        )
    with pytest.raises(ConfigError, match="outer_every does not apply to strategy toy_average"):
        from_dict(PretrainConfig, {"strategy": {"name": "toy_average", "outer_every": 3}})
    check_comm_config(CommConfig(compression=CompressionConfig(grad="bf16")), "toy_average")
    with pytest.raises(ValueError, match="comm.compression.outer does not apply"):
        check_comm_config(CommConfig(compression=CompressionConfig(outer="bf16")), "toy_average")
    with pytest.raises(ValueError, match="comm.overlap does not apply to strategy toy_average"):
        check_comm_config(CommConfig(overlap=True), "toy_average")


def test_toy_strategy_trains_like_data_parallel_on_two_ranks(toy, tiny_corpus, tmp_path):
    common = {
        "schedule.max_steps": 4,
        "model.dropout": 0.0,
        "strategy.grad_sync": "allreduce",
        "checkpoint.every": 4,
    }
    runs = {}
    for name in ("data_parallel", "toy_average"):
        run_dir = tmp_path / name
        cfg = tiny_config(tiny_corpus, run_dir, **common, **{"strategy.name": name})
        model = run_ranks(_train_with_toy, 2, cfg)[0]["model"]
        losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
        runs[name] = (model, losses)
    (dp_model, dp_losses), (toy_model, toy_losses) = runs["data_parallel"], runs["toy_average"]
    assert len(toy_losses) == 4
    # a sum of two values is the same in any order: per-tensor and coalesced averages agree
    torch.testing.assert_close(toy_losses, dp_losses, rtol=1e-6, atol=0)
    for key, value in dp_model.items():
        torch.testing.assert_close(toy_model[key], value, rtol=1e-5, atol=1e-7, msg=key)


# ----------------------------------------------------------------------------- optimizers
def test_every_builtin_optimizer_builds_from_its_entry_with_its_surface():
    from onebit_bert.distributed.comm import Communicator

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    assert set(OPTIMIZERS) >= {
        "lamb",
        "onebit_lamb",
        "onebit_adam",
        "zero_one_adam",
        "adamw",
        "sgd",
    }
    assert compressed_optimizers() == ("onebit_lamb", "onebit_adam", "zero_one_adam")
    for name, spec in OPTIMIZERS.items():
        opt = build_optimizer(OptimizerConfig(name=name), model, Communicator(None))
        assert isinstance(opt, torch.optim.Optimizer), name
        assert isinstance(opt, SelfSyncingOptimizer) == spec.compressed, name
        if spec.compressed:
            # its own strategy, which auto picks
            assert strategy_spec(spec.default_strategy).optimizers == (name,)
    for name in ("onebit_lamb", "onebit_adam"):
        opt = build_optimizer(OptimizerConfig(name=name), model, Communicator(None))
        assert isinstance(opt, OverlappingOptimizer), name


class ToySGD(torch.optim.SGD):
    """Plain SGD without momentum: a toy optimizer for the registry."""


TOY_OPTIMIZER = OptimizerSpec("toy_sgd", lambda b: ToySGD(b.groups, lr=b.cfg.lr), "plain SGD")


def test_toy_optimizer_joins_with_one_entry_and_runs_with_data_parallel():
    from onebit_bert.distributed.comm import Communicator
    from onebit_bert.strategies import resolve_strategy_name

    with pytest.raises(ConfigError, match="not a registered optimizer; choose one of lamb"):
        from_dict(PretrainConfig, {"optimizer": {"name": "toy_sgd"}})
    register_optimizer(TOY_OPTIMIZER)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_optimizer(TOY_OPTIMIZER)
        cfg = from_dict(PretrainConfig, {"optimizer": {"name": "toy_sgd", "lr": 0.5}})
        assert resolve_strategy_name(cfg.strategy, cfg.optimizer) == "data_parallel"
        assert optimizer_spec("toy_sgd").compressed is False
        model = torch.nn.Linear(2, 1, bias=False)
        opt = build_optimizer(cfg.optimizer, model, Communicator(None))
        assert isinstance(opt, ToySGD)
        model.weight.grad = torch.ones_like(model.weight)
        before = model.weight.detach().clone()
        opt.step()
        torch.testing.assert_close(model.weight.detach(), before - 0.5)
    finally:
        OPTIMIZERS.unregister("toy_sgd")


# ----------------------------------------------------------------------------- the generic one
def test_generic_registry_keeps_order_refuses_duplicates_and_names_choices():
    from onebit_bert.registry import Registry

    @dataclasses.dataclass(frozen=True)
    class Spec:
        name: str
        lossy: bool = False

    reg: Registry[Spec] = Registry(
        "widget", key="widget.kind", reserved={"auto": "picks one"}, extra_choices=("auto",)
    )
    reg.register(Spec("b", lossy=True))
    reg.register(Spec("a"))
    assert list(reg) == ["b", "a"] and len(reg) == 2 and "a" in reg
    assert reg["b"].lossy and reg.get("a") == Spec("a")
    assert reg.names(lambda s: s.lossy) == ("b",)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Spec("a"))
    reg.register(Spec("a", lossy=True), replace=True)
    assert reg.names(lambda s: s.lossy) == ("b", "a")
    with pytest.raises(ValueError, match="reserved"):
        reg.register(Spec("auto"))
    with pytest.raises(
        ValueError, match=r"widget.kind 'c' is not a registered widget; choose one of auto, b, a"
    ):
        reg.get("c")
    reg.unregister("b")
    reg.unregister("missing")
    assert list(reg) == ["a"]
