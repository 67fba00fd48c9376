"""Pretraining on CPU with gloo: training, equivalence across world sizes, exact resume
after a kill, preemption, and configs that must fail before any compute."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from onebit_bert.config import ConfigError, from_dict, load_config
from onebit_bert.metrics_log import read_metrics
from pretrain.config import PretrainConfig, ScheduleConfig
from pretrain.data import BatchSchedule, TokenIds, mask_tokens
from pretrain.schedule import lr_multiplier
from pretrain.train import train
from tests.helpers.compilers import NEEDS_CXX
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import (
    REPO,
    dist_context,
    kill_all,
    launch_and_kill_at,
    mlm_losses,
    tiny_config,
    torchrun,
    torchrun_to_end,
    torchrun_workers,
    train_in_process,
    write_cfg,
)

# ----------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lamb", "onebit_lamb", "adamw"])
def test_tiny_bert_trains_on_two_ranks(tiny_corpus, tmp_path, optimizer):
    lr = 1e-3 if optimizer == "adamw" else 0.02
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "run",
        **{
            "optimizer.name": optimizer,
            "optimizer.lr": lr,
            "schedule.max_steps": 16,
            "logging.net_interface": "lo",
        },
    )
    results = run_ranks(train_in_process, 2, cfg)
    assert results[0]["summary"]["state"] == "complete"
    losses = mlm_losses(tmp_path / "run")
    assert len(losses) == 16
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.3, losses
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    stages = [r["stage"] for r in records if "stage" in r]
    if optimizer == "onebit_lamb":
        assert stages[:4] == ["warmup"] * 4 and set(stages[4:]) == {"compression"}
        warm, compressed = records[1]["comm_bytes"], records[10]["comm_bytes"]
        assert 0 < compressed < warm / 10  # momentum in 1 bit instead of fp32 gradients
        # per kind of traffic: fp32 gradients in warmup, then only the 1-bit momentum
        assert (
            records[1]["comm_bytes_gradients"] == warm and "comm_bytes_momentum" not in records[1]
        )
        assert records[10]["comm_bytes_momentum"] == compressed
        assert "comm_bytes_gradients" not in records[10]
        # the switch diagnostics: factor f and the relative compression error after it only
        steps = [r for r in records if "stage" in r]
        assert not any("factor_mean" in r or "compression_error" in r for r in steps[:4])
        for r in steps[4:]:
            assert r["factor_min"] <= r["factor_mean"] <= r["factor_max"]
            assert 0 < r["compression_error"] < 2
            assert r["trust_ratio_min"] <= r["trust_ratio_mean"] <= r["trust_ratio_max"]
    else:
        assert all(r["comm_bytes_gradients"] == r["comm_bytes"] for r in records if "stage" in r)
    # Both ranks talk over loopback: its counter saw at least what rank 0's communicator sent.
    steps = [r for r in records if "comm_bytes" in r]
    assert all(r["net_tx_bytes"] >= r["comm_bytes"] > 0 for r in steps), steps[:2]
    assert "val_mlm_accuracy" in records[-1] and "val_nsp_accuracy" in records[-1]
    final = tmp_path / "run" / "final"
    from transformers import AutoTokenizer, BertForPreTraining

    model = BertForPreTraining.from_pretrained(final)
    assert model.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(final).mask_token == "[MASK]"
    for a, b in zip(results[0]["model"].values(), results[1]["model"].values(), strict=True):
        assert torch.equal(a, b)


def test_two_ranks_equal_one_rank_with_the_same_global_batch(tiny_corpus, tmp_path):
    common = {"model.dropout": 0.0, "schedule.max_steps": 6}
    one = run_ranks(train_in_process, 1, tiny_config(tiny_corpus, tmp_path / "one", **common))[0]
    two = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "two", **common))[0]
    assert one["summary"]["accumulation"] == 4 and two["summary"]["accumulation"] == 2
    for name, a in one["model"].items():
        torch.testing.assert_close(a, two["model"][name], rtol=1e-4, atol=1e-5, msg=name)
    np.testing.assert_allclose(
        mlm_losses(tmp_path / "one"), mlm_losses(tmp_path / "two"), rtol=1e-4
    )


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lamb", "onebit_lamb"])
def test_ddp_and_explicit_allreduce_agree(tiny_corpus, tmp_path, optimizer):
    common = {"model.dropout": 0.0, "schedule.max_steps": 8, "optimizer.name": optimizer}
    ddp = run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "ddp", **{"strategy.grad_sync": "ddp"}, **common),
    )[0]
    plain = run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "ar", **{"strategy.grad_sync": "allreduce"}, **common),
    )[0]
    for name, a in ddp["model"].items():
        torch.testing.assert_close(a, plain["model"][name], rtol=1e-5, atol=1e-6, msg=name)

    # The DDP hook counts the same gradient bytes as the explicit all-reduce (warmup steps).
    def bytes_of(run_dir):
        return [
            r["comm_bytes"] for r in read_metrics(run_dir / "metrics.jsonl") if "comm_bytes" in r
        ]

    assert bytes_of(tmp_path / "ddp")[:4] == bytes_of(tmp_path / "ar")[:4]


def test_phase_two_starts_from_phase_one(tiny_corpus, tmp_path):
    # one process: 1-bit LAMB compresses only when forced (else it is exact LAMB)
    forced = {"optimizer.name": "onebit_lamb", "strategy.force_compression": True}
    phase1 = tiny_config(tiny_corpus, tmp_path / "p1", **forced, **{"schedule.max_steps": 8})
    run_ranks(train_in_process, 1, phase1)
    from_run = tiny_config(
        tiny_corpus,
        tmp_path / "p2",
        **forced,
        **{
            "optimizer.freeze_step": 6,
            "schedule.max_steps": 2,
            "model.init_from": str(tmp_path / "p1"),
            "model.init_optimizer": True,
        },
    )
    run_ranks(train_in_process, 1, from_run)
    records = [r for r in read_metrics(tmp_path / "p2" / "metrics.jsonl") if "stage" in r]
    assert records[0]["stage"] == "compression"  # optimizer steps continue from phase 1
    from_hf = tiny_config(
        tiny_corpus,
        tmp_path / "p2hf",
        **{"schedule.max_steps": 2, "model.init_from": str(tmp_path / "p1" / "final")},
    )
    run_ranks(train_in_process, 1, from_hf)
    fresh = tiny_config(tiny_corpus, tmp_path / "fresh", **{"schedule.max_steps": 2})
    run_ranks(train_in_process, 1, fresh)
    first = lambda d: mlm_losses(d)[0]  # noqa: E731
    assert first(tmp_path / "p2hf") < first(tmp_path / "fresh") - 0.3
    assert abs(first(tmp_path / "p2hf") - mlm_losses(tmp_path / "p1")[-1]) < 0.5


# ----------------------------------------------------------------------------- resume


def _final_state(run_dir: Path) -> dict:
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return torch.load(last / "shared.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lamb", "onebit_lamb"])
def test_killed_run_resumes_to_the_same_trajectory(tiny_corpus, tmp_path, optimizer):
    overrides = {"optimizer.name": optimizer, "schedule.max_steps": 12}
    straight = write_cfg(tiny_config(tiny_corpus, tmp_path / "a", **overrides), tmp_path / "a.yaml")
    torchrun_to_end(straight)

    killed = write_cfg(tiny_config(tiny_corpus, tmp_path / "b", **overrides), tmp_path / "b.yaml")
    launch_and_kill_at(killed, tmp_path / "b", 8)  # past freeze_step=4
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) < 12, "the run was not cut short"
    torchrun_to_end(killed)

    a, b = _final_state(tmp_path / "a"), _final_state(tmp_path / "b")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    last_a = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if "loss" in r][-1]
    last_b = [r for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r][-1]
    assert last_a["step"] == last_b["step"] == 12 and last_a["loss"] == last_b["loss"]


def test_model_compile_compiles_the_body_in_place_and_leaves_the_heads_eager(tiny_corpus, tmp_path):
    from pretrain.train import Trainer

    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"model.compile": "reduce-overhead"})
    trainer = Trainer(from_dict(PretrainConfig, cfg), dist_context(_single()))
    try:
        assert trainer.model.bert._compiled_call_impl is not None
        assert trainer.model.cls._compiled_call_impl is None
        assert all(not name.startswith("_orig_mod") for name in trainer.model.state_dict())
    finally:
        trainer.logger.close()
        trainer.release()


@pytest.mark.slow
@NEEDS_CXX
def test_a_compiled_model_trains_like_the_eager_one_and_resumes_exactly(tiny_corpus, tmp_path):
    """model.compile: without dropout, 6 steps of LAMB with the body compiled follow the
    eager run to float rounding, and the checkpoint holds the same parameter names; with
    dropout, a compiled run stopped at step 3 and resumed ends bit-identical to a straight
    compiled run (compiled dropout draws its masks from the checkpointed generator)."""
    single = _single()

    def run(name, **overrides):
        overrides = {"schedule.max_steps": 6, "checkpoint.every": 3, **overrides}
        return train_in_process(single, tiny_config(tiny_corpus, tmp_path / name, **overrides))

    from torch._dynamo.utils import counters

    eager = run("eager", **{"model.dropout": 0.0})
    counters.clear()
    compiled = run("compiled", **{"model.dropout": 0.0, "model.compile": "default"})
    assert counters["stats"]["unique_graphs"] >= 1  # the body did run compiled
    assert compiled["model"].keys() == eager["model"].keys()
    for name, tensor in eager["model"].items():
        torch.testing.assert_close(compiled["model"][name], tensor, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        mlm_losses(tmp_path / "compiled"), mlm_losses(tmp_path / "eager"), rtol=1e-5
    )
    assert len(mlm_losses(tmp_path / "eager")) == 6

    straight = run("straight", **{"model.compile": "default"})
    run("resumed", **{"model.compile": "default", "stop_after": 3})
    resumed = run("resumed", **{"model.compile": "default"})
    for name, tensor in straight["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    assert mlm_losses(tmp_path / "resumed")[-3:] == mlm_losses(tmp_path / "straight")[-3:]
    assert mlm_losses(tmp_path / "straight") != mlm_losses(tmp_path / "compiled")  # dropout on


@pytest.mark.slow
@NEEDS_CXX
def test_a_compiled_model_takes_packed_batches_and_validates(tiny_corpus, tmp_path):
    """model.compile with data.packing (rows vary in number, attention masked per sequence)
    and a validation pass every 3 steps (eval mode, no gradients: compiled again): without
    dropout the losses follow the eager run's."""
    single = _single()
    common = {"model.dropout": 0.0, "schedule.max_steps": 6, "data.packing": True}
    common["data.validation_every"] = 3
    for mode in ("off", "default"):
        cfg = tiny_config(tiny_corpus, tmp_path / mode, **common, **{"model.compile": mode})
        train_in_process(single, cfg)
    eager, compiled = mlm_losses(tmp_path / "off"), mlm_losses(tmp_path / "default")
    assert len(compiled) == 6
    np.testing.assert_allclose(compiled, eager, rtol=1e-4)
    validations = [
        [r["val_mlm_loss"] for r in read_metrics(tmp_path / mode / "metrics.jsonl")
         if "val_mlm_loss" in r]
        for mode in ("off", "default")
    ]  # fmt: skip
    assert len(validations[1]) >= 2
    np.testing.assert_allclose(validations[1], validations[0], rtol=1e-4)


