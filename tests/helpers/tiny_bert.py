"""The tiny BERT, its per-rank batches and 1-bit LAMB settings that the tests of users'
own scripts share (tests/core/test_ddp_recipe.py, tests/core/test_hf_trainer.py,
tests/core/optim/test_optimizer_guards.py)."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import Dataset

STEPS, FREEZE = 6, 3
HYPER = {"lr": 0.02, "freeze_step": FREEZE, "max_coeff": 0.3, "weight_decay": 0.01}


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def batch(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(5, 60, (4, 16), generator=g)
    labels = torch.where(torch.rand(4, 16, generator=g) < 0.3, ids, -100)
    return {"input_ids": ids, "labels": labels}


def example_rows(world_size: int, steps: int) -> list[dict]:
    """Every step's :func:`batch` rows, one example each, step by step and rank by rank: a
    sequential sampler over them gives global batch i of 4 rows to rank i % world_size,
    as Accelerate shards it, so an HF Trainer rank sees the rows a DDP script's rank does."""
    return [
        {k: v[i] for k, v in batch(rank, step).items()}
        for step in range(1, steps + 1)
        for rank in range(world_size)
        for i in range(4)
    ]


class ExampleRows(Dataset):
    """:func:`example_rows` as a dataset for HF ``Trainer``."""

    def __init__(self, world_size: int, steps: int):
        self.rows = example_rows(world_size, steps)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def trainer_arguments(out_dir, steps: int, **save):
    """HF ``TrainingArguments`` for the tiny BERT on the CPU: ``steps`` steps of 4 rows per
    rank at a constant learning rate, no clipping, logging or workers; ``save`` sets the
    checkpoint policy (``save_strategy`` and its settings)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out_dir),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=HYPER["lr"],
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **save,
    )


def launch_environment(comm) -> None:
    """The launcher variables Accelerate reads (the process group already exists)."""
    os.environ.update(
        RANK=str(comm.rank),
        LOCAL_RANK=str(comm.rank),
        WORLD_SIZE=str(comm.world_size),
        LOCAL_WORLD_SIZE=str(comm.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29555",
    )
