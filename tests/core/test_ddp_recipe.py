"""1-bit LAMB in users' own scripts: 2 gloo ranks train a tiny BERT through a plain
``DistributedDataParallel`` script with the compression hook (onebit_bert.ddp), through HF
``Trainer`` with the mixin (onebit_bert.hf_trainer), through a hand-written Accelerate
loop, and through the harness's own strategy, with the same optimizer, data and seed. The
parameters agree bit for bit, and no gradient byte is sent once compression starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.ddp import merge_state_dict, register_compression_hook, split_state_dict
from onebit_bert.distributed import Communicator
from onebit_bert.optim import OneBitLamb
from onebit_bert.strategies.data_parallel import SelfSyncingDataParallel
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import dist_context
from tests.helpers.tiny_bert import (
    FREEZE,
    HYPER,
    STEPS,
    ExampleRows,
    batch,
    launch_environment,
    tiny_bert,
    trainer_arguments,
)


def _sent(comm, before=None) -> tuple[int, int]:
    """Gradient and momentum bytes this rank sent since the snapshot ``before`` (default:
    since ``comm`` was built)."""
    delta = comm.snapshot() - before if before is not None else comm.snapshot()
    return tuple(delta.by_kind.get(kind, [0])[0] for kind in ("gradients", "momentum"))


def _assert_trains_as_the_script(path: list[dict], script: list[dict]) -> None:
    """Per rank: in the compression stage, the script's parameters bit for bit, and the
    script's gradient and momentum bytes (the warmup's gradients, then momentum only)."""
    for mine, theirs in zip(path, script, strict=True):
        assert mine["stage"] == "compression"
        for a, b in zip(mine["params"], theirs["params"], strict=True):
            assert torch.equal(a, b)
        assert mine["sent"] == theirs["sent"][-1]


def ddp_script(comm):
    """What a user's DDP + LAMB script becomes with 1-bit LAMB (the recipe of
    docs/guide/library.md)."""
    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny_bert(), process_group=comm.group)
    optimizer = OneBitLamb(model.parameters(), comm=comm, **HYPER)
    register_compression_hook(model, optimizer, comm)
    before, sent = comm.snapshot(), []
    for step in range(1, STEPS + 1):
        model(**batch(comm.rank, step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sent.append(_sent(comm, before))
    shared, per_rank = split_state_dict(optimizer)
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "sent": sent,
        "stage": optimizer.stage,
        "shared": shared,
        "per_rank": per_rank,
    }


class MaskedLMLoss(nn.Module):
    """The harness's forward-module contract: ``(loss, statistics)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).loss, {}


def harness_run(comm):
    torch.set_num_threads(1)
    model = tiny_bert()
    optimizer = OneBitLamb(model.parameters(), comm=comm, **HYPER)
    strategy = SelfSyncingDataParallel(
        model, MaskedLMLoss(model), optimizer, dist_context(comm), use_ddp=False
    )
    for step in range(1, STEPS + 1):
        with strategy.backward_context(True):
            loss, _ = strategy.forward_module(**batch(comm.rank, step))
            loss.backward()
        strategy.after_backward()
        strategy.step()
        optimizer.zero_grad()
        strategy.after_step(step)
    return {"params": [p.detach().clone() for p in model.parameters()]}


