"""Fine-tuning as HF users run it: HF ``Trainer`` with AdamW, linear warmup and decay,
clipping and mixed precision on GPUs (bf16, or fp16 with torch's dynamic loss scale, which
skips steps whose gradients overflow); and batched prediction. What ``Trainer`` logs
(loss, learning rate, gradient norm) goes to a
:class:`~onebit_bert.metrics_log.MetricsLogger`, with a progress line now and then, as in
pretraining."""

from __future__ import annotations

import math
import random
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch

from onebit_bert.metrics_log import MetricsLogger
from onebit_bert.precision import autocast


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _batches(features: dict[str, torch.Tensor], batch_size: int, order: np.ndarray):
    for start in range(0, len(order), batch_size):
        index = torch.from_numpy(order[start : start + batch_size])
        yield {k: v[index] for k, v in features.items()}


class FeatureRows(torch.utils.data.Dataset):
    """Row ``i`` of every feature tensor, as the dict ``Trainer``'s collator stacks."""

    def __init__(self, features: dict[str, torch.Tensor]):
        self.features = features
        self.n = len(next(iter(features.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.features.items()}


def fit(
    model: torch.nn.Module,
    features: dict[str, torch.Tensor],
    *,
    lr: float,
    epochs: float,
    batch_size: int,
    seed: int,
    device: torch.device,
    precision: str,
    weight_decay: float = 0.01,
    warmup_proportion: float = 0.1,
    max_grad_norm: float = 1.0,
    on_step: Callable[[], object] | None = None,
    logger: MetricsLogger | None = None,
    label: str = "",
) -> list[float]:
    """Train ``model`` (its forward returns ``loss`` given the features' label keys) with
    HF ``Trainer``; returns the loss of every step, unfiltered (a NaN stays a NaN).

    ``epochs`` may be fractional: the run takes ``ceil(epochs * steps per epoch)`` steps,
    reshuffling at each epoch. The warmup is ``int(warmup_proportion * steps)`` steps.
    ``on_step`` is called after every step (the run lock's heartbeat; what it raises
    stops the training).
    ``logger``: every ``logger.cfg.every`` steps, what ``Trainer`` logs (``loss``, ``lr``,
    ``grad_norm``, ``epoch``; the loss averaged over those steps), and every
    ``logger.cfg.progress_every`` steps a progress line that starts with ``label``.
    fp16 and bf16 need a GPU (checked before anything runs); on one GPU of several, the
    process trains on the current one alone (``batch_size`` is the whole batch)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if precision != "fp32" and device.type != "cuda":
        raise ValueError(f"precision {precision} needs a GPU; use fp32 on {device.type}")
    n = len(next(iter(features.values())))
    total = max(1, math.ceil(math.ceil(n / batch_size) * epochs))

    class StepLosses(Trainer):
        """``Trainer`` keeping each step's loss on the device (read once at the end)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.losses: list[torch.Tensor] = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses.append(loss.detach())
            if on_step is not None:
                on_step()
            return loss

    class Watch(TrainerCallback):
        """Trainer's logs to ``logger``; a progress line every ``progress_every`` steps."""

        def __init__(self):
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            renamed = {"learning_rate": "lr"}
            logger.log(state.global_step, {renamed.get(k, k): v for k, v in (logs or {}).items()})

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step % logger.cfg.progress_every and step != total:
                return
            rate = step / max(time.perf_counter() - self.started, 1e-9)
            loss = trainer.losses[-1].item() if trainer.losses else math.nan
            logger.progress(
                f"{label}step {step}/{total}  loss {loss:.4g}  {rate:.2f} steps/s  "
                f"eta {timedelta(seconds=round((total - step) / rate))}"
            )

    with tempfile.TemporaryDirectory() as scratch:  # nothing is saved: save_strategy "no"
        args = TrainingArguments(
            output_dir=scratch,
            max_steps=total,
            per_device_train_batch_size=batch_size,
            learning_rate=lr,
            weight_decay=weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-6,
            optim="adamw_torch",
            lr_scheduler_type="linear",
            warmup_steps=int(warmup_proportion * total),
            max_grad_norm=max_grad_norm,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            use_cpu=device.type != "cuda",
            seed=seed,
            save_strategy="no",
            report_to=[],  # the logger reports, to the backends pretraining uses
            logging_strategy="no" if logger is None else "steps",
            logging_steps=1 if logger is None else logger.cfg.every,
            logging_first_step=True,
            logging_nan_inf_filter=False,
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=device.type == "cuda",
        )
        if args.n_gpu > 1:
            # One process on a node with several GPUs: Trainer would split each batch over
            # all of them (DataParallel); this stage trains on one, as its jobs ask for one.
            args._n_gpu = 1
        callbacks = [] if logger is None else [Watch()]
        trainer = StepLosses(
            model=model, args=args, train_dataset=FeatureRows(features), callbacks=callbacks
        )
        trainer.train()
    return torch.stack(trainer.losses).float().cpu().tolist()


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    features: dict[str, torch.Tensor],
    batch_size: int,
    device: torch.device,
    precision: str,
    outputs: tuple[str, ...],
) -> dict[str, np.ndarray]:
    """The named model outputs (e.g. ``logits``) for every feature row, in order."""
    model.eval()
    n = len(next(iter(features.values())))
    collected: dict[str, list[np.ndarray]] = {name: [] for name in outputs}
    for batch in _batches(features, batch_size, np.arange(n)):
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(precision, device):
            result = model(**batch)
        for name in outputs:
            collected[name].append(getattr(result, name).float().cpu().numpy())
    return {name: np.concatenate(parts) for name, parts in collected.items()}
