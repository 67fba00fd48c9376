"""The fast path's host synchronisations, counted on the CPU (bench/host_syncs.py): the
optimizers' steps make none, and a training step makes a fixed number whatever the depth
of the model, never one per parameter. tests/test_gpu.py holds the same on CUDA with
torch's sync debug mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bench.host_syncs import count_host_syncs
from onebit_bert.config import from_dict
from onebit_bert.distributed import Communicator, init_distributed
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from pretrain.config import PretrainConfig
from pretrain.train import Trainer
from tests.test_pretrain import tiny_config

# Every stage within 8 steps: 1-bit LAMB and 1-bit Adam compress from step 3, 0/1 Adam
# freezes its variance after step 2 and then takes local steps between 1-bit syncs.
STAGES = {
    "freeze_step": 2,
    "var_freeze_step": 2,
    "local_step_scaler": 1,
    "local_step_clipper": 2,
}
OURS = ["lamb", "onebit_lamb", "onebit_adam", "zero_one_adam", "sgd"]


def _model(device: str) -> nn.Module:
    """Three linear + LayerNorm blocks: weights, biases and no-decay tensors."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(3)]
    return nn.Sequential(*blocks).to(device)


def optimizer_step_syncs(name: str, device: str) -> tuple[list[int], list, torch.optim.Optimizer]:
    """Host syncs of 8 steps of optimizer ``name`` on ``device``, and its stage at each."""
    model = _model(device)
    cfg = from_dict(OptimizerConfig, {"name": name, **STAGES})
    comm = Communicator(None, device=device)
    optimizer = build_optimizer(cfg, model, comm, force_compression=True)
    stages, counts = [], []
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        counts.append(count_host_syncs(optimizer.step, device)[1])
        stages.append(getattr(optimizer, "stage", None))
    return counts, stages, optimizer


def test_the_cpu_count_sees_what_would_wait_on_a_gpu():
    x = torch.arange(6.0)
    assert count_host_syncs(lambda: x.sum() * 2, "cpu")[1] == 0
    assert count_host_syncs(lambda: x.sum().item(), "cpu") == (15.0, 1)
    assert count_host_syncs(lambda: x[x > 2], "cpu")[1] == 1  # boolean mask: nonzero
    assert count_host_syncs(lambda: [float(v) for v in x], "cpu")[1] == 6


@pytest.mark.parametrize("name", OURS)
def test_optimizer_steps_make_no_host_sync(name):
    """Trust ratios, norms, clamps and 1-bit scales stay on the device: no step reads a
    value back, in any stage. (torch's AdamW reads its step counts on the CPU; on CUDA
    it runs fused, tested in tests/test_gpu.py.)"""
    counts, stages, _ = optimizer_step_syncs(name, "cpu")
    assert counts == [0] * 8, counts
    if name in ("onebit_lamb", "onebit_adam"):
        assert stages == ["warmup"] * 2 + ["compression"] * 6
    if name == "zero_one_adam":
        assert stages[-1] != stages[0], stages


def training_step_syncs(corpus, run_dir, preset: str, device: str) -> list[int]:
    """Host syncs of 1-bit LAMB's first three steps (the warmup, then compression)."""
    cfg = tiny_config(
        corpus,
        run_dir,
        **{
            "model.preset": preset,
            "optimizer.name": "onebit_lamb",
            "optimizer.freeze_step": 1,
            "strategy.force_compression": True,
            "schedule.max_steps": 3,
            "batch.global_batch_size": 16,
        },
    )
    ctx = init_distributed(backend="gloo" if device == "cpu" else None, env={})
    trainer = Trainer(from_dict(PretrainConfig, cfg), ctx)
    assert trainer.ctx.device.type == torch.device(device).type
    try:
        return [count_host_syncs(lambda s=s: trainer.train_step(s), device)[1] for s in range(3)]
    finally:
        trainer.logger.close()


def test_a_training_step_syncs_as_often_at_any_depth(tiny_corpus, tmp_path):
    """bert-tiny (2 layers) and bert-mini (4 layers, 4 heads, twice the width) make the
    same host syncs per step: one per micro-batch (HF's check of the attention mask for
    padding) and one per step (the gradient norm). The masked positions and NSP rows are
    found on the host (make_batch), not by boolean masks on the device."""
    torch.set_num_threads(1)
    tiny = training_step_syncs(tiny_corpus, tmp_path / "tiny", "bert-tiny", "cpu")
    mini = training_step_syncs(tiny_corpus, tmp_path / "mini", "bert-mini", "cpu")
    assert tiny == mini, (tiny, mini)
    micro_batches = 2  # global 16, micro 8
    assert tiny == [micro_batches + 1] * 3, tiny
