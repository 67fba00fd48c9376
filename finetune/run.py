"""Fine-tuning runs: every task × grid point × seed, then one results.json.

Each task is a small runner class (GLUE tasks share one, SQuAD has its own) with the same
surface: ``load`` (read and check the data, before any training), ``train_features``,
``build_model`` and ``evaluate``. Finished (task, lr, epochs, seed) runs are stored one file
each, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import shutil
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from finetune.config import RECIPES, FinetuneConfig
from finetune.glue_tasks import get_task
from finetune.metrics import compute_glue, compute_squad
from finetune.outputs import (
    artifact_dir,
    config_path,
    run_path,
    write_results,
    write_task_results,
)
from finetune.trainer import fit, predict, seed_everything
from onebit_bert.config import save_config, to_dict
from onebit_bert.io import atomic_write_json, atomic_write_text
from onebit_bert.metrics_log import MetricsLogger
from onebit_bert.precision import resolve_precision
from onebit_bert.run_lock import RunLock

log = logging.getLogger("finetune")

MAIN_METRIC = {
    "cola": "matthews_correlation",
    "stsb": "pearson",
    "mrpc": "f1",
    "qqp": "f1",
    "squad": "f1",
}


def check_checkpoint(checkpoint: str) -> None:
    """A local checkpoint must carry its tokenizer: fine-tuning must tokenize exactly as
    pretraining did."""
    path = Path(checkpoint)
    if not path.exists():
        if "/" in checkpoint and not checkpoint.startswith((".", "/")):
            return  # a hub name; loading reports its own errors
        raise FileNotFoundError(f"checkpoint {checkpoint} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"checkpoint {path} has no config.json: point at an HF-format "
            f"model directory (a pretraining run's final/)"
        )
    if not any((path / f).is_file() for f in ("tokenizer.json", "vocab.txt")):
        raise FileNotFoundError(
            f"checkpoint {path} has no tokenizer (tokenizer.json or "
            f"vocab.txt): save the tokenizer with the model"
        )
    check_finite_weights(path)


def check_finite_weights(path: Path) -> None:
    """Refuse a model whose weights hold NaN or inf (a diverged pretraining run)."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        return  # another format; from_pretrained reads it
    from safetensors import safe_open

    with safe_open(weights, framework="pt") as f:
        names = list(f.keys())  # noqa: SIM118 (safe_open is not a mapping)
        bad = [k for k in names if not torch.isfinite(f.get_tensor(k)).all()]
    if bad:
        raise ValueError(
            f"checkpoint {path} has non-finite weights in {len(bad)} tensor(s) (e.g. "
            f"{bad[0]}): its pretraining diverged; fine-tune an earlier, finite checkpoint"
        )


def load_model(
    auto_class, checkpoint: str, random_init: bool, model_kwargs: dict | None = None, **config
):
    """``auto_class`` (an ``AutoModel...``) from ``checkpoint``, with ``config`` overriding
    the checkpoint's config fields and ``model_kwargs`` passed to the model's constructor;
    with ``random_init`` the same architecture with freshly initialised weights (seeded by
    the caller), the baseline that shows what pretraining adds."""
    model_kwargs = model_kwargs or {}
    if not random_init:
        return auto_class.from_pretrained(checkpoint, **config, **model_kwargs)
    from transformers import AutoConfig

    return auto_class.from_config(AutoConfig.from_pretrained(checkpoint, **config), **model_kwargs)


def _tensors(encoded: dict, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(np.asarray(encoded[k])) for k in keys}


