"""Shared training machinery: checkpoints, loss scaling, metrics logging, configs."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from onebit_bert.checkpoint import CheckpointManager
from onebit_bert.config import ConfigError, load_config, parse_overrides
from onebit_bert.distributed import Communicator
from onebit_bert.metrics_log import LoggingConfig, MetricsLogger, read_metrics
from onebit_bert.precision import LossScaler, resolve_precision
from pretrain.config import PretrainConfig
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.loss_scaling import overflow_on_rank_one
from tests.helpers.paths import REPO

# ----------------------------------------------------------------------------- checkpoints


def _save_three(comm, directory):
    manager = CheckpointManager(directory, comm, keep_last=2)
    for step in (10, 20, 30):
        manager.save(step, {"w": torch.full((3,), float(step))}, {"rank": comm.rank, "step": step})
    return [p.name for p in manager.checkpoints()]


@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoints_keep_the_last_k_and_load_the_newest(tmp_path, world_size):
    names = run_ranks(_save_three, world_size, str(tmp_path))[0]
    assert names == ["step_00000020", "step_00000030"]
    for rank, found in enumerate(run_ranks(_load, world_size, str(tmp_path))):
        assert found["step"] == 30 and found["per_rank"] == {"rank": rank, "step": 30}
        assert not found["warnings"]


def _load(comm, directory):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = CheckpointManager(directory, comm).load_latest()
    return {"step": found[0], "per_rank": found[2], "warnings": [str(w.message) for w in caught]}


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run_ranks(_save_three, 2, str(tmp_path))
    # Rank 1's file of the newest checkpoint is cut short: no rank may use that checkpoint.
    newest = tmp_path / "step_00000030" / "rank00001.pt"
    newest.write_bytes(newest.read_bytes()[:20])
    results = run_ranks(_load, 2, str(tmp_path))
    assert [r["step"] for r in results] == [20, 20]
    assert results[1]["per_rank"] == {"rank": 1, "step": 20}
    assert any("unusable" in w for w in results[1]["warnings"])


def test_a_half_written_checkpoint_is_ignored(tmp_path):
    run_ranks(_save_three, 1, str(tmp_path))
    (tmp_path / "step_00000040.tmp").mkdir()  # a save that never finished
    broken = tmp_path / "step_00000050"  # renamed, but its marker lost (e.g. disk full)
    broken.mkdir()
    found = _load(Communicator(None), tmp_path)
    assert found["step"] == 30
    assert any("step_00000050" in w and "unusable" in w for w in found["warnings"])


def test_another_world_size_gets_no_per_rank_state(tmp_path):
    run_ranks(_save_three, 2, str(tmp_path))
    found = CheckpointManager(tmp_path, Communicator(None)).load_latest()
    assert found[0] == 30 and found[2] is None


# ----------------------------------------------------------------------------- loss scaling


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    results = run_ranks(overflow_on_rank_one, 2)
    assert results == [(False, 512.0, 1), (False, 512.0, 1)]


def test_loss_scaler_grows_and_is_a_no_op_without_fp16():
    scaler = LossScaler("fp16", Communicator(None), init_scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    for _ in range(2):
        p.grad = torch.ones(2) * scaler.scale
        ok = scaler.unscale_and_check([p])
        assert ok and torch.equal(p.grad, torch.ones(2))
        scaler.update(ok)
    assert scaler.scale == 16.0
    off = LossScaler("bf16", Communicator(None))
    loss = torch.tensor(3.0)
    assert off.scaled(loss) is loss and off.unscale_and_check([p])


def test_precision_choice():
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_precision("bf16", torch.device("cpu"))


# ----------------------------------------------------------------------------- logging


def test_metrics_go_to_jsonl_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = MetricsLogger(tmp_path, True, LoggingConfig(experiment="exp"), config={"a": 1})
    logger.log(1, {"loss": torch.tensor(2.5), "stage": "warmup", "nan": float("nan")})
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[0]["loss"] == 2.5 and records[0]["stage"] == "warmup"
    assert records[0]["nan"] == "nan"
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run written"


def test_a_failing_wandb_does_not_stop_logging(tmp_path, monkeypatch):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.warns(UserWarning, match="wandb did not start"):
        logger = MetricsLogger(tmp_path, True, LoggingConfig())
    logger.log(3, {"loss": 1.0})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 3


def test_tensorboard_writer_logs_every_numeric_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(wandb=False, tensorboard=True)
    logger = MetricsLogger(tmp_path, True, cfg)
    for step in (1, 2):
        logger.log(step, {"loss": 3.0 - step, "comm_bytes": 100 * step, "stage": "warmup"})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "comm_bytes"}  # text is left out
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.0)]


def test_a_kind_that_stops_being_sent_goes_to_zero_in_wandb_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Recorder:
        """Stands in for the wandb run: what it was given, call by call."""

        def __init__(self):
            self.calls = []

        def log(self, data, step):
            self.calls.append((step, dict(data)))

        def finish(self):
            pass

    logger = MetricsLogger(tmp_path, True, LoggingConfig(wandb=False, tensorboard=True))
    logger._wandb = wandb = Recorder()
    warm = {"comm_bytes": 100, "comm_bytes_gradients": 100, "comm_seconds_gradients": 0.5}
    logger.log(1, warm)
    logger.log(2, {"comm_bytes": 4, "comm_bytes_momentum": 4, "comm_seconds_momentum": 0.1})
    logger.log(2, {"val_loss": 3.0})  # a validation record at the same step: left alone
    logger.close()
    step2, validation = wandb.calls[1][1], wandb.calls[2][1]
    assert step2["comm_bytes_gradients"] == 0 and step2["comm_seconds_gradients"] == 0
    assert step2["comm_bytes_momentum"] == 4
    assert validation == {"val_loss": 3.0}
    # the local file keeps each step as it was: no kind that was not sent
    assert "comm_bytes_gradients" not in read_metrics(tmp_path / "metrics.jsonl")[1]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    sent = [(e.step, e.value) for e in events.Scalars("comm_bytes_gradients")]
    assert sent == [(1, 100.0), (2, 0.0)]


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match="logging.tensorboard needs the tensorboard package"):
        MetricsLogger(tmp_path, True, LoggingConfig(wandb=False, tensorboard=True))


def test_only_the_main_rank_writes(tmp_path):
    logger = MetricsLogger(tmp_path, False, LoggingConfig(wandb=False))
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- configs


def test_config_bases_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("seed: 1\nbatch: {global_batch_size: 64}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nbatch: {micro_batch_size: 8}\n")
    cfg = load_config(PretrainConfig, tmp_path / "child.yaml", ["seed=5", "optimizer.lr=0.5"])
    assert (cfg.seed, cfg.batch.global_batch_size, cfg.batch.micro_batch_size) == (5, 64, 8)
    assert cfg.optimizer.lr == 0.5 and cfg.optimizer.betas == (0.9, 0.999)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(PretrainConfig, tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not of the form"):
        parse_overrides(["seed"])
    assert parse_overrides(["--a.b=[1, 2]"]) == {"a": {"b": [1, 2]}}
    saved = json.loads(json.dumps(parse_overrides(["x=null"])))
    assert saved == {"x": None}


def test_a_gpu_generator_state_is_saved_for_this_rank_s_gpu_only(monkeypatch):
    """The CUDA generator saved is the current device's; a checkpoint holding every
    visible GPU's (older files) restores this rank's entry, and one from a node with fewer
    GPUs than this rank's index restores none, rather than failing. (A fake torch.cuda:
    the real one is exercised by make test-gpu.)"""
    from pretrain import checkpointing

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.tensor([11], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    state = checkpointing.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([11], dtype=torch.uint8))
    checkpointing.set_rng_state(state)
    older = {**state, "cuda": [torch.tensor([k], dtype=torch.uint8) for k in (20, 21, 22)]}
    checkpointing.set_rng_state(older)
    checkpointing.set_rng_state({**state, "cuda": [torch.tensor([30], dtype=torch.uint8)]})
    assert [int(t[0]) for t in restored] == [11, 21]


def test_every_run_directory_gets_its_own_wandb_run_and_keeps_it(tmp_path, monkeypatch):
    import wandb

    seen = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: seen.append(kwargs))
    cfg = LoggingConfig(experiment="parity", run_name="lamb-seed1-phase1", job_type="phase1")
    MetricsLogger(tmp_path / "lamb", True, cfg).close()
    MetricsLogger(tmp_path / "lamb", True, cfg).close()  # the resume
    other = LoggingConfig(experiment="parity", run_name="onebit_lamb-seed1-phase1")
    MetricsLogger(tmp_path / "onebit", True, other).close()
    first, resumed, onebit = seen
    assert first["id"] == resumed["id"] != onebit["id"]
    assert first["resume"] == "allow" and first["job_type"] == "phase1"
    assert first["group"] == "parity" and first["name"] == "lamb-seed1-phase1"
    assert (tmp_path / "lamb" / "wandb_id").read_text().strip() == first["id"]
    # the same names in another directory (another experiment's workdir): another run
    MetricsLogger(tmp_path / "elsewhere" / "lamb", True, cfg).close()
    assert seen[-1]["id"] != first["id"]


@pytest.mark.parametrize("experiment", ["compare.yaml", "parity.yaml", "repro_mini.yaml"])
def test_the_runs_of_an_experiment_get_distinct_wandb_ids(tmp_path, experiment):
    from onebit_bert.metrics_log import wandb_run_id
    from pipeline.experiment import load_experiment

    exp = load_experiment(REPO / "configs/experiments" / experiment, [f"workdir={tmp_path}"])
    stages = [s for s in exp.resolve(write=False) if s.kind == "pretrain"]
    ids = set()
    for stage in stages:
        log = stage.stage_config().logging
        ids.add(wandb_run_id(stage.output, log.experiment, log.run_name))
        assert log.job_type == stage.name.rsplit("/", 1)[1]
    assert len(ids) == len(stages) > 1
