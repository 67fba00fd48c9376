"""What the training loop asks of a sync strategy.

One optimizer step of the loop, and the hook each part calls::

    strategy.gradient_sync()           what happens to this step's gradients (asked first)
    for each micro-batch:   with strategy.backward_context(last): forward, backward
    strategy.after_backward()          gradient sync (all-reduce, DDP's, or none)
    (loss-scale check)
    strategy.clip_gradients(max_norm)  where clip_grad_norm > 0: the norm, logged
    strategy.step()                    the optimizer step (may communicate)
    strategy.after_step(step)          outer step / neighbour exchange (may start async work)
    strategy.drain()                   before validation, checkpoints, export and exit

The loop runs forward passes through ``strategy.forward_module``, evaluates and exports
``strategy.eval_model()``, and checkpoints ``strategy.state_dict()`` (a part every rank
shares and a per-rank part). Everything a strategy sends goes through the communicator
under a kind of traffic, so the loop can report bytes and seconds per kind.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from onebit_bert.checkpoint import WRITTEN_WORLD_SIZE
from onebit_bert.distributed.env import DistContext

GradientSync = Literal["allreduce", "node", "optimizer", "none"]
"""What happens to a step's gradients before the optimizer step
(:meth:`Strategy.gradient_sync`)."""


@dataclass
class StrategyConfig:
    """How data-parallel ranks synchronise; the optimizer section picks the optimizer."""

    name: str = "auto"
    """data_parallel: average gradients every step, then step the optimizer (LAMB, AdamW);
    onebit_lamb, onebit_adam: 1-bit LAMB, 1-bit Adam (averaged gradients in the warmup, then the
    optimizer's own compressed momentum all-reduce); zero_one_adam: 0/1 Adam (averaged gradients
    on its variance-update steps only, 1-bit gradients on the others, then local steps with a
    1-bit synchronisation); auto: the strategy of the same name for those three optimizers,
    otherwise data_parallel. Local steps (the optimizer, LAMB or AdamW, steps each rank alone;
    parameters are averaged every ``outer_every`` steps): slowmo: a synchronous average and a
    slow momentum step; local_sgd: slowmo with outer_momentum 0 and outer_lr 1 (the average
    itself); co2: the average of round t runs in the background during round t+1 and enters one
    round late, with a staleness-gap penalty and outer-momentum clipping; diloco: a
    synchronous average and an outer SGD step with Nesterov momentum on the pseudo-gradient
    (DiLoCo, inner AdamW); streaming_diloco: DiLoCo synchronised one parameter fragment at
    a time, each average overlapped with the next inner steps. Decentralised
    (optimizer.name sgd; no global average, each rank exchanges its parameters with its
    neighbours in ``topology`` every step): decentlam: momentum on the gossip-induced gradient
    (DecentLaM); dmsgd: each rank's own momentum step, then the neighbour average (DmSGD,
    adapt-then-combine). Further strategies join through the registry
    (:mod:`onebit_bert.strategies.registry`), which checks the name."""
    grad_sync: Literal["auto", "ddp", "allreduce"] = "auto"
    """How gradients are averaged while they are: ``ddp`` overlaps bucketed all-reduces
    with the backward pass (DistributedDataParallel, ``no_sync`` during accumulation);
    ``allreduce`` runs one bucketed all-reduce after the last micro-batch (every second of
    it measurable); ``auto``: ddp on GPUs, allreduce on CPUs."""
    force_compression: bool = False
    """1-bit LAMB on one process runs as exact LAMB, and 1-bit Adam and 0/1 Adam skip
    their compression there (there is nothing to send, and compression would only add
    error, as in DeepSpeed); true compresses anyway (tests)."""
    outer_every: int = 12
    """The local-step strategies: local steps per round (tau); one parameter average per
    round (SlowMo's paper: 12 for local SGD, 48 over SGP)."""
    outer_lr: float | None = None
    """co2, slowmo, diloco, streaming_diloco: outer learning rate alpha; null: 1 for co2 and
    slowmo (SlowMo's paper: 1, "consistently best"), 0.7 for the DiLoCo pair (DiLoCo's paper
    and OpenDiLoCo)."""
    outer_momentum: float | None = None
    """co2, slowmo, diloco, streaming_diloco: outer momentum beta; null: 0.9 for the DiLoCo
    pair, and for co2 and
    slowmo by world size as fairseq sets it (0 up to 16 ranks, 0.2 up to 32, 0.5 up to 64,
    0.6 beyond)."""
    nesterov: bool = True
    """diloco, streaming_diloco: Nesterov momentum in the outer SGD step (the paper's
    choice); false: heavy ball."""
    outer_weight_decay: float = 0.0
    """diloco, streaming_diloco: weight decay of the outer SGD step (added to the pseudo-gradient as
    torch.optim.SGD does); 0: none, as in the paper."""
    fragments: int = 4
    """streaming_diloco: parameter fragments F, synchronised H/F steps apart (outer_every
    must be a multiple); contiguous runs of whole tensors balanced by size."""
    fragment_sync_delay: int = 1
    """streaming_diloco: inner steps a fragment's average travels while training goes on
    before it is applied (below outer_every / fragments; 0: applied at once)."""
    fragment_mix: float = 0.5
    """streaming_diloco: mixing factor alpha of the merge, local = alpha local + (1 - alpha)
    outer (Streaming DiLoCo's; 0 takes the outer parameters, as DiLoCo)."""
    gap_penalty: float | None = None
    """co2: staleness-gap penalty lambda; per tensor the stale update is scaled by
    1 / (1 + lambda * gap / typical gap), gap = how far the anchor moved while the average
    was in flight, typical gap = its moving average over rounds (1 when nothing is stale,
    1 / (1 + lambda) at the usual move); 0 disables it; null: 1.0 for co2."""
    clip_threshold: float | None = None
    """co2: clip the outer momentum to this (global L2 norm, or each element with
    clip_mode value); null: no clipping."""
    clip_mode: Literal["norm", "value"] = "norm"
    """co2: norm scales the whole outer momentum down to clip_threshold; value clamps each
    element to [-clip_threshold, clip_threshold]."""
    inner_state: Literal["keep", "reset"] = "keep"
    """The local-step strategies: the inner optimizer's state at an outer step: kept
    (SlowMo's choice for Adam) or reset to zero (its choice for Nesterov SGD)."""
    asynchronous: bool | None = None
    """co2: the round's average runs in the background and enters one round late (true,
    the default); false waits for it at once (the synchronous variant). slowmo and
    local_sgd are synchronous."""
    topology: Literal["ring", "exponential", "one_peer_exponential", "full"] | None = None
    """decentlam, dmsgd: the communication graph (weights as BlueFog's): ring (left and
    right neighbour, 1/3 each); exponential (static: neighbours i - 2^j, j < ceil(log2 n),
    uniform weights); one_peer_exponential (one peer per step, i - 2^(k mod log2 n), 1/2
    each; a power-of-2 number of ranks); full (the exact average, for tests). null: ring
    for decentlam (its momentum diverges on the directed exponential graphs at beta 0.9,
    which is refused when the strategy is built), exponential for dmsgd."""
    layerwise: Literal["none", "lamb"] = "none"
    """decentlam, dmsgd: lamb scales each tensor's update by a LAMB trust ratio
    |x| / |update| clipped to [optimizer.min_coeff, optimizer.max_coeff] (the project's
    extension for large batches, not part of either paper); none: plain momentum SGD."""
    consensus_every: int = 100
    """decentlam, dmsgd: measure the consensus distance (mean over ranks of
    |x_i - mean x| / |mean x|) every this many steps, with one all-reduce of the
    parameters; the log carries the last value; 0: never."""

    def __post_init__(self):
        if self.consensus_every < 0:
            raise ValueError(
                f"strategy.consensus_every must be >= 0 (0: never), got {self.consensus_every}"
            )
        if self.outer_every < 1:
            raise ValueError(f"strategy.outer_every must be >= 1, got {self.outer_every}")
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ValueError(f"strategy.outer_lr must be > 0, got {self.outer_lr}")
        if self.outer_weight_decay < 0:
            raise ValueError(
                f"strategy.outer_weight_decay must be >= 0, got {self.outer_weight_decay}"
            )
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"strategy.outer_momentum must be in [0, 1), got {self.outer_momentum}"
            )
        if self.gap_penalty is not None and self.gap_penalty < 0:
            raise ValueError(f"strategy.gap_penalty must be >= 0, got {self.gap_penalty}")
        if self.clip_threshold is not None and not self.clip_threshold > 0:
            raise ValueError(
                f"strategy.clip_threshold must be > 0 (null: no clipping), "
                f"got {self.clip_threshold}"
            )