class GlueRunner:
    """Sentence (pair) classification or regression on one GLUE task."""

    def __init__(self, name: str, cfg: FinetuneConfig):
        self.task = get_task(name)
        self.name = self.task.name
        self.cfg = cfg
        self.recipe = RECIPES[self.name]
        self.main_metric = MAIN_METRIC.get(self.name, "accuracy")

    def _glue_root(self) -> str | None:
        """``<data_root>/<TASK>`` or, for one folder holding every dataset,
        ``<data_root>/glue/<TASK>``."""
        root = self.cfg.data_root
        if root is None or (Path(root) / self.task.folder).is_dir():
            return root
        nested = Path(root) / "glue"
        return str(nested) if (nested / self.task.folder).is_dir() else root

    def load(self) -> None:
        root = self._glue_root()
        try:
            train = self.task.load("train", root)
        except FileNotFoundError:
            if self.cfg.glue_eval_fraction is None or len(self.task.eval_splits) != 1:
                raise
            train = None
        if train is None:  # no train file: split the dev file (glue_eval_fraction)
            (split,) = self.task.eval_splits
            rows = self.task.load(split, root)
            random.Random(0).shuffle(rows)
            cut = round(len(rows) * self.cfg.glue_eval_fraction)
            train, self.evals = rows[cut:], {split: rows[:cut][: self.cfg.max_eval_samples]}
        else:
            self.evals = {
                split: self.task.load(split, root)[: self.cfg.max_eval_samples]
                for split in self.task.eval_splits
            }
        self.train = train[: self.cfg.train_cap(self.name)]

    def _encode(self, tokenizer, examples) -> dict[str, torch.Tensor]:
        pairs = examples[0].text_b is not None if examples else False
        encoded = tokenizer(
            [e.text_a for e in examples],
            [e.text_b for e in examples] if pairs else None,
            truncation=True,
            padding="max_length",
            max_length=self.cfg.max_seq_length or self.recipe.max_seq_length,
        )
        features = _tensors(encoded, ("input_ids", "token_type_ids", "attention_mask"))
        dtype = torch.float32 if self.task.is_regression else torch.long
        features["labels"] = torch.tensor([e.label for e in examples], dtype=dtype)
        return features

    def train_features(self, tokenizer) -> dict[str, torch.Tensor]:
        return self._encode(tokenizer, self.train)

    def build_model(self, checkpoint: str, random_init: bool = False):
        from transformers import AutoModel, AutoModelForSequenceClassification

        if self.cfg.pooling == "mean":
            from finetune.heads import MeanPoolingClassifier

            encoder = load_model(AutoModel, checkpoint, random_init, {"add_pooling_layer": False})
            return MeanPoolingClassifier(encoder, self.task.num_labels)
        return load_model(
            AutoModelForSequenceClassification,
            checkpoint,
            random_init,
            num_labels=self.task.num_labels,
            problem_type="regression" if self.task.is_regression else "single_label_classification",
        )

    def evaluate(
        self, model, tokenizer, device, precision, batch_size, predictions: Path | None = None
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for split, examples in self.evals.items():
            features = self._encode(tokenizer, examples)
            labels = features.pop("labels").numpy()
            logits = predict(model, features, batch_size, device, precision, ("logits",))["logits"]
            preds = logits[:, 0] if self.task.is_regression else logits.argmax(-1)
            if predictions is not None:
                self.write_predictions(predictions / f"{split}.tsv", examples, preds.tolist())
            scores = compute_glue(self.name, preds.tolist(), labels.tolist())
            suffix = "_mismatched" if split.endswith("mismatched") else ""
            metrics.update({f"{k}{suffix}": float(v) for k, v in scores.items()})
        return metrics

    def write_predictions(self, path: Path, examples, preds: list) -> None:
        """GLUE's submission format: ``index<TAB>prediction``, the label as the task's
        files spell it (a number with 3 decimals for a regression task)."""
        names = self.task.file_labels or self.task.labels
        lines = ["index\tprediction"]
        for ex, pred in zip(examples, preds, strict=True):
            index = ex.guid.rsplit("-", 1)[-1]
            lines.append(f"{index}\t{pred:.3f}" if names is None else f"{index}\t{names[pred]}")
        atomic_write_text(path, "\n".join(lines) + "\n")

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), **{s: len(e) for s, e in self.evals.items()}}


