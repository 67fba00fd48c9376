"""The equal-budget tuning protocol: trials from a search space, successive halving on
synthetic loss curves, and the budget check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from onebit_bert.recipes import RECIPES, Recipe, get_recipe
from onebit_bert.shards import FORMAT_VERSION, ShardFormatError
from pipeline.tuning import (
    budget,
    check_equal_budgets,
    data_identity,
    grid,
    rungs,
    successive_halving,
    trials,
    tuning_lines,
)
from tests.helpers.paths import REPO

TOY = Recipe("toy", "Toy", "lamb", search_space={"optimizer.lr": (0.1, 0.2, 0.3, 0.4),
                                                 "strategy.outer_every": (4, 8)})  # fmt: skip


def test_trials_are_distinct_grid_points_in_a_seeded_order():
    assert len(grid(TOY)) == 8
    first = trials(TOY, 5, seed=1)
    assert [t.name for t in first] == [f"toy-t{i}" for i in range(5)]
    settings = [tuple(t.settings.items()) for t in first]
    assert len(set(settings)) == 5 and all(dict(s) in grid(TOY) for s in settings)
    assert first == trials(TOY, 5, seed=1)  # reproducible
    assert [t.settings for t in trials(TOY, 8, seed=2)] != [t.settings for t in trials(TOY, 8)]
    assert first[0].overrides() == [f"{k}={v}" for k, v in first[0].settings.items()]
    with pytest.raises(ValueError, match="has 8 points, fewer than the budget of 9 trials"):
        trials(TOY, 9)


def test_a_joint_axis_tries_each_optimizer_at_its_own_learning_rates():
    inner = (("lamb", 0.01), ("lamb", 0.02), ("adamw", 0.002))
    recipe = Recipe("joint", "Joint", "lamb", "co2", open_fields=("optimizer.name",),
                    search_space={"optimizer.name,optimizer.lr": inner,
                                  "strategy.outer_every": (4, 8)})  # fmt: skip
    points = grid(recipe)
    assert len(points) == 6
    assert points[0] == {"optimizer.name": "lamb", "optimizer.lr": 0.01, "strategy.outer_every": 4}
    assert {(p["optimizer.name"], p["optimizer.lr"]) for p in points} == set(inner)
    trial = next(t for t in trials(recipe, 6) if t.settings["optimizer.name"] == "adamw")
    assert trial.overrides()[:2] == ["optimizer.name=adamw", "optimizer.lr=0.002"]
    # the inner optimizer of the node recipes is searched, LAMB and AdamW
    for name in ("co2_node", "slowmo_node"):
        optimizers = {p["optimizer.name"] for p in grid(get_recipe(name))}
        assert optimizers == {"lamb", "adamw"}, name


def test_a_bad_joint_axis_or_a_searched_optimizer_that_is_not_open_is_refused():
    with pytest.raises(ValueError, match="tuple of 2 values, one per field"):
        Recipe("x", "X", "lamb", open_fields=("optimizer.name",),
               search_space={"optimizer.name,optimizer.lr": (("lamb", 0.01), "adamw")})  # fmt: skip
    with pytest.raises(ValueError, match="optimizer.name may be searched when it is one of"):
        Recipe("x", "X", "lamb", search_space={"optimizer.name,optimizer.lr": (("adamw", 1),)})


def test_every_registered_recipe_can_be_given_three_trials():
    for name in RECIPES:
        assert len(trials(get_recipe(name), 3)) == 3


def test_every_grid_point_of_every_recipe_loads_in_the_parity_regime():
    """What the tuner checks before its first run, for every point it could draw: the
    parity config with the recipe's and the point's overrides loads, the searched fields
    take the point's values, and a searched graph runs on the regime's 4 ranks."""
    from onebit_bert.config import load_config
    from onebit_bert.distributed.topology import check_decentlam, check_topology
    from pretrain.config import PretrainConfig

    base = REPO / "configs" / "pretrain" / "parity.yaml"
    for name, recipe in RECIPES.items():
        for point in grid(recipe):
            overrides = [*recipe.overrides(), f"recipe={name}",
                         *(f"{k}={v}" for k, v in point.items())]  # fmt: skip
            cfg = load_config(PretrainConfig, base, overrides)
            for key, value in point.items():
                section, field_name = key.split(".")
                assert getattr(getattr(cfg, section), field_name) == value, (name, key)
            if recipe.measure == "decentralized":
                topology = cfg.strategy.topology or "ring"
                check_topology(topology, 4)
                if recipe.strategy == "decentlam":
                    check_decentlam(topology, 4, cfg.optimizer.betas[0])


def test_the_local_step_recipes_and_dmsgd_search_the_issue_axes():
    """SlowMo searches its slow momentum, CO2 its staleness penalty (on and off), flat and
    with nodes as workers alike, DmSGD its graph, each beside the learning rate (and tau for
    local steps; the node recipes also the inner optimizer)."""
    names = ("slowmo", "co2", "slowmo_node", "co2_node", "dmsgd")
    axes = {name: set(get_recipe(name).search_space) for name in names}
    assert axes["slowmo"] == {"optimizer.lr", "strategy.outer_every", "strategy.outer_momentum"}
    assert axes["co2"] == {"optimizer.lr", "strategy.outer_every", "strategy.gap_penalty"}
    inner = "optimizer.name,optimizer.lr"
    assert axes["slowmo_node"] == {inner, "strategy.outer_every", "strategy.outer_momentum"}
    assert axes["co2_node"] == {inner, "strategy.outer_every", "strategy.gap_penalty"}
    assert axes["dmsgd"] == {"optimizer.lr", "strategy.topology"}
    for name in ("slowmo", "slowmo_node"):
        assert {p["strategy.outer_momentum"] for p in grid(get_recipe(name))} == {0.0, 0.2, 0.5}
    for name in ("co2", "co2_node"):
        assert {p["strategy.gap_penalty"] for p in grid(get_recipe(name))} == {0.0, 1.0}
    assert {p["optimizer.name"] for p in grid(get_recipe("slowmo_node"))} == {"lamb", "adamw"}


def test_rungs_double_up_to_the_run_length():
    assert rungs(100, 800) == [100, 200, 400, 800]
    assert rungs(100, 700) == [100, 200, 400, 700]
    assert rungs(50, 50) == [50]
    with pytest.raises(ValueError, match="rungs need"):
        rungs(0, 10)


def _curve(final: float, speed: float):
    """A loss curve that falls from 10 to ``final`` at rate ``speed``."""
    return lambda steps: final + (10 - final) * math.exp(-speed * steps / 100)


def test_successive_halving_keeps_the_better_half_and_picks_the_best_at_the_end():
    # trial 0 is fast early but ends high; trial 3 is slow early and ends lowest; 5 diverges
    curves = {0: _curve(4.0, 3.0), 1: _curve(3.5, 1.0), 2: _curve(5.0, 0.5),
              3: _curve(3.0, 0.9), 4: _curve(6.0, 2.0), 5: lambda s: float("nan")}  # fmt: skip
    candidates = trials(TOY, 6)
    calls = []

    def run(trial, steps):
        calls.append((trial.index, steps))
        return curves[trial.index](steps)

    record = successive_halving(candidates, run, [100, 200, 400])
    at = {s: {n for n, losses in record.losses.items() if s in losses} for s in (100, 200, 400)}
    assert len(at[100]) == 6 and len(at[200]) == 3 and len(at[400]) == 2
    # rung 1 keeps the three lowest losses at 100 steps (the NaN ranks last)
    by_loss = sorted(range(5), key=lambda i: curves[i](100))
    assert at[200] == {f"toy-t{i}" for i in by_loss[:3]}
    assert "toy-t5" not in at[200]
    best = min((i for i in range(6) if f"toy-t{i}" in at[400]), key=lambda i: curves[i](400))
    assert record.chosen == f"toy-t{best}"
    assert calls[:6] == [(i, 100) for i in range(6)]  # every trial ran the first rung
    spent = budget(record)
    assert spent == {"trials": 6, "rungs": [100, 200, 400], "steps": 3 * 100 + 1 * 200 + 2 * 400}


def test_ties_go_to_the_lower_trial_index():
    record = successive_halving(trials(TOY, 4), lambda t, s: 1.0, [10, 20])
    assert set(n for n, v in record.losses.items() if 20 in v) == {"toy-t0", "toy-t1"}
    assert record.chosen == "toy-t0"


def test_unequal_budgets_are_refused_unless_allowed():
    same = {"trials": 4, "rungs": [100, 200], "steps": 600}
    check_equal_budgets({"lamb": same, "onebit_lamb": dict(same, steps=500)})
    unequal = {"lamb": same, "co2": {"trials": 2, "rungs": [100, 200], "steps": 400}}
    with pytest.raises(ValueError, match=r"unequal budgets \(lamb: 4 trials.*co2: 2 trials"):
        check_equal_budgets(unequal)
    check_equal_budgets(unequal, allow_unequal=True)


def _record(name: str, space: dict) -> dict:
    return {
        "recipe": name,
        "search_space": space,
        "trials": [],
        "chosen": None,
        "chosen_settings": None,
        "budget": {"trials": 3, "rungs": [375], "steps": 1125},
    }


def test_the_report_flags_a_tuning_in_an_older_search_space_and_lists_the_untuned():
    lamb_now = {k: list(v) for k, v in get_recipe("lamb").search_space.items()}
    slowmo_now = {k: list(v) for k, v in get_recipe("slowmo_node").search_space.items()}
    narrower = {k: v for k, v in slowmo_now.items() if k != "strategy.outer_momentum"}
    text = "\n".join(
        tuning_lines(
            {"lamb": _record("lamb", lamb_now), "slowmo_node": _record("slowmo_node", narrower)}
        )
    )
    assert "**slowmo_node was tuned in another search space" in text
    assert "strategy.outer_momentum" in text.split("**slowmo_node")[1]
    assert "lamb was tuned in another" not in text
    listed = text.split("not tuned in this comparison (so not in it): ")[1].split("\n")[0]
    untuned = listed.rstrip(".").split(", ")
    assert set(untuned) == set(RECIPES) - {"lamb", "slowmo_node"}

    # as written to and read back from tuning.json (a joint axis's tuples become lists)
    every = json.loads(json.dumps({n: _record(n, {k: list(v) for k, v in r.search_space.items()})
                                   for n, r in RECIPES.items()}))  # fmt: skip
    text = "\n".join(tuning_lines(every))
    assert "another search space" not in text and "not tuned in this comparison" not in text


def _manifest(folder: Path, tokenizer: str, shards: list[str]) -> Path:
    folder.mkdir(parents=True)
    entries = [{"file": f"train-{i:05d}.npy", "sequences": 0, "sha256": h}
               for i, h in enumerate(shards)]  # fmt: skip
    for entry in entries:
        (folder / entry["file"]).touch()
    manifest = {
        "format_version": FORMAT_VERSION,
        "seq_length": 8,
        "tokenizer": {"sha256": tokenizer},
        "splits": {"train": {"shards": entries}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_report_groups_records_by_the_data_they_were_pretrained_on(tmp_path):
    old = data_identity(_manifest(tmp_path / "old", "a" * 64, ["1" * 64, "2" * 64]))
    new = data_identity(_manifest(tmp_path / "new", "b" * 64, ["1" * 64, "2" * 64]))
    reshuffled = data_identity(_manifest(tmp_path / "re", "a" * 64, ["2" * 64, "1" * 64]))
    with pytest.raises(ShardFormatError, match="not a prepared corpus"):
        data_identity(tmp_path)  # no manifest
    assert old["tokenizer_sha256"] == "a" * 64 and new["shards_sha256"] == old["shards_sha256"]
    assert reshuffled["shards_sha256"] != old["shards_sha256"]

    space = {k: list(v) for k, v in get_recipe("lamb").search_space.items()}
    same = {n: {**_record(n, space), "data": old} for n in ("lamb", "onebit_lamb")}
    assert "recorded data" not in "\n".join(tuning_lines(same))

    mixed = {
        **same,
        "adamw": {**_record("adamw", space), "data": new},
        "dmsgd": _record("dmsgd", space),
    }
    line = next(x for x in tuning_lines(mixed) if "recorded data" in x)
    assert "(3 group(s)" in line
    assert "`aaaaaaaaaaaa…`, shards" in line and "lamb, onebit_lamb" in line
    assert "tokenizer `bbbbbbbbbbbb…`" in line.split("lamb, onebit_lamb")[1]
    assert line.split("not recorded: ")[1].startswith("dmsgd")
