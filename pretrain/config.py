"""Settings of the pretraining stage (one dataclass per section).

Everything that can be checked without data or a GPU is checked here, so a bad config
fails before any compute; the batch arithmetic (which needs the world size) is checked
by :meth:`PretrainConfig.batch_plan` at start-up, before the model is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from onebit_bert.distributed.policy import CommConfig
from onebit_bert.metrics_log import LoggingConfig
from onebit_bert.optim.build import OptimizerConfig
from onebit_bert.optim.registry import optimizer_spec
from onebit_bert.recipes import check_recipe, identify
from onebit_bert.strategies import StrategyConfig, check_comm_config, resolve_strategy_name

PRESETS = ("bert-tiny", "bert-mini", "bert-small", "bert-base", "bert-large")


@dataclass
class ModelConfig:
    """The network: ``transformers.BertForPreTraining`` (MLM + NSP heads)."""

    preset: Literal["bert-tiny", "bert-mini", "bert-small", "bert-base", "bert-large"] = (
        "bert-large"
    )
    """bert-large: 24 layers, 1024 hidden, 16 heads; bert-base: 12/768/12; bert-small:
    4/512/8; bert-mini: 4/256/4; bert-tiny: 2/128/2."""
    max_position_embeddings: int = 512
    """Positions the model has (512 in both phases; phase 1 only trains the first 128)."""
    vocab_size: int | None = None
    """Rows of the embedding and the MLM head; default the tokenizer's vocabulary. A larger
    value pads them with rows no token uses (NVIDIA pads BERT's 30522 to 30528, a multiple
    of 8 for tensor cores); a smaller one is an error."""
    dropout: float = 0.1
    attention: Literal["sdpa", "eager"] = "sdpa"
    init_from: str | None = None
    """Start from these weights: a pretraining run directory (its latest checkpoint), a
    checkpoint directory, or an HF-format model directory. Phase 2 starts from phase 1."""
    init_optimizer: bool = False
    """With a checkpoint in ``init_from``: also take its optimizer state and step count
    (1-bit LAMB's stage, trust ratios and momenta carry over, as in DeepSpeed's recipe)."""
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    """Compile the BERT body (embeddings, encoder, pooler) with ``torch.compile`` in this
    mode; the MLM and NSP heads stay eager (the MLM head runs on the masked positions,
    whose number changes with every batch). default: fused kernels; reduce-overhead: also
    replays the body's forward and backward as CUDA graphs (one recorded per batch shape:
    with ``data.packing`` the number of rows varies, and each new count records its own);
    max-autotune: also searches matrix-product kernels at the first step (minutes). The
    first step and the first validation pass compile (keep ``collective_timeout_s`` above
    that). Checkpoints and the exported model are the same either way. A compiled run
    does not repeat an eager one step for step: fused kernels round differently and
    compiled dropout draws other masks, so a resume that changes this needs
    ``resume.allow_changes``. off (default): eager."""


@dataclass
class DataConfig:
    """Where the shards are and how batches are drawn and masked."""

    path: str = "data/prepared/seq128"
    """A data_prep output directory for one sequence length (holds manifest.json)."""
    mlm_probability: float = 0.15
    max_predictions_per_seq: int | None = None
    """Cap on masked tokens per sequence; default round(0.15 x seq_length) (20 for 128,
    77 for 512)."""
    mask_prob: float = 0.8
    """Of the chosen tokens: replaced by [MASK] (80 %), a random token (10 %), kept (10 %)."""
    random_prob: float = 0.1
    validation_every: int = 0
    """Run a validation pass every this many steps (0: only at the end)."""
    validation_batches: int = 10
    """Micro-batches (per rank) of the validation split in one pass."""
    verify_shards: bool = True
    """Hash every shard and compare it with the manifest's sha256 before training, so a
    shard changed after data_prep (a flipped byte that keeps its token ids valid included)
    stops the run at start with its name, instead of training on it or failing mid-run.
    The ranks share the work: about 3.2 s per GB on one busy CPU core (BERT-Large's 41 GB
    of phase-1 shards: about 2 s per rank at 64 ranks). false: only the sizes are checked
    at start, and token ids as rows are read."""
    packing: bool = False
    """Pack each micro-batch's sequences end to end into as few rows as fit (MLPerf's BERT
    packing, :mod:`pretrain.packing`): attention stays within each sequence, positions
    start again at 0, and the losses are the same means over the same tokens, so the model
    does no work on padding. The number of rows then varies between micro-batches. false:
    one sequence per row, padded to the sequence length."""
    prefetch: bool = True
    """Build the next training micro-batch on a background thread while this one trains
    (host work only; pinned and copied without blocking on CUDA). false: build each on
    the main thread when it is needed. The batches are the same either way."""

    def max_predictions(self, seq_length: int) -> int:
        """Masked tokens per sequence at most, for sequences of ``seq_length``."""
        return self.max_predictions_per_seq or round(0.15 * seq_length)

    def __post_init__(self):
        if not 0 < self.mlm_probability < 1:
            raise ValueError("data.mlm_probability must be in (0, 1)")
        if not 0 <= self.mask_prob + self.random_prob <= 1:
            raise ValueError("data.mask_prob + data.random_prob must be in [0, 1]")
        if self.validation_every < 0 or self.validation_batches < 1:
            raise ValueError("data.validation_every >= 0 and data.validation_batches >= 1")


@dataclass
class BatchConfig:
    """global_batch_size = micro_batch_size x accumulation steps x world size."""

    global_batch_size: int = 65536
    micro_batch_size: int = 64
    """Sequences per rank per forward pass (bounded by GPU memory)."""

    def __post_init__(self):
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("batch sizes must be >= 1")


@dataclass
class ScheduleConfig:
    """Learning rate over steps (a pure function of the step)."""

    name: Literal["poly", "ee", "le", "constant"] = "poly"
    """poly: linear warmup then (1 - progress)^power decay (NVIDIA's BERT recipe);
    ee: warmup with (step/warmup)^2 then exponential decay decay_rate^(steps/decay_step)
    (DeepSpeed bing_bert's warmup_exp_decay_exp); le: linear warmup then the same
    exponential decay (bing_bert's warmup_linear_decay_exp, its 1-bit Adam and 0/1 Adam
    recipes); constant: warmup then flat."""
    max_steps: int = 7038
    """Optimizer steps in this phase."""
    warmup_proportion: float = 0.2843
    power: float = 0.5
    decay_rate: float = 0.9
    decay_step: int = 250

    def __post_init__(self):
        if self.max_steps < 1:
            raise ValueError("schedule.max_steps must be >= 1")
        if not 0 <= self.warmup_proportion < 1:
            raise ValueError("schedule.warmup_proportion must be in [0, 1)")
        if self.decay_step < 1 or not 0 < self.decay_rate <= 1:
            raise ValueError("schedule.decay_step >= 1 and decay_rate in (0, 1]")


@dataclass
class CheckpointConfig:
    """When to save training checkpoints and how many to keep."""

    every: int = 200
    """Save every this many steps (and at the end, and on SIGUSR1/SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept (the newest; a checkpoint with non-finite weights is never saved)."""
    allow_restart: bool = False
    """When checkpoints exist but none can be loaded (corrupt), start again from step 0
    instead of stopping with an error."""
    preemption_lead_s: float | None = None
    """Seconds between the preemption signal (SLURM's ``--signal=B:USR1@<lead>``) and the
    kill; ``pipeline submit`` sets it from ``slurm.signal_lead``. When set, the run checks
    the rule lead >= 2 x save time + one step against its own measured save time, at start
    (the last launch's) and after every save, and warns (also in ``status.json``) when the
    lead is too short."""

    def __post_init__(self):
        if self.every < 1 or self.keep_last < 1:
            raise ValueError("checkpoint.every and checkpoint.keep_last must be >= 1")
        if self.preemption_lead_s is not None and self.preemption_lead_s <= 0:
            raise ValueError("checkpoint.preemption_lead_s must be > 0 (or null: no check)")


RESUME_MAY_CHANGE = (
    "run_dir",
    "logging",
    "checkpoint",
    "divergence",
    "data.validation_every",
    "data.validation_batches",
    "data.verify_shards",
    "stop_after",
    "backend",
    "collective_timeout_s",
    "resume",
    "strategy.force_compression",
    "recipe",
)
"""Settings a resume may change without ``resume.allow_changes``: they do not alter the
training trajectory (``strategy.force_compression`` acts on one process only, where it keeps
a compressing optimizer compressing, as the run that wrote the checkpoint was)."""


@dataclass
class ResumeConfig:
    """What a resume may change."""

    allow_changes: list[str] = field(default_factory=list)
    """Settings a resume may change although they alter the trajectory (dotted keys, or
    whole sections such as ``schedule``). Any other such change (global batch, lr,
    schedule, model, data, optimizer, strategy, seed, ...) stops the resume with the list of
    differences; an allowed one is recorded in ``status.json`` and the metrics. Logging,
    checkpoint and validation cadence, divergence, ``stop_after`` and ``backend`` may always
    change."""


@dataclass
class DivergenceConfig:
    """When a run whose numbers broke stops instead of training (and exporting) them: NaN
    or inf for some steps in a row, or a finite loss far above its recent level."""

    max_bad_steps: int = 3
    """Stop, with exit code 3, after this many consecutive bad steps: a non-finite loss or
    gradient norm on any rank, or an fp16 overflow skip at the smallest loss scale (1)."""

    loss_spike_factor: float = 10.0
    """Stop at once, with exit code 3 and before the step's checkpoint or the export, when
    a step's loss is more than this many times the median loss of the last
    ``loss_window`` steps: a blow-up whose numbers are all finite (LAMB at lr 1000 takes
    the loss from 11 to 1e11 with every weight finite). 10x is far above the noise of a
    healthy run (early BERT losses fall from 11 to 7; a late spike of 2-3x is
    recoverable); 0 turns the check off."""
    loss_window: int = 50
    """Steps whose median loss is the recent level (a resumed launch starts afresh)."""

    def __post_init__(self):
        if self.max_bad_steps < 1:
            raise ValueError("divergence.max_bad_steps must be >= 1")
        if self.loss_spike_factor < 0 or 0 < self.loss_spike_factor <= 1:
            raise ValueError(
                f"divergence.loss_spike_factor must be > 1 (or 0: off), got "
                f"{self.loss_spike_factor}"
            )
        if self.loss_window < 1:
            raise ValueError("divergence.loss_window must be >= 1")


@dataclass
class PretrainConfig:
    """A pretraining phase."""

    run_dir: str = "runs/pretrain"
    """Checkpoints, metrics.jsonl, the resolved config and the final HF-format model."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 on GPUs that have it (fp16 + loss scaling on older ones), fp32 on CPU."""
    flush_denormal: bool = False
    """Flush subnormal floats to zero in the CPU's arithmetic on every torch thread
    (``torch.set_flush_denormal``, applied by ``python -m pretrain`` at start-up). On a CPU,
    subnormal values inside the forward and backward pass take a slow path; some runs
    produce many of them as they train, and their steps slow down (``python -m
    bench.denormals`` measures it on a run's checkpoint). Flushing them changes only values
    below 1.2e-38 in fp32, but it changes them, so a run with it does not repeat a run
    without it step for step: keep one setting within an experiment. Off by default; CUDA
    kernels are not affected."""
    clip_grad_norm: float = 1.0
    """Clip the gradient norm (0: off). In 1-bit LAMB's compression stage gradients are
    local, so each rank clips its own."""
    seed: int = 42
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    collective_timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before the process group fails
    the job (the NCCL/gloo timeout). It must exceed the longest time one rank can spend
    away from the others: a checkpoint save with its hashing, a validation pass, the
    first step's compilation."""
    stop_after: int | None = None
    """Stop (with a checkpoint) after this many steps of this invocation; for tests and
    time-boxed jobs."""
    recipe: str | None = None
    """The registered recipe this run is (:mod:`onebit_bert.recipes`), checked against the
    optimizer, strategy and comm fields; null: the recipe those fields match, if any. The
    run records it in its saved config and ``status.json``."""

    def __post_init__(self):
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.clip_grad_norm < 0:
            raise ValueError("clip_grad_norm must be >= 0")
        if self.seed < 0:
            raise ValueError("seed must be >= 0")
        check_comm_config(self.comm, resolve_strategy_name(self.strategy, self.optimizer))
        self._check_freeze_step()
        if self.recipe is not None:
            check_recipe(self.recipe, dataclasses.asdict(self))

    def _check_freeze_step(self) -> None:
        """A 1-bit LAMB or 1-bit Adam phase that would never leave its full-precision
        warmup (``freeze_step >= schedule.max_steps``) is refused: it would be recorded as
        a compressing run while compressing nothing. Allowed with ``model.init_optimizer``,
        where the optimizer's step count continues from the earlier phase (the shipped
        phase 2 has freeze_step 6,100 and 1,563 steps after phase 1's 7,038, so it
        compresses from its first step)."""
        opt = self.optimizer
        if not optimizer_spec(opt.name).freezes or opt.freeze_step == "auto":
            return
        if self.model.init_optimizer or opt.freeze_step < self.schedule.max_steps:
            return
        raise ValueError(
            f"optimizer.freeze_step {opt.freeze_step} >= schedule.max_steps "
            f"{self.schedule.max_steps}: this {opt.name} run would never compress (every "
            f"step is in its full-precision warmup); lower optimizer.freeze_step below "
            f"schedule.max_steps (recipes: 15-25 % of the steps), use freeze_step auto, or "
            f"optimizer.name=lamb for an uncompressed run"
        )

    def resolved_recipe(self) -> str | None:
        """``recipe``, or the registered recipe the config's fields match (None: none)."""
        return self.recipe or identify(dataclasses.asdict(self))

    def batch_plan(self, world_size: int) -> int:
        """Gradient accumulation steps; a clear error if the batch does not divide."""
        per_step = self.batch.micro_batch_size * world_size
        if self.batch.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size {self.batch.global_batch_size} is not a multiple of "
                f"micro_batch_size {self.batch.micro_batch_size} x world size {world_size} = "
                f"{per_step}; change batch.global_batch_size or batch.micro_batch_size"
            )
        return self.batch.global_batch_size // per_step
