"""The recipe registry: every recipe's overrides build a config that runs it, a config that
names a recipe must run it, the pretraining stage records the recipe, and the benchmark, the
experiment configs and the comparison read the one table."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import yaml

from bench import netem, netem_runs
from onebit_bert.config import from_dict, load_config
from onebit_bert.distributed import Communicator
from onebit_bert.recipes import (
    RECIPES,
    Recipe,
    check_recipe,
    get_recipe,
    identify,
    mismatches,
    register_recipe,
)
from pipeline.experiment import load_experiment
from pipeline.reports import compare
from pretrain.config import PretrainConfig
from pretrain.train import train
from tests.helpers.runs import dist_context, tiny_config

CONFIG = "configs/pretrain/compare.yaml"


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_builds_a_config_that_runs_it(name):
    recipe = get_recipe(name)
    cfg = load_config(PretrainConfig, CONFIG, recipe.overrides())
    assert identify(dataclasses.asdict(cfg)) == name
    assert cfg.optimizer.name == recipe.optimizer
    named = load_config(PretrainConfig, CONFIG, [*recipe.overrides(), f"recipe={name}"])
    assert named.resolved_recipe() == name


def test_a_config_that_names_another_recipe_is_refused():
    with pytest.raises(ValueError, match=r"recipe 'co2' does not match.*strategy.name"):
        load_config(PretrainConfig, CONFIG, ["optimizer.name=lamb", "recipe=co2"])
    unknown = "recipe 'nope' is not a registered recipe; choose one of lamb"
    with pytest.raises(ValueError, match=unknown):
        load_config(PretrainConfig, CONFIG, ["recipe=nope"])


def test_identify_reads_defaults_auto_and_open_fields():
    assert identify({"optimizer": {"name": "lamb"}}) == "lamb"
    assert identify({"optimizer": {"name": "lamb"}, "strategy": {"name": "data_parallel"}}) == (
        "lamb"
    )
    # a recipe's settings must all hold: int8 warmup gradients are the hybrid, not 1-bit LAMB
    int8 = {"optimizer": {"name": "onebit_lamb"}, "comm": {"compression": {"grad": "int8"}}}
    assert identify(int8) == "hybrid_onebit_lamb"
    assert mismatches(get_recipe("onebit_lamb"), int8) == {
        "comm.compression.grad": ("none", "int8")
    }
    # the hybrid's codec is open: bf16 warmup gradients are still the hybrid
    bf16 = {"optimizer": {"name": "onebit_lamb"}, "comm": {"compression": {"grad": "bf16"}}}
    assert identify(bf16) == "hybrid_onebit_lamb"
    node = {"optimizer": {"name": "onebit_lamb"}, "comm": {"compression": {"grad": "int8"},
                                                           "hierarchy": "node"}}  # fmt: skip
    assert identify(node) == "hybrid_onebit_lamb_node"
    # a setting no recipe describes
    assert identify({"optimizer": {"name": "adamw"}, "strategy": {"name": "co2"}}) is None
    # ...but with nodes as workers the inner optimizer is open: CO2 with AdamW inside
    co2_node = {"strategy": {"name": "co2"}, "comm": {"hierarchy": "node"}}
    for inner in ("lamb", "adamw"):
        assert identify({**co2_node, "optimizer": {"name": inner}}) == "co2_node"


def test_bad_recipe_entries_are_refused():
    with pytest.raises(ValueError, match="measure"):
        Recipe("x", "X", "lamb", measure="fast")
    with pytest.raises(ValueError, match="dotted config field"):
        Recipe("x", "X", "lamb", settings={"optimizer.name": "adamw"})
    with pytest.raises(ValueError, match="already registered"):
        register_recipe(Recipe("lamb", "LAMB", "lamb"))


def test_the_pretraining_stage_records_the_recipe(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 2,
                                                        "strategy.name": "co2"})  # fmt: skip
    train(from_dict(PretrainConfig, cfg), dist_context(Communicator(None)))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert status["recipe"] == saved["recipe"] == "co2"
    assert compare.strategy_key(saved) == "co2"
    # a setting no recipe describes records null, and the report looks up no speeds
    cfg = tiny_config(tiny_corpus, tmp_path / "adamw_co2", **{"schedule.max_steps": 2,
                      "strategy.name": "co2", "optimizer.name": "adamw"})  # fmt: skip
    train(from_dict(PretrainConfig, cfg), dist_context(Communicator(None)))
    saved = yaml.safe_load((tmp_path / "adamw_co2" / "config.yaml").read_text())
    assert saved["recipe"] is None and compare.strategy_key(saved) is None


def test_experiment_runs_name_recipes(tmp_path):
    exp = load_experiment("configs/experiments/compare.yaml", [f"workdir={tmp_path}"])
    stages = {s.name: s for s in exp.resolve(write=False)}
    co2 = stages["pretrain/co2-seed1/phase1"].config
    assert (co2.recipe, co2.optimizer.name, co2.strategy.name) == ("co2", "lamb", "co2")
    assert co2.strategy.outer_every == 8  # the run's own override, after the recipe's
    hybrid = stages["pretrain/hybrid_onebit_lamb-seed1/phase1"].config
    assert hybrid.comm.compression.grad == "int8" and hybrid.optimizer.name == "onebit_lamb"
    for run in exp.cfg.runs:
        if run.recipe:
            assert run.recipe in RECIPES


def test_the_benchmark_measures_every_recipe_by_its_table():
    assert tuple(RECIPES) == netem_runs.STRATEGIES
    args = argparse.Namespace(hybrid_codec="bf16", bucket_mb=2.0, powersgd_rank=8,
                              warmup_steps=3)  # fmt: skip
    assert netem_runs.variant("lamb", args) == ("lamb", None)
    assert netem_runs.variant("hybrid_onebit_lamb_node", args) == (
        "onebit_lamb",
        {"compression": {"grad": "bf16"}, "hierarchy": "node"},
    )
    assert netem_runs.variant("onebit_lamb_overlap", args) == (
        "onebit_lamb",
        {"overlap": True, "bucket_mb": 2.0},
    )
    assert netem_runs.variant("powersgd", args) == (
        "lamb",
        {"compression": {"grad": "powersgd"}, "powersgd_rank": 8, "powersgd_start_step": 3},
    )
    row = {"runs": {"onebit_lamb": {"warmup": {}}, "decentlam/ring": {}, "co2": {"outer_every": 8}}}
    labels = [label for label, _ in netem.plot_series(row)]
    assert labels == ["1-bit LAMB warmup", "1-bit LAMB compression", "DecentLaM (ring)",
                      "CO2 (tau 8)", "compute only"]  # fmt: skip


def test_a_registered_recipe_is_measured_and_recorded(request):
    toy = Recipe("adamw_powersgd", "AdamW on PowerSGD", "adamw",
                 settings={"comm.compression.grad": "powersgd"})  # fmt: skip
    register_recipe(toy)
    request.addfinalizer(lambda: RECIPES.unregister(toy.name))
    config = {"optimizer": {"name": "adamw"}, "comm": {"compression": {"grad": "powersgd"}}}
    assert identify(config) == "adamw_powersgd"
    assert compare.strategy_key(config) == "adamw_powersgd"
    check_recipe("adamw_powersgd", config)
    args = argparse.Namespace(hybrid_codec="int8", bucket_mb=4.0, powersgd_rank=4,
                              warmup_steps=2)  # fmt: skip
    optimizer, comm = netem_runs.variant("adamw_powersgd", args)
    assert optimizer == "adamw" and comm["compression"] == {"grad": "powersgd"}


def test_searched_gives_the_recipes_own_value_then_its_search_space():
    assert get_recipe("slowmo_node").searched("optimizer.name") == ["lamb", "adamw"]
    assert get_recipe("slowmo_node").searched("optimizer.lr") == [
        0.005,
        0.01,
        0.02,
        0.001,
        0.002,
        0.003,
    ]
    assert get_recipe("lamb").searched("optimizer.name") == ["lamb"]
    assert get_recipe("lamb").searched("strategy.outer_every") == []
    assert get_recipe("co2").searched("strategy.outer_every") == [4, 8, 16]
