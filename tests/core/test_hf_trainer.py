"""HF ``Trainer`` with the mixin on 2 gloo ranks: saving and resuming a checkpoint. Each
rank's compression errors come back as that rank saved them (not rank 0's, and not from
zero), and an optimizer that is not 1-bit (LAMB) trains, saves and resumes under plain
DDP. ``Trainer`` itself does not resume bit for bit on 2 ranks (its data order and loss
bookkeeping after a resume are its own), so these tests compare the restored optimizer
state, not the trajectory."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from onebit_bert.hf_trainer import PER_RANK_FILE, unwrap_optimizer
from onebit_bert.optim import Lamb, OneBitLamb
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.tiny_bert import (
    HYPER,
    ExampleRows,
    launch_environment,
    tiny_bert,
    trainer_arguments,
)

STEPS, SAVE_AT = 6, 4  # 1-bit LAMB's warmup ends at step 3: the checkpoint is compressing


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _trainer(comm, out_dir, optimizer: str, saved: dict):
    from transformers import Trainer, TrainerCallback

    from onebit_bert.hf_trainer import OneBitTrainerMixin

    class Recorder(TrainerCallback):
        """The optimizer state (deep copy) each time a checkpoint is written."""

        def on_save(self, args, state, control, optimizer=None, **kwargs):
            saved[state.global_step] = _copy(unwrap_optimizer(optimizer).state_dict())

    class RecordingTrainer(OneBitTrainerMixin, Trainer):
        restored = None

        def _load_optimizer_and_scheduler(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                self.restored = _copy(unwrap_optimizer(self.optimizer).state_dict())

    def make(model, c):
        if optimizer == "onebit_lamb":
            return OneBitLamb(model.parameters(), comm=c, **HYPER)
        return Lamb(model.parameters(), lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])

    trainer = RecordingTrainer(
        model=tiny_bert(),
        args=trainer_arguments(out_dir, STEPS, save_strategy="steps", save_steps=SAVE_AT),
        train_dataset=ExampleRows(comm.world_size, STEPS),
        make_optimizer=make,
        callbacks=[Recorder()],
    )
    trainer.model_accepts_loss_kwargs = False
    return trainer


def _copy(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_copy(v) for v in state)
    return state


def save_and_resume(comm, out_dir, optimizer):
    """Train ``STEPS`` steps saving at ``SAVE_AT``, then a fresh trainer resumes from that
    checkpoint and finishes; what was saved, what was restored and the resume's warnings."""
    torch.set_num_threads(1)
    launch_environment(comm)
    saved: dict = {}
    _trainer(comm, out_dir, optimizer, saved).train()
    comm.barrier()
    resumed = _trainer(comm, out_dir, optimizer, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{SAVE_AT}"))
    inner = unwrap_optimizer(resumed.optimizer)
    return {
        "saved": saved[SAVE_AT],
        "restored": resumed.restored,
        "warnings": [str(w.message) for w in caught],
        "files": sorted(os.listdir(os.path.join(out_dir, f"checkpoint-{SAVE_AT}"))),
        "stage": getattr(inner, "stage", None),
        "step": resumed.state.global_step,
    }


@pytest.fixture(scope="module")
def onebit(tmp_path_factory):
    return run_ranks(save_and_resume, 2, tmp_path_factory.mktemp("onebit"), "onebit_lamb")


def test_each_rank_resumes_its_own_compression_errors(onebit):
    for rank, result in enumerate(onebit):
        assert PER_RANK_FILE.format(rank=rank) in result["files"]
        saved, restored = result["saved"], result["restored"]
        assert saved["per_rank"]["error_feedback"]["rank"] == rank
        assert _same(restored["per_rank"], saved["per_rank"])
        assert _same(restored["state"], saved["state"])
        assert not [w for w in result["warnings"] if "from zero" in w], result["warnings"]
        assert result["stage"] == "compression" and result["step"] == STEPS
    # the ranks' errors differ, so a rank loading another's would be caught above
    errors = [r["saved"]["per_rank"]["error_feedback"]["worker_error"] for r in onebit]
    assert errors[0].abs().sum() > 0 and not torch.equal(errors[0], errors[1])


def test_lamb_trains_saves_and_resumes_under_the_mixin_on_two_ranks(tmp_path):
    results = run_ranks(save_and_resume, 2, tmp_path, "lamb")
    for result in results:
        assert result["step"] == STEPS
        assert not any(name.startswith("optimizer_per_rank") for name in result["files"])
        assert _same(result["restored"]["state"], result["saved"]["state"])
        assert result["restored"]["state"]  # LAMB's moments were restored, not empty
    # plain DDP averaged every gradient: both ranks hold the same LAMB state
    assert _same(results[0]["saved"]["state"], results[1]["saved"]["state"])


def test_a_cpu_rank_loads_with_a_plain_cpu_device_while_resuming(tmp_path):
    """Older transformers load a multi-rank run's optimizer state with ``args.device`` as
    ``map_location``; accelerate makes that ``cpu:<n>`` on CPU ranks, which torch cannot
    restore. While the mixin resumes, such a cached device reads ``cpu``; others stay."""
    from types import SimpleNamespace

    from onebit_bert.hf_trainer import _plain_cpu_device

    path = tmp_path / "state.pt"
    torch.save({"t": torch.ones(2)}, path)
    with pytest.raises(RuntimeError, match="restore data location"):  # what it works around
        torch.load(path, map_location=torch.device("cpu", 1))
    indexed = SimpleNamespace(_setup_devices=torch.device("cpu", 1))
    with _plain_cpu_device(indexed):
        assert indexed._setup_devices == torch.device("cpu")
        assert torch.equal(
            torch.load(path, map_location=indexed._setup_devices)["t"], torch.ones(2)
        )
    assert indexed._setup_devices == torch.device("cpu", 1)
    for device in (torch.device("cpu"), torch.device("cuda", 0), None):
        args = SimpleNamespace() if device is None else SimpleNamespace(_setup_devices=device)
        with _plain_cpu_device(args):
            assert vars(args).get("_setup_devices") == device
        assert vars(args).get("_setup_devices") == device