class Strategy:
    """Base sync strategy: no communication at all (the hooks a subclass overrides).

    ``forward_module`` is what the loop's forward and backward passes run through (the
    loss module, or its DDP wrapper); ``model`` is the bare network the optimizer steps;
    :meth:`eval_model` is the network to validate and export (``model``, or an average
    of the ranks' models where they differ); ``optimizer`` is the optimizer it steps.
    """

    name = "none"

    def __init__(self, model: nn.Module, module: nn.Module, optimizer, ctx: DistContext):
        """Subclasses take these four first, then their own ``options`` (:meth:`build`)."""
        self.model = model
        self.forward_module = module
        self.optimizer = optimizer
        self.ctx = ctx
        self.comm = ctx.comm
        self.params = [p for p in model.parameters() if p.requires_grad]
        """The trained parameters, in model order."""

    @classmethod
    def build(cls, args, **options) -> Strategy:
        """This strategy over what every registry builder gets (``args``, a
        :class:`~onebit_bert.strategies.registry.BuildArgs`), with the subclass's own
        ``options``."""
        return cls(args.model, args.loss_module, args.optimizer, args.ctx, **options)

    # ------------------------------------------------------------------ one step
    def gradient_sync(self) -> GradientSync:
        """What happens to the coming step's gradients before the optimizer step; asked
        before its first forward pass, and the same answer until that step is taken:

        - ``allreduce``: averaged over ranks in full precision (by :meth:`after_backward`,
          or by DDP's hooks during the last micro-batch's backward);
        - ``node``: averaged over the ranks of this node in full precision (by
          :meth:`after_backward`): the node is one worker of a local-step strategy;
        - ``optimizer``: left local; the optimizer's step communicates what it needs
          (compressed momentum or gradients), or nothing on a local step;
        - ``none``: left local; the strategy communicates something else, or nothing.

        The base strategy sends nothing: ``none``."""
        return "none"

    def backward_context(self, last_micro_batch: bool):
        """Around one micro-batch's forward and backward."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """After the last micro-batch's backward: make gradients ready for the step."""

    def clip_gradients(self, max_norm: float) -> float:
        """After :meth:`after_backward`, before :meth:`step`: clip the step's gradients to a
        total norm of ``max_norm``; their norm before clipping (not finite when they are
        not)."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self) -> None:
        """The optimizer step."""
        self.optimizer.step()

    def after_step(self, step: int) -> None:
        """After the optimizer step ``step`` (1-based) and the schedule's update."""

    def drain(self) -> None:
        """Wait for any collective still in flight."""

    # ------------------------------------------------------------------ model and state
    def eval_model(self) -> nn.Module:
        """The model to validate and export."""
        return self.model

    def shared_model_state(self) -> dict:
        """The weights a checkpoint keeps as *the* model (what ``init_from`` and
        fine-tuning start from): the evaluation model's (collective where that is)."""
        return self.eval_model().state_dict()

    def identity(self) -> dict:
        """What wrote a checkpoint: this strategy's name and its optimizer's class."""
        return {"name": self.name, "optimizer": type(self.optimizer).__name__}

    def state_dict(self) -> tuple[dict, dict]:
        """(state every rank holds alike, this rank's own state) for a checkpoint."""
        state = self.optimizer.state_dict()
        per_rank = state.pop("per_rank", None)
        return {"optimizer": state, "strategy": self.identity()}, {"optimizer": per_rank}

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        """Restore from :meth:`state_dict`'s two parts (``per_rank`` None: another world
        size wrote the checkpoint; per-rank state starts fresh). ``same_run``: a resume,
        which must use the strategy and optimizer that wrote the checkpoint (a new phase
        that starts from another run's state passes False)."""
        saved = shared.get("strategy")
        written = shared.get(WRITTEN_WORLD_SIZE)
        if (
            same_run
            and saved is not None
            and saved != self.identity()
            and written not in (None, self.ctx.world_size)
        ):
            one = (
                "; on one process a compressing optimizer runs uncompressed (1-bit LAMB as "
                "exact LAMB), so resume on more processes or set "
                "strategy.force_compression=true"
                if self.ctx.world_size == 1
                else ""
            )
            raise ValueError(
                f"the checkpoint was written on {written} processes by strategy "
                f"{saved['name']} with optimizer {saved['optimizer']}; on "
                f"{self.ctx.world_size} process(es) the same config builds strategy "
                f"{self.name} with {type(self.optimizer).__name__}{one}"
            )
        if same_run and saved is not None and saved != self.identity():
            raise ValueError(
                f"the checkpoint was written by strategy {saved['name']} with optimizer "
                f"{saved['optimizer']}, and this run uses strategy {self.name} with "
                f"{type(self.optimizer).__name__}; resume with the same optimizer.name and "
                f"strategy.name, or start a new phase from it with model.init_from"
            )
        state = dict(shared["optimizer"])
        state["per_rank"] = (per_rank or {}).get("optimizer")
        self.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict:
        """Per-step figures of the last step: stage (of the step just taken, not the
        next one), per-layer trust ratios and factors
        (min/mean/max), the relative compression error, where the optimizer keeps them
        (the attributes of :class:`~onebit_bert.optim.surface.ReportingOptimizer`, each
        optional)."""
        opt = self.optimizer
        out = {"stage": getattr(opt, "stage", "full")}
        for prefix, attr in (("trust_ratio", "last_trust_ratios"), ("factor", "last_factors")):
            values = getattr(opt, attr, None)
            if values is not None and len(values):
                out[f"{prefix}_min"] = float(values.min())
                out[f"{prefix}_mean"] = float(values.mean())
                out[f"{prefix}_max"] = float(values.max())
        error = getattr(opt, "last_compression_error", None)
        if error is not None:
            out["compression_error"] = float(error)
        return out
