"""Host syncs counted for the optimizers' steps and for the first training steps, on
either device (tests/core/optim/test_host_syncs.py on the CPU, tests/test_gpu.py on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from bench.host_syncs import count_host_syncs, find_host_syncs
from onebit_bert.config import from_dict
from onebit_bert.distributed import Communicator, init_distributed
from onebit_bert.optim.build import OptimizerConfig, build_optimizer
from pretrain.config import PretrainConfig
from pretrain.train import Trainer
from tests.helpers.runs import tiny_config

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
    """Host syncs of 8 steps of optimizer ``name`` on ``device``, and its stage at each
    (where each sync happened: ``optimizer.sync_sites``, per step)."""
    model = _model(device)
    cfg = from_dict(OptimizerConfig, {"name": name, **STAGES})
    comm = Communicator(None, device=device)
    optimizer = build_optimizer(cfg, model, comm, force_compression=True)
    stages, counts, optimizer.sync_sites = [], [], []
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        sites = find_host_syncs(optimizer.step, device)[1]
        counts.append(len(sites))
        optimizer.sync_sites.append(sites)
        stages.append(getattr(optimizer, "stage", None))
    return counts, stages, optimizer


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
        return [count_host_syncs(lambda s=s: trainer.train_step(s), device)[1] for s in (1, 2, 3)]
    finally:
        trainer.logger.close()
        trainer.release()
