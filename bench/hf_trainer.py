"""Baseline: Hugging Face ``Trainer`` pretraining the project's BERT on prepared shards.

The same ``BertForPreTraining`` (built from one of the project's presets), rows and batch
size as our loop, pushed through HF's own pipeline: a map-style dataset of the shard
rows, ``DataCollatorForLanguageModeling`` masking 15 % of the tokens on the fly, and the
model's own loss, whose MLM head runs on every position (our loop runs it on the masked
positions only). Used by ``bench/train.py`` (bert-mini on the CPU) and ``bench/gpu.py``
(BERT-Large on one GPU).
"""

from __future__ import annotations

import time
from pathlib import Path


def hf_trainer_step_seconds(
    data: Path,
    out_dir: Path,
    *,
    preset: str,
    steps: int,
    batch: int,
    vocab_size: int | None = None,
    **training_args,
) -> list[float]:
    """Train ``steps`` optimizer steps with HF ``Trainer`` on the shards in ``data``; returns
    the seconds of every step after the first (``steps - 1`` values, end to end).
    ``vocab_size``: the model's embedding rows (``model.vocab_size``; default the
    tokenizer's).

    ``training_args`` go to ``TrainingArguments`` on top of a quiet, checkpoint-free base
    (learning rate, device, precision, optimizer, ``torch_compile``, ...). On a GPU the
    device is synchronised at every step end, so each step is charged with the kernels it
    queued rather than with those of the step before.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from onebit_bert.shards import PretrainingShards
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    rows = PretrainingShards(data, "train")
    tokenizer = AutoTokenizer.from_pretrained(rows.tokenizer_dir)

    class Rows(torch.utils.data.Dataset):
        """The pretraining shard rows as a map-style dataset of tensors."""

        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            features = rows.batch([i])
            return {k: torch.as_tensor(v[0]) for k, v in features.items()}

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(preset=preset, vocab_size=vocab_size), len(tokenizer), tokenizer.pad_token_id
    )
    times: list[float] = []

    class StepTimes(TrainerCallback):
        """Records the time at the end of every optimizer step."""

        def on_step_end(self, args, state, control, **kwargs):
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)
            times.append(time.perf_counter())

    args = TrainingArguments(
        **{
            "output_dir": str(out_dir),
            "per_device_train_batch_size": batch,
            "max_steps": steps,
            "logging_strategy": "no",
            "save_strategy": "no",
            "report_to": [],
            "dataloader_num_workers": 0,
            "disable_tqdm": True,
            "seed": 0,
            **training_args,
        }
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Rows(),
        data_collator=collator,
        callbacks=[StepTimes()],
    )
    trainer.train()
    return [b - a for a, b in zip(times, times[1:], strict=False)]