def every_path(comm, out_dir):
    """All four ways on each rank, one after the other (one spawn of the ranks for all)."""
    return {
        "script": ddp_script(comm),
        "harness": harness_run(comm),
        "trainer": hf_trainer_run(comm, out_dir),
        "accelerate": accelerate_run(comm),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every path's results on 2 ranks: ``runs[path][rank]``."""
    ranks = run_ranks(every_path, 2, tmp_path_factory.mktemp("trainer"))
    return {path: [r[path] for r in ranks] for path in ranks[0]}


@pytest.fixture(scope="module")
def script(runs):
    """The DDP script's run, the reference of every test here."""
    return runs["script"]


def test_a_ddp_script_with_the_hook_trains_as_the_harness_does_and_sends_no_gradients(script, runs):
    harness = runs["harness"]
    for mine, theirs in zip(script, harness, strict=True):
        assert mine["stage"] == "compression"
        for a, b in zip(mine["params"], theirs["params"], strict=True):
            assert torch.equal(a, b)
    for rank in script:
        gradients = [g for g, _ in rank["sent"]]
        momentum = [m for _, m in rank["sent"]]
        # warmup steps 1..3 average gradients; steps 4..6 send only compressed momentum
        assert gradients[0] > 0 and gradients[FREEZE - 1] == FREEZE * gradients[0]
        assert gradients[FREEZE:] == [gradients[FREEZE - 1]] * (STEPS - FREEZE)
        assert momentum[FREEZE - 1] == 0 and momentum[FREEZE] > 0
        assert momentum[-1] == (STEPS - FREEZE) * momentum[FREEZE]
    # the replicas agree, and each rank's compression errors are its own
    assert all(torch.equal(a, b) for a, b in zip(*(r["params"] for r in script), strict=True))
    errors = [r["per_rank"]["optimizer"]["error_feedback"]["worker_error"] for r in script]
    assert not torch.equal(errors[0], errors[1])


def hf_trainer_run(comm, out_dir):
    """The same training under HF Trainer with the mixin (Accelerate wraps the model in
    DDP on the process group this harness made)."""
    from torch.utils.data import SequentialSampler
    from transformers import Trainer

    from onebit_bert.hf_trainer import OneBitTrainerMixin

    torch.set_num_threads(1)
    launch_environment(comm)

    class OneBitTrainer(OneBitTrainerMixin, Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    trainer = OneBitTrainer(
        model=tiny_bert(),
        args=trainer_arguments(out_dir, STEPS, save_strategy="no"),
        # global batch i of 4 rows goes to rank i % 2 (Accelerate's sharding of a
        # sequential sampler): row order step by step, rank by rank
        train_dataset=ExampleRows(comm.world_size, STEPS),
        make_optimizer=lambda model, c: OneBitLamb(model.parameters(), comm=c, **HYPER),
    )
    # the model's own mean loss, as the script takes it (not Trainer's token-count one)
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    optimizer = trainer.optimizer.optimizer  # Accelerate's wrapper
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "sent": _sent(optimizer.comm),  # a communicator of its own: everything it sent
        "stage": optimizer.stage,
    }


def test_hf_trainer_with_the_mixin_trains_as_the_ddp_script_does(script, runs):
    _assert_trains_as_the_script(runs["trainer"], script)


def accelerate_run(comm):
    """The recipe for a hand-written Accelerate loop."""
    from accelerate import Accelerator

    from onebit_bert.hf_trainer import unwrap_optimizer

    torch.set_num_threads(1)
    launch_environment(comm)
    accelerator = Accelerator(cpu=True)
    model = tiny_bert()
    optimizer = OneBitLamb(model.parameters(), comm=comm, **HYPER)
    model, optimizer = accelerator.prepare(model, optimizer)
    register_compression_hook(model, unwrap_optimizer(optimizer), comm)
    before = comm.snapshot()
    for step in range(1, STEPS + 1):
        accelerator.backward(model(**batch(comm.rank, step)).loss)
        optimizer.step()
        optimizer.zero_grad()
    inner = unwrap_optimizer(optimizer)
    return {
        "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
        "sent": _sent(comm, before),
        "stage": inner.stage,
    }


def test_an_accelerate_loop_with_the_hook_trains_as_the_ddp_script_does(script, runs):
    _assert_trains_as_the_script(runs["accelerate"], script)


def test_split_state_dicts_merge_back_for_loading():
    model = tiny_bert()
    optimizer = OneBitLamb(model.parameters(), comm=Communicator(None), **HYPER)
    model(**batch(0, 1)).loss.backward()
    optimizer.step()
    shared, per_rank = split_state_dict(optimizer)
    assert "per_rank" not in shared["optimizer"] and per_rank["optimizer"] is not None
    fresh = OneBitLamb(tiny_bert().parameters(), comm=Communicator(None), **HYPER)
    fresh.load_state_dict(merge_state_dict(shared, per_rank))
    assert fresh.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_the_hook_needs_the_ddp_wrapper():
    model = tiny_bert()
    optimizer = OneBitLamb(model.parameters(), comm=Communicator(None), **HYPER)
    with pytest.raises(TypeError, match="needs the DistributedDataParallel wrapper"):
        register_compression_hook(model, optimizer, Communicator(None))