@pytest.mark.slow
@NEEDS_CXX
@pytest.mark.parametrize(
    "overrides",
    [{"optimizer.name": "lamb"}, {"optimizer.name": "onebit_lamb", "comm.overlap": True}],
    ids=["lamb-ddp", "onebit_lamb-overlap"],
)
def test_a_compiled_model_on_two_ranks_follows_the_eager_run(tiny_corpus, tmp_path, overrides):
    """model.compile under DDP's gradient hooks (LAMB) and under 1-bit LAMB's momentum
    exchange folded into the backward pass (comm.overlap), 2 gloo ranks, no dropout: the
    losses follow the eager run's. 1-bit LAMB's weights only to 1e-2: the signs of momenta
    near zero flip with the rounding."""
    common = {"model.dropout": 0.0, "schedule.max_steps": 8, **overrides}
    runs = {}
    for mode in ("off", "default"):
        cfg = tiny_config(tiny_corpus, tmp_path / mode, **common, **{"model.compile": mode})
        runs[mode] = run_ranks(train_in_process, 2, cfg)[0]
    np.testing.assert_allclose(
        mlm_losses(tmp_path / "default"), mlm_losses(tmp_path / "off"), rtol=1e-4
    )
    tolerance = 1e-2 if overrides["optimizer.name"] == "onebit_lamb" else 1e-5
    for name, tensor in runs["off"]["model"].items():
        torch.testing.assert_close(runs["default"]["model"][name], tensor, rtol=0, atol=tolerance)