class SquadRunner:
    """Extractive question answering on SQuAD v1.1 (windows with a document stride)."""

    name = "squad"
    main_metric = "f1"

    def __init__(self, cfg: FinetuneConfig):
        self.cfg = cfg
        self.recipe = RECIPES["squad"]

    def load(self) -> None:
        from finetune import squad

        cfg = self.cfg
        if cfg.squad_eval_fraction is not None:
            dev = squad.load_squad("validation", cfg.data_root)
            self.train, self.eval = squad.split_by_article(dev, cfg.squad_eval_fraction, seed=0)
        else:
            self.train = squad.load_squad("train", cfg.data_root)
            self.eval = squad.load_squad("validation", cfg.data_root)
        self.train = self.train[: cfg.train_cap("squad")]
        self.eval = self.eval[: cfg.max_eval_samples]

    def _length(self) -> int:
        return self.cfg.max_seq_length or self.recipe.max_seq_length

    def train_features(self, tokenizer) -> dict[str, torch.Tensor]:
        from finetune import squad

        encoded = squad.prepare_train_features(
            self.train, tokenizer, self._length(), self.cfg.doc_stride
        )
        return _tensors(
            encoded,
            ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"),
        )

    def build_model(self, checkpoint: str, random_init: bool = False):
        from transformers import AutoModelForQuestionAnswering

        return load_model(AutoModelForQuestionAnswering, checkpoint, random_init)

    def evaluate(
        self, model, tokenizer, device, precision, batch_size, predictions: Path | None = None
    ) -> dict[str, float]:
        from finetune import squad

        encoded = squad.prepare_eval_features(
            self.eval, tokenizer, self._length(), self.cfg.doc_stride
        )
        features = _tensors(encoded, ("input_ids", "token_type_ids", "attention_mask"))
        out = predict(
            model, features, batch_size, device, precision, ("start_logits", "end_logits")
        )
        answers = squad.postprocess_predictions(
            self.eval,
            encoded,
            out["start_logits"],
            out["end_logits"],
            n_best_size=self.cfg.n_best_size,
            max_answer_length=self.cfg.max_answer_length,
        )
        if predictions is not None:  # {id: answer}, as SQuAD's evaluation script reads
            atomic_write_json(predictions / "validation.json", answers)
        references = [{"id": e.id, "answers": e.answers} for e in self.eval]
        return {k: float(v) for k, v in compute_squad(answers, references).items()}

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "validation": len(self.eval)}


def save_model(model, tokenizer, directory: Path) -> None:
    """The fine-tuned model with its tokenizer, in HF format (a mean-pooling classifier:
    its encoder in HF format and its head in ``classifier.pt``), written to a temporary
    sibling first and renamed: a directory is either complete or absent."""
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(tmp)
    else:
        model.bert.save_pretrained(tmp)
        torch.save(
            {"classifier": model.classifier.state_dict(), "num_labels": model.num_labels},
            tmp / "classifier.pt",
        )
    tokenizer.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def make_runner(task: str, cfg: FinetuneConfig):
    return SquadRunner(cfg) if task == "squad" else GlueRunner(task, cfg)


