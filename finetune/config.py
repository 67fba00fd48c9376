"""Settings of the fine-tuning stage, with the usual recipe per task as the defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from onebit_bert.metrics_log import LoggingConfig

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
ALL_TASKS = (*GLUE_TASKS, "squad")


@dataclass(frozen=True)
class Recipe:
    """Per-task defaults (BERT paper / HF examples): peak lr, epochs, batch, length."""

    lr: float
    epochs: float
    batch_size: int
    max_seq_length: int


# Small GLUE sets get the same 3 epochs as the large ones; SQuAD follows BERT's 2 epochs of
# 384-token windows with a 128-token stride.
RECIPES = {
    **{name: Recipe(2e-5, 3, 32, 128) for name in GLUE_TASKS},
    "squad": Recipe(3e-5, 2, 32, 384),
}


@dataclass
class FinetuneConfig:
    """Fine-tune one pretrained checkpoint on several tasks, several seeds each."""

    checkpoint: str
    """An HF-format model directory with its tokenizer (a pretraining run's ``final/``),
    or a hub model name when online."""
    init: Literal["pretrained", "random"] = "pretrained"
    """pretrained: start from the checkpoint's weights; random: the checkpoint's architecture
    and tokenizer with freshly initialised weights (seeded per fine-tuning seed), the
    baseline that shows how much the pretraining adds on each task."""
    pooling: Literal["cls", "mean"] = "cls"
    """GLUE tasks: cls, HF's head on the pooled [CLS] state (BertForSequenceClassification);
    mean, a linear head on the mean of the last layer's token states
    (:mod:`finetune.heads`), for checkpoints pretrained without NSP, whose pooler and
    [CLS] state were never trained. SQuAD's head reads every token's state either way."""
    tasks: list[str] = field(default_factory=lambda: ["sst2", "mrpc"])
    """Any of cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli (GLUE) and squad (v1.1)."""
    data_root: str | None = None
    """Local data: ``<data_root>/<GLUE TASK>/{train,dev}.tsv`` (GLUE's layout; also found
    under ``<data_root>/glue/``) and ``<data_root>/squad/{train,dev}-v1.1.json``; unset: the
    hub (nyu-mll/glue, rajpurkar/squad)."""
    output: str = "runs/finetune"
    """``results.json`` plus one directory per task."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    learning_rates: list[float] | None = None
    """A grid over peak learning rates (default: the task's recipe)."""
    epochs: list[float] | None = None
    """A grid over epochs (default: the task's recipe)."""
    batch_size: int | None = None
    max_seq_length: int | None = None
    doc_stride: int = 128
    """SQuAD: overlap between windows of a long context."""
    warmup_proportion: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    max_train_samples: int | None = None
    """Use only the first N training examples (quick runs, tests)."""
    max_train_samples_per_task: dict[str, int] = field(default_factory=dict)
    """Per-task caps that replace ``max_train_samples`` for the named tasks, e.g.
    ``{squad: 600}`` (one SQuAD question makes several windows)."""
    max_eval_samples: int | None = None
    squad_eval_fraction: float | None = None
    """LOCAL RUNS ONLY, where SQuAD's train file is missing: split the dev file by article,
    this share of articles for evaluation and the rest for training. The scores are then not
    comparable with published SQuAD dev results."""
    glue_eval_fraction: float | None = None
    """LOCAL RUNS ONLY, for a GLUE task whose train file is missing (QNLI in the shared data
    folder): split its dev file, this share of the rows (a seeded shuffle) for evaluation
    and the rest for training. The scores are then not comparable with published GLUE dev
    results."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    save_model: bool = False
    """Save every fine-tuned model with its tokenizer (HF format; a mean-pooling model as
    its encoder in HF format plus ``classifier.pt``) under
    ``<output>/<task>/models/lr<lr>_ep<epochs>_seed<seed>/``."""
    predictions: bool = False
    """Write every evaluation split's predictions under
    ``<output>/<task>/predictions/lr<lr>_ep<epochs>_seed<seed>/``: GLUE as ``<split>.tsv``
    in the GLUE submission format (``index``, ``prediction``: the label as GLUE's files
    spell it, a number for STS-B), SQuAD as ``validation.json`` (question id -> answer
    text, the format of SQuAD's evaluation script)."""
    n_best_size: int = 20
    max_answer_length: int = 30
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Per-step metrics and progress lines of every (task, lr, epochs, seed) run, as
    pretraining logs them: ``metrics.jsonl`` and, with ``logging.tensorboard``, TensorBoard
    under ``<output>/<task>/logs/lr<lr>_ep<epochs>_seed<seed>/``, and one wandb run each
    (offline unless WANDB_API_KEY or WANDB_MODE is set), in group ``logging.experiment``
    (the pipeline sets its experiment's name, which groups it with its pretraining runs),
    named ``<logging.run_name or the output folder's name>-<task>-lr<lr>-ep<epochs>-seed<seed>``,
    job type ``logging.job_type`` (default ``finetune``). ``logging.every`` and
    ``logging.progress_every`` count optimizer steps; ``logging.net_interface`` is unused
    here."""

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("tasks is empty")
        self.tasks = [t.lower().replace("-", "") for t in self.tasks]
        unknown = [t for t in self.tasks if t not in ALL_TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(ALL_TASKS)}")
        if not self.seeds:
            raise ValueError("seeds is empty")
        for name in ("squad_eval_fraction", "glue_eval_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        self.max_train_samples_per_task = {
            k.lower().replace("-", ""): v for k, v in self.max_train_samples_per_task.items()
        }
        unknown = [t for t in self.max_train_samples_per_task if t not in ALL_TASKS]
        if unknown:
            raise ValueError(
                f"max_train_samples_per_task names unknown task(s) {unknown}; "
                f"known: {', '.join(ALL_TASKS)}"
            )
        if any(not isinstance(v, int) or v < 1 for v in self.max_train_samples_per_task.values()):
            raise ValueError("max_train_samples_per_task values must be positive integers")
        for name in ("learning_rates", "epochs"):
            values = getattr(self, name)
            if values is not None and (not values or any(v <= 0 for v in values)):
                raise ValueError(f"{name} must be a non-empty list of positive numbers")

    def train_cap(self, task: str) -> int | None:
        """How many training examples of ``task`` to use (None: all)."""
        return self.max_train_samples_per_task.get(task, self.max_train_samples)

    def grid(self, task: str) -> list[tuple[float, float]]:
        recipe = RECIPES[task]
        return [
            (lr, ep)
            for lr in (self.learning_rates or [recipe.lr])
            for ep in (self.epochs or [recipe.epochs])
        ]