def test_preemption_signal_checkpoints_and_exits_cleanly(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 10**6, "checkpoint.every": 10**6}
    )
    proc = torchrun(write_cfg(cfg, tmp_path / "run.yaml"))
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and (not metrics.exists() or len(read_metrics(metrics)) < 3):
            time.sleep(0.05)
        workers = torchrun_workers(proc)
        if len(workers) != 2:
            proc.kill()
            pytest.fail(f"expected 2 worker processes, found {workers}:\n{proc.communicate()[0]}")
        os.kill(workers[-1], signal.SIGUSR1)  # as SLURM's --signal would, to one task
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_all(proc)
    assert proc.returncode == 0, out
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "preempted" and status["step"] >= 3
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{status['step']:08d}"
    assert (checkpoint / "complete.json").is_file()
    assert not (tmp_path / "run" / "final").exists()


def test_a_preemption_while_the_run_is_built_stops_it_at_its_first_step(
    tiny_corpus, tmp_path, monkeypatch
):
    # The signal lands after the status is written and before the loop starts (a launcher
    # that reads the status, then preempts): it is caught, not lost and not fatal.
    from onebit_bert.distributed import init_distributed
    from pretrain import outputs
    from pretrain.train import Trainer

    caught_here = []

    def test_handler(*_):
        caught_here.append(True)

    previous = signal.signal(signal.SIGUSR1, test_handler)
    term_before = signal.getsignal(signal.SIGTERM)
    start = outputs.RunStatus.start

    def start_then_preempt(self, *args, **kwargs):
        start(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(outputs.RunStatus, "start", start_then_preempt)
    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 50})
    try:
        trainer = Trainer(from_dict(PretrainConfig, cfg), init_distributed(backend="gloo", env={}))
        try:
            summary = trainer.run()
        finally:
            trainer.release()
        handlers_after = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not caught_here, "the trainer's handler was not installed when the signal came"
    assert summary["state"] == "preempted" and summary["step"] == 1
    assert (tmp_path / "run" / "checkpoints" / "step_00000001" / "complete.json").is_file()
    assert handlers_after == (test_handler, term_before)  # release() gave both back
    assert not (tmp_path / "run" / "final").exists()