def run(cfg: FinetuneConfig) -> dict:
    """Fine-tune on every task; returns (and writes) ``<output>/results.json``."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    check_checkpoint(cfg.checkpoint)
    runners = [make_runner(t, cfg) for t in cfg.tasks]
    for runner in runners:  # every dataset read and checked before any training
        runner.load()
    tokenizer = AutoTokenizer.from_pretrained(cfg.checkpoint)
    hf_logging.set_verbosity_error()  # "newly initialized head" is expected here
    hf_logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(cfg.precision, device)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, config_path(out))
    results = {}
    for runner in runners:
        features = None
        batch_size = cfg.batch_size or runner.recipe.batch_size
        for lr, epochs in cfg.grid(runner.name):
            for seed in cfg.seeds:
                path = run_path(out, runner.name, lr, epochs, seed)
                if path.is_file():
                    continue
                # One launch trains a given run at a time (SLURM array tasks train
                # different ones into the same output); a second stops here, named.
                lock = RunLock(artifact_dir(out, runner.name, lr, epochs, seed, "locks"))
                lock.acquire()
                try:
                    if lock.took_over:
                        log.warning("took over the run lock of %s", lock.took_over)
                    if not path.is_file():  # finished by another launch meanwhile
                        if features is None:
                            features = runner.train_features(tokenizer)
                        _train_one(cfg, runner, tokenizer, device, precision, out, lock,
                                   features, lr, epochs, seed, batch_size)  # fmt: skip
                finally:
                    lock.release()
                    _remove_empty(lock.run_dir, lock.run_dir.parent)
        results[runner.name] = summarize(runner, cfg, out)
        write_task_results(out, runner.name, results[runner.name])
    write_results(out, results)
    return results


def _remove_empty(*directories: Path) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:  # not empty (another run's lock), or gone
            return


def _train_one(cfg: FinetuneConfig, runner, tokenizer, device, precision: str, out: Path,
               lock: RunLock, features: dict, lr: float, epochs: float, seed: int,
               batch_size: int) -> None:  # fmt: skip
    """Train and evaluate one (task, lr, epochs, seed) run under its ``lock`` and write its
    record."""
    seed_everything(seed)
    model = runner.build_model(cfg.checkpoint, cfg.init == "random").to(device)
    start = time.perf_counter()
    where = partial(artifact_dir, out, runner.name, lr, epochs, seed)
    logger = run_logger(cfg, out, runner.name, lr, epochs, seed)
    try:
        losses = fit(
            model,
            features,
            lr=lr,
            epochs=epochs,
            batch_size=batch_size,
            seed=seed,
            device=device,
            precision=precision,
            weight_decay=cfg.weight_decay,
            warmup_proportion=cfg.warmup_proportion,
            max_grad_norm=cfg.max_grad_norm,
            on_step=lock.heartbeat,  # raises, and stops the training, if taken over
            logger=logger,
            label=f"{runner.name} lr={lr:g} epochs={epochs:g} seed={seed}: ",
        )
        metrics = runner.evaluate(
            model,
            tokenizer,
            device,
            precision,
            batch_size,
            predictions=where("predictions") if cfg.predictions else None,
        )
        logger.log(len(losses), {f"eval_{k}": v for k, v in metrics.items()})
    finally:
        logger.close()
    if cfg.save_model:
        save_model(model, tokenizer, where("models"))
    lock.heartbeat()  # raises if another launch took the run over meanwhile
    atomic_write_json(
        run_path(out, runner.name, lr, epochs, seed),
        {
            "lr": lr,
            "epochs": epochs,
            "seed": seed,
            "metrics": metrics,
            "train_seconds": time.perf_counter() - start,
            "final_loss": losses[-1],
            # CPU kernels sum in an order set by the thread count: a run
            # repeats bit for bit only with the same device and threads.
            "device": str(device),
            "threads": torch.get_num_threads(),
        },
    )
    log.info("%s lr=%g epochs=%g seed=%d: %s", runner.name, lr, epochs, seed, metrics)


def run_logger(
    cfg: FinetuneConfig, out: Path, task: str, lr: float, epochs: float, seed: int
) -> MetricsLogger:
    """The metrics logger of one (task, lr, epochs, seed) run: its own folder
    (``<task>/logs/lr<lr>_ep<epochs>_seed<seed>``) and wandb run, in the group of
    ``cfg.logging.experiment`` (the ``logging`` field of :class:`FinetuneConfig`)."""
    base = cfg.logging.run_name or out.resolve().name
    logging_cfg = dataclasses.replace(
        cfg.logging,
        run_name=f"{base}-{task}-lr{lr:g}-ep{epochs:g}-seed{seed}",
        job_type=cfg.logging.job_type or "finetune",
    )
    config = {**to_dict(cfg), "task": task, "lr": lr, "epochs": epochs, "seed": seed}
    directory = artifact_dir(out, task, lr, epochs, seed, "logs")
    return MetricsLogger(directory, True, logging_cfg, config=config)


def summarize(runner, cfg: FinetuneConfig, out: Path) -> dict:
    """Mean and standard deviation over seeds per grid point; the best point's metrics
    (by the task's main metric) are reported under their usual names."""
    grid = []
    for lr, epochs in cfg.grid(runner.name):
        runs = [
            json.loads(run_path(out, runner.name, lr, epochs, s).read_text()) for s in cfg.seeds
        ]
        names = sorted(runs[0]["metrics"])
        mean = {k: statistics.fmean(r["metrics"][k] for r in runs) for k in names}
        std = {
            k: statistics.stdev([r["metrics"][k] for r in runs]) if len(runs) > 1 else 0.0
            for k in names
        }
        grid.append(
            {
                "lr": lr,
                "epochs": epochs,
                "mean": mean,
                "std": std,
                "per_seed": {r["seed"]: r["metrics"] for r in runs},
            }
        )
    main = runner.main_metric
    best = max(grid, key=lambda g: -math.inf if math.isnan(g["mean"][main]) else g["mean"][main])
    return {
        **best["mean"],
        "std": best["std"],
        "main_metric": main,
        "lr": best["lr"],
        "epochs": best["epochs"],
        "seeds": list(cfg.seeds),
        "per_seed": best["per_seed"],
        "grid": grid,
        "sizes": runner.sizes(),
        "checkpoint": cfg.checkpoint,
    }
