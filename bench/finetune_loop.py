"""Fine-tuning speed: the project's loop (``finetune.trainer.fit``) against HF ``Trainer``.

``fit`` was a hand-written loop when this benchmark chose between the two (HF ``Trainer``
measured as fast on the CPU); it now sets up HF ``Trainer`` itself, so the figure is the
cost of its additions (each step's loss kept on the device) over a bare ``Trainer``.

Both train the same sequence classifier (BERT of ``--model``'s shape, fresh weights, seeded)
on the same generated examples (random token ids and labels: the speed does not depend on
the text) with the same recipe: AdamW (torch's, eps 1e-6, weight decay 0.01 off biases and
LayerNorm), linear warmup (10 %) and decay, gradient clipping at 1.0, batch ``--batch``,
fp32 on the CPU. Each loop runs ``--repeats`` times, alternating, ``--examples`` examples
for one epoch; the figure is the median wall time of ``fit()`` / ``trainer.train()`` (model
construction excluded). One JSON object on stdout.

    python -m bench.finetune_loop --model bert-mini --examples 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO))

VOCAB = 30522


def build_model(preset: str, seed: int):
    import torch
    from transformers import BertForSequenceClassification

    from pretrain.config import ModelConfig
    from pretrain.model import bert_config

    torch.manual_seed(seed)
    config = bert_config(ModelConfig(preset=preset, max_position_embeddings=512), VOCAB)
    config.num_labels = 2
    return BertForSequenceClassification(config)


def examples(n: int, length: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(1000, VOCAB, (n, length), generator=g),
        "token_type_ids": torch.zeros(n, length, dtype=torch.long),
        "attention_mask": torch.ones(n, length, dtype=torch.long),
        "labels": torch.randint(0, 2, (n,), generator=g),
    }


def ours(args, features) -> float:
    import torch

    from finetune.trainer import fit

    model = build_model(args.model, 0)
    start = time.perf_counter()
    fit(
        model,
        features,
        lr=2e-5,
        epochs=1,
        batch_size=args.batch,
        seed=1,
        device=torch.device("cpu"),
        precision="fp32",
    )
    return time.perf_counter() - start


def hf_trainer(args, features, out: Path) -> float:
    from transformers import Trainer, TrainingArguments

    from finetune.trainer import FeatureRows

    model = build_model(args.model, 0)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(out),
            use_cpu=True,
            per_device_train_batch_size=args.batch,
            num_train_epochs=1,
            learning_rate=2e-5,
            weight_decay=0.01,
            adam_epsilon=1e-6,
            warmup_steps=0.1,
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            optim="adamw_torch",
            save_strategy="no",
            report_to=[],
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=1,
        ),
        train_dataset=FeatureRows(features),
    )
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune_loop", description=__doc__)
    parser.add_argument("--model", default="bert-mini", help="model preset (default bert-mini)")
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--length", type=int, default=128, help="tokens per example")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    import transformers

    torch.set_num_threads(torch.get_num_threads())
    features = examples(args.examples, args.length, 0)
    times: dict[str, list[float]] = {"ours": [], "hf_trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            times["ours"].append(ours(args, features))
            times["hf_trainer"].append(hf_trainer(args, features, Path(tmp)))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "finetune_loop",
        "model": args.model,
        "examples": args.examples,
        "length": args.length,
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "samples_per_s": {k: round(args.examples / t, 2) for k, t in median.items()},
        "hf_trainer_over_ours": round(median["ours"] / median["hf_trainer"], 3),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