# ----------------------------------------------------------------------------- bad configs


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        ({"batch.global_batch_size": 30}, ValueError, "not a multiple"),
        ({"data.path": "/nonexistent/seq64"}, ValueError, "not a prepared corpus"),
        ({"model.max_position_embeddings": 32}, ValueError, "positions"),
        ({"batch.global_batch_size": 4096}, ValueError, "fewer than one global batch"),
        ({"model.init_from": "/nonexistent"}, FileNotFoundError, "neither a pretraining run"),
    ],
)
def test_bad_configs_fail_before_compute(tiny_corpus, tmp_path, overrides, error, match):
    cfg = from_dict(PretrainConfig, tiny_config(tiny_corpus, tmp_path / "run", **overrides))
    with pytest.raises(error, match=match):
        train(cfg, dist_context(_single()))
    assert not (tmp_path / "run" / "checkpoints").exists()


def _single():
    from onebit_bert.distributed import Communicator

    return Communicator(None)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["optimizer.name=rmsprop"], "not a registered optimizer; choose one of lamb"),
        (["model.preset=bert-huge"], "must be one of"),
        (["schedule.warmup_proportion=1.5"], "warmup_proportion"),
        (["batch.micro_batch_size=0"], "batch sizes"),
        (["optimizer.freeze_step=0"], "freeze_step"),
        (["clip_grad_norm=-1"], "clip_grad_norm"),
        (["logging.every=0"], "logging.every"),
        (["collective_timeout_s=0"], "collective_timeout_s must be > 0"),
        (["model.compile=fast"], "must be one of"),
    ],
)
def test_bad_config_values(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(PretrainConfig, REPO / "configs" / "pretrain" / "tiny.yaml", overrides)


def test_the_collective_timeout_reaches_the_process_group(monkeypatch):
    import pretrain.__main__ as cli

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "init_distributed", fake_init)
    with pytest.raises(SystemExit):
        cli.main(
            [
                "--config",
                str(REPO / "configs" / "pretrain" / "tiny.yaml"),
                "collective_timeout_s=90",
            ]
        )
    assert seen == {"backend": None, "timeout_s": 90.0}


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "pretrain").glob("*.yaml")))
def test_shipped_configs_load_and_divide(path):
    cfg = load_config(PretrainConfig, path)
    for world in (1, 2, 4, 8):
        if cfg.batch.global_batch_size % (cfg.batch.micro_batch_size * world) == 0:
            assert cfg.batch_plan(world) >= 1


# ----------------------------------------------------------------------------- pieces


def test_schedules():
    poly = ScheduleConfig(name="poly", max_steps=100, warmup_proportion=0.1, power=0.5)
    assert lr_multiplier(poly, 0) == 0 and lr_multiplier(poly, 5) == 0.5
    assert lr_multiplier(poly, 10) == pytest.approx(0.9**0.5)
    assert lr_multiplier(poly, 100) == 0
    ee = ScheduleConfig(
        name="ee", max_steps=1000, warmup_proportion=0.02, decay_rate=0.9, decay_step=250
    )
    assert lr_multiplier(ee, 10) == pytest.approx(0.25)  # (10/20)^2
    assert lr_multiplier(ee, 20 + 250) == pytest.approx(0.9)
    assert lr_multiplier(ee, 20 + 500) == pytest.approx(0.81)


def test_batches_cover_an_epoch_and_split_by_rank():
    one = BatchSchedule(1000, 64, 8, 8, 1, seed=3)
    two = BatchSchedule(1000, 64, 8, 4, 2, seed=3)
    assert one.steps_per_epoch == 15
    seen = np.concatenate([one.global_indices(s) for s in range(15)])
    assert len(np.unique(seen)) == len(seen) == 960
    for step in (0, 7, 15, 31):
        union = [rows for r in range(2) for _, rows in two.micro_indices(step, r)]
        assert np.array_equal(np.concatenate(union), one.global_indices(step))
        assert [k for k, _ in one.micro_indices(step, 0)] == list(range(8))
    assert not np.array_equal(one.global_indices(0), one.global_indices(15))  # a new epoch


def test_masking_follows_bert():
    ids = TokenIds(cls=2, sep=3, pad=0, mask=4, vocab_size=1000)
    rng = np.random.default_rng(0)
    n, length = 4000, 64
    tokens = rng.integers(10, 1000, size=(n, length))
    tokens[:, 0] = 2
    tokens[:, 40] = 3
    tokens[:, 50:] = 0
    tokens[:, 49] = 3
    attention = (np.arange(length) < 50).astype(np.int64)[None, :].repeat(n, 0)
    masked, labels = mask_tokens(tokens, attention, ids, np.random.default_rng(1), 0.15, 20)
    chosen = labels != -100
    assert not chosen[:, [0, 40, 49]].any() and not chosen[:, 50:].any()
    assert np.all(chosen.sum(1) == 7)  # round(47 * 0.15)
    assert np.array_equal(labels[chosen], tokens[chosen])
    replaced = masked[chosen]
    assert abs((replaced == 4).mean() - 0.8) < 0.02
    kept = (replaced == tokens[chosen]).mean()
    assert 0.09 < kept < 0.12  # 10 % kept, plus random draws that hit the same token
    again, _ = mask_tokens(tokens, attention, ids, np.random.default_rng(1), 0.15, 20)
    assert np.array_equal(masked, again)
    capped, labels = mask_tokens(tokens, attention, ids, np.random.default_rng(2), 0.5, 5)
    assert np.all((labels != -100).sum(1) == 5)


def test_a_compressing_optimizer_on_one_process_says_it_compresses_nothing():
    from onebit_bert.config import from_dict
    from pretrain.config import PretrainConfig
    from pretrain.train import single_process_notes

    def cfg(**optimizer_and_strategy):
        strategy = optimizer_and_strategy.pop("strategy", {})
        optimizer = {"freeze_step": 1000, **optimizer_and_strategy}  # within max_steps
        return from_dict(PretrainConfig, {"optimizer": optimizer,
                                          "strategy": strategy})  # fmt: skip

    (note,) = single_process_notes(cfg(name="onebit_lamb"), world_size=1)
    assert "exact LAMB without bias correction" in note and "force_compression" in note
    assert "uncompressed" in single_process_notes(cfg(name="onebit_adam"), 1)[0]
    assert single_process_notes(cfg(name="onebit_lamb"), world_size=2) == []
    assert single_process_notes(cfg(name="lamb"), world_size=1) == []
    forced = cfg(name="onebit_lamb", strategy={"force_compression": True})
    assert single_process_notes(forced, world_size=1) == []


def test_model_vocab_size_pads_the_embedding_and_refuses_to_cut_it():
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    padded = build_model(ModelConfig(preset="bert-tiny", vocab_size=128), 70)
    assert padded.get_input_embeddings().weight.shape[0] == 128
    assert padded.cls.predictions.decoder.weight.shape[0] == 128
    assert build_model(ModelConfig(preset="bert-tiny"), 70).config.vocab_size == 70
    with pytest.raises(ValueError, match="model.vocab_size is 64, but the tokenizer has 70"):
        build_model(ModelConfig(preset="bert-tiny", vocab_size=64), 70)
