"""Local steps with an outer step every ``outer_every`` (tau) steps: SlowMo, local SGD, CO2 and
DiLoCo.

Every rank steps its own copy of the model with the inner optimizer (LAMB or AdamW) on its
own gradients; nothing is sent between outer steps. All ranks share an *anchor* x0 (the
parameters the round started from) and an outer momentum m. Per round of tau steps, with
x_i this rank's parameters at the round's end and x̄ their average over ranks:

**SlowMo** (Wang et al., arXiv 1910.00643, Alg. 1), synchronous::

    x̄ = average(x_i)                      one all-reduce of the parameters
    m = beta m + (x0 - x̄) / gamma          gamma: the inner learning rate of the last step
    x0 = x0 - alpha gamma m;  x_i = x0

**local SGD** is SlowMo with beta 0 and alpha 1 (every round ends at x̄).

**DiLoCo** (Douillard et al., arXiv 2311.08105, Alg. 1; OpenDiLoCo's
``train_diloco_torch.py``): inner AdamW, and the outer step is SGD with Nesterov momentum
on the averaged *pseudo-gradient*, as ``torch.optim.SGD(lr=alpha, momentum=beta,
nesterov=True, weight_decay=wd)`` would take it (alpha 0.7, beta 0.9 by default)::

    x̄ = average(x_i)                      one all-reduce of the parameters
    g = (x0 - x̄) + wd x0                   the pseudo-gradient (no division by a learning rate)
    m = beta m + g
    x0 = x0 - alpha (g + beta m)            heavy ball (``nesterov: false``): x0 - alpha m
    x_i = x0

The inner optimizer's state is kept across rounds (``inner_state: keep``, the paper's
choice). With one worker it is a Lookahead-like step on one model's own progress.

**CO2** (Sun et al., arXiv 2401.16265): the average of round t is started in the
background at the end of round t and waited for only at the end of round t+1, so it runs
while round t+1 computes. At the end of round t (x0_t its anchor, x0_{t-1} the previous
one, x̄_{t-1} the average that was in flight)::

    wait for x̄_{t-1}
    delta = x0_{t-1} - x̄_{t-1}                    the stale round's progress
    m = beta m + penalty * delta                   per tensor (below)
    m = clip(m, threshold)                         global L2 norm, or each element
    x0_{t+1} = x0_t - alpha m
    start averaging x_i (round t) in the background;  x_i = x0_{t+1}

Round 0 has no average yet: its anchor does not move (x0_1 = x0_0), and the first outer
update happens at the end of round 1. No division by the learning rate (unlike SlowMo).
The project's definitions where the paper leaves them open. The **staleness-gap penalty**
of tensor l measures how far the anchor moved while the average was in flight,
``gap_l = |x0_t,l - x0_{t-1},l|``, against how far it typically moves in a round, ``ḡ_l``
(a bias-corrected moving average of ``gap_l`` with rate 0.9 over the rounds in which the
anchor moved, the current one included)::

    penalty_l = 1 / (1 + lambda * gap_l / ḡ_l)          (1 when gap_l = 0)

It is 1 when nothing is stale (the synchronous variant, or an anchor that has not moved),
1/(1 + lambda) while the anchor moves by its usual amount, and smaller in a round whose
move is larger than usual. The paper (arXiv 2401.16265) computes a penalty in its
Algorithm 1 from ``x_{t,0}`` but its text, as far as it could be read here, gives no
formula; its public code multiplies by the constant ``1 / co2_gap_penalty`` (1 at its
default, so no penalty). The project's earlier definition, ``1 / (1 + lambda * gap_l /
|delta_l|)``, measured no staleness: with ``beta = 0`` the gap is the previous penalised
update itself, so the penalty settles at the fixed point ``p = 1 / (1 + lambda * alpha *
p)`` (0.618 at lambda = alpha = 1) whatever the staleness, and it turned ``alpha`` into an
effective outer step ``(sqrt(1 + 4 alpha) - 1) / 2``. Clipping acts (CO2's public code
discards its clamp). ``asynchronous: false`` waits for the average at once (delta from the
round just finished, no gap): the synchronous variant.

**Evaluation and export** use the average over ranks of the models after the last inner
step: at a round's end, the average the outer step computed (nothing more is sent);
within a round, one all-reduce of the parameters. The outer update itself is where the
next round starts, not a model anyone trained.

**Nodes as workers** (``comm.hierarchy: node``): the ranks of one node average their
gradients every step in full precision (inside the node, counted as intra-node traffic) and
step identical copies, so each node is one worker of the method, as in CO2's and SlowMo's
experiments (fairseq averages gradients within a node, and the outer step runs between
nodes). The outer average still runs over all ranks: node-mates hold the same parameters,
so it equals the average over nodes.

Checkpoints: the anchors, the outer momentum, the round's average (drained first: waiting
early changes no value), the round count and the last inner learning rate are shared
state; each rank's parameters and inner optimizer state are per-rank state, so a resume
continues the uninterrupted trajectory bit for bit. The position within the round is the
step modulo ``outer_every``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from onebit_bert.distributed.codecs import AsyncCodecAllReduce, Codec, PlainCodec
from onebit_bert.distributed.comm import AsyncAllReduce
from onebit_bert.strategies.base import Strategy, StrategyConfig
from onebit_bert.strategies.flat import AverageModel
from onebit_bert.strategies.flat import FlatParams as _FlatParams
from onebit_bert.strategies.registry import (
    STRATEGIES,
    StrategySpec,
    register_strategy,
    variant_of,
)

log = logging.getLogger(__name__)

PENALTY_EPS = 1e-12
GAP_AVERAGE_RATE = 0.9
"""Rate of the moving average of the anchor's move per round (CO2's penalty)."""
CLIP_EPS = 1e-6
CO2_GAP_PENALTY = 1.0
"""CO2's code default for ``co2_gap_penalty``."""
DILOCO_OUTER_LR = 0.7
DILOCO_OUTER_MOMENTUM = 0.9
"""DiLoCo's outer SGD (arXiv 2311.08105, Table 5; OpenDiLoCo's defaults)."""


@dataclass(frozen=True)
class OuterStep:
    """What makes one local-step strategy's outer step its own (the ``variant`` of its
    registry entry; the module docstring has the rules)."""

    outer_sgd: bool = False
    """DiLoCo's: SGD with (Nesterov) momentum on the pseudo-gradient; else SlowMo's and
    CO2's update."""
    lr: float = 1.0
    """alpha when ``strategy.outer_lr`` is null."""
    momentum: float | None = None
    """beta when ``strategy.outer_momentum`` is null; None: fairseq's rule by world size
    (:func:`default_outer_momentum`)."""
    normalise_by_lr: bool = False
    """Divide the round's progress by the last inner learning rate (SlowMo)."""
    plain_average: bool = False
    """alpha 1 and beta 0 whatever the config: every round ends at the average (local
    SGD); ``strategy.outer_lr`` and ``outer_momentum`` are refused."""
    stale: bool = False
    """CO2: the average may enter one round late (``strategy.asynchronous``, on by
    default), with the staleness-gap penalty and outer-momentum clipping; the others are
    synchronous and refuse ``asynchronous``."""


def staleness_penalty(
    gap: torch.Tensor, average: torch.Tensor, rounds: int, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CO2's staleness-gap penalty per tensor (the module docstring) and the updated moving
    average: ``gap`` is how far each tensor's anchor moved in the in-flight round,
    ``average`` the moving average of earlier rounds' moves (its ``rounds``-th update
    happens here, before it is used)."""
    average = GAP_AVERAGE_RATE * average + (1.0 - GAP_AVERAGE_RATE) * gap
    typical = average / (1.0 - GAP_AVERAGE_RATE ** (rounds + 1))
    ratio = torch.where(gap > 0, gap / typical.clamp_min(PENALTY_EPS), torch.zeros_like(gap))
    return 1.0 / (1.0 + lam * ratio), average


def outer_sgd(anchor, momentum, delta, lr, beta, nesterov, weight_decay) -> None:
    """DiLoCo's outer step, in place on ``anchor`` and ``momentum``: ``torch.optim.SGD``
    (dampening 0) on the pseudo-gradient ``delta``, which it overwrites."""
    if weight_decay:
        delta.add_(anchor, alpha=weight_decay)
    momentum.mul_(beta).add_(delta)
    step = delta.add_(momentum, alpha=beta) if nesterov else momentum
    anchor.sub_(step, alpha=lr)


def outer_codec(comm, policy, in_background: bool) -> Codec:
    """The codec of the outer average (``comm.compression.outer``; the plain fp32 average by
    default). A lossy one averages each rank's progress since the round's anchor (x_i - x0,
    identical x0 on every rank), not the parameters. ``in_background``: on a process group
    of its own, so that the loop's other collectives are not queued behind an average in
    flight (a lossy codec files its counts itself when waited, the plain one in the shared
    stats). Collective when ``in_background``: every rank calls it in the same order."""
    name = policy.codec_name("outer") if policy is not None else "none"
    codec_comm = comm.side_channel(shared_stats=name == "none") if in_background else comm
    if policy is None:
        return PlainCodec(codec_comm)
    return policy.codec("outer", comm=codec_comm)


def default_outer_lr(name: str) -> float:
    """``strategy.outer_lr`` when null: DiLoCo's 0.7, else 1 (SlowMo's and CO2's, and any
    strategy without an outer step)."""
    spec = STRATEGIES.get(name, None)
    return spec.variant.lr if spec is not None and isinstance(spec.variant, OuterStep) else 1.0


def default_outer_momentum(world_size: int) -> float:
    """fairseq's outer momentum by number of workers (SlowMo and CO2 when unset)."""
    if world_size <= 16:
        return 0.0
    if world_size <= 32:
        return 0.2
    if world_size <= 64:
        return 0.5
    return 0.6


def check_local_step_config(name: str, cfg: StrategyConfig, optimizer_name: str) -> None:
    """Value rules of the local-step strategies the registry's field lists cannot say."""
    rule = variant_of(name, OuterStep)
    if rule.stale:
        return
    if cfg.asynchronous:
        raise ValueError(
            f"strategy.name {name} is synchronous; the asynchronous outer step is strategy.name=co2"
        )
    if rule.plain_average and (cfg.outer_momentum or cfg.outer_lr not in (None, 1.0)):
        raise ValueError(
            "strategy.name local_sgd is slowmo with outer_momentum 0 and outer_lr 1; "
            "use strategy.name=slowmo for other values"
        )


class LocalSteps(Strategy):
    """co2, slowmo, local_sgd and diloco (the module docstring has the update rules)."""

    def __init__(self, model, loss_module, optimizer, ctx, cfg: StrategyConfig, name, policy=None):
        super().__init__(model, loss_module, optimizer, ctx)
        rule = variant_of(name, OuterStep)
        self.name = name
        self.every = cfg.outer_every
        self.diloco = rule.outer_sgd
        self.alpha = rule.lr if cfg.outer_lr is None else cfg.outer_lr
        self.beta = cfg.outer_momentum
        if self.beta is None:
            self.beta = rule.momentum
            if self.beta is None:
                self.beta = default_outer_momentum(ctx.world_size)
        self.nesterov = cfg.nesterov
        self.outer_weight_decay = cfg.outer_weight_decay
        if rule.plain_average:
            self.alpha, self.beta = 1.0, 0.0
        self.asynchronous = rule.stale and cfg.asynchronous is not False
        self.normalise_by_lr = rule.normalise_by_lr
        self.penalty = 0.0
        if rule.stale:
            self.penalty = CO2_GAP_PENALTY if cfg.gap_penalty is None else cfg.gap_penalty
        self.clip_threshold = cfg.clip_threshold if rule.stale else None
        self.clip_mode = cfg.clip_mode
        self.reset_inner = cfg.inner_state == "reset"
        self.outer_codec = outer_codec(self.comm, policy, in_background=self.asynchronous)
        # comm.hierarchy node: the node's ranks average gradients every step (a node of one
        # rank has nothing to average)
        groups = policy.groups if policy is not None else None
        self.node_comm = groups.intra if groups and groups.local_world_size > 1 else None
        self.flat = _FlatParams(self.params)
        self.anchor: torch.Tensor | None = None  # x0_t; taken before the first step
        self.previous_anchor: torch.Tensor | None = None  # x0_{t-1} (co2)
        self.momentum = torch.zeros(self.flat.numel, device=self.flat.device)
        self.average = self.flat.empty()  # the last round's average (in flight for co2)
        self.has_average = False
        self.pending: AsyncAllReduce | AsyncCodecAllReduce | None = None
        self.rounds = 0
        self.last_lr: float | None = None
        self.at_round_end = False  # no inner step since the last outer step
        self.inner_steps = 0
        self._eval = AverageModel(model, self.flat)
        # figures for the log
        self.last_wait = 0.0
        self.total_wait = 0.0
        self.waits = 0
        self.last_in_flight = 0.0
        self.last_penalty: torch.Tensor | None = None
        self.last_clip_scale: torch.Tensor | None = None
        # co2's penalty: the moving average of the anchor's move per tensor, and its count
        self.gap_average = torch.zeros(len(self.flat.sizes), device=self.flat.device)
        self.gap_rounds = 0

    # ------------------------------------------------------------------ one step
    def gradient_sync(self):
        return "node" if self.node_comm is not None else "none"

    def after_backward(self) -> None:
        if self.node_comm is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            with self.node_comm.traffic("gradients"):
                self.node_comm.all_reduce_coalesced(grads)

    def step(self) -> None:
        if self.anchor is None:
            self.anchor = self.flat.read()
            self.previous_anchor = self.anchor.clone() if self.asynchronous else None
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.inner_steps += 1
        self.at_round_end = False

    def after_step(self, step: int) -> None:
        if self.pending is not None:
            # a two-phase average's second collective: at the same point of every rank's
            # step, so every rank issues its collectives in one order
            self.pending.advance()
        if step % self.every or self.anchor is None:
            return
        if self.asynchronous:
            self._outer_step_stale()
        else:
            self._outer_step_synchronous()
        self.rounds += 1
        self.at_round_end = True
        if self.reset_inner:
            self.optimizer.state.clear()

    def _outer_step_synchronous(self) -> None:
        self.flat.read(out=self.average)
        lossy = self.outer_codec.lossy
        if lossy:
            self.average.sub_(self.anchor)  # this rank's progress over the round
        with self.comm.traffic("parameters"):
            self.outer_codec.all_reduce([self.average], "outer")
        if lossy:
            self.average.add_(self.anchor)
        self.has_average = True
        delta = self.anchor - self.average
        if self.diloco:
            self._outer_sgd(delta)
            return
        gamma = 1.0
        if self.normalise_by_lr:
            gamma = self.last_lr or 0.0
            if gamma == 0.0:  # no inner step moved anything: delta is zero
                delta.zero_()
            else:
                delta.div_(gamma)
        self._update_momentum(delta, None)
        self.anchor.sub_(self.momentum, alpha=self.alpha * gamma)
        self.flat.write(self.anchor)

    def _outer_sgd(self, delta: torch.Tensor) -> None:
        outer_sgd(self.anchor, self.momentum, delta, self.alpha, self.beta, self.nesterov,
                  self.outer_weight_decay)  # fmt: skip
        self.flat.write(self.anchor)

    def _outer_step_stale(self) -> None:
        self._wait()
        if self.has_average:
            delta = self.previous_anchor - self.average
            gap = self.anchor - self.previous_anchor
            self._update_momentum(delta, gap)
            self.previous_anchor.copy_(self.anchor)
            self.anchor.sub_(self.momentum, alpha=self.alpha)
        else:  # round 0: nothing in flight yet, the anchor stays
            self.previous_anchor.copy_(self.anchor)
        self.flat.read(out=self.average)
        if self.outer_codec.lossy:
            # progress since the round's anchor (previous_anchor now): added back on wait
            self.average.sub_(self.previous_anchor)
        self.pending = self.outer_codec.average_async(
            self.average, "outer", "parameters", self.comm.stats
        )
        self.has_average = True
        self.flat.write(self.anchor)

    def _update_momentum(self, delta: torch.Tensor, gap: torch.Tensor | None) -> None:
        """m = beta m + penalty * delta, then clipped; ``delta`` may be overwritten."""
        if self.penalty and gap is not None:
            moved = self.flat.norms(gap)
            if moved.any():  # round 1's anchor has not moved: no staleness, no typical move
                penalty, self.gap_average = staleness_penalty(
                    moved, self.gap_average, self.gap_rounds, self.penalty
                )
                self.gap_rounds += 1
            else:
                penalty = torch.ones_like(moved)
            self.last_penalty = penalty
            delta.mul_(self.flat.expand(penalty))
        self.momentum.mul_(self.beta).add_(delta)
        if self.clip_threshold is None:
            return
        if self.clip_mode == "value":
            before = self.momentum.norm()
            self.momentum.clamp_(-self.clip_threshold, self.clip_threshold)
            self.last_clip_scale = self.momentum.norm() / (before + CLIP_EPS)
        else:
            scale = (self.clip_threshold / (self.momentum.norm() + CLIP_EPS)).clamp(max=1.0)
            self.momentum.mul_(scale)
            self.last_clip_scale = scale

    def _wait(self) -> None:
        if self.pending is None:
            return
        self.last_wait = self.pending.wait()
        if self.outer_codec.lossy:
            # the round started from previous_anchor, which stays until the next outer step
            self.average.add_(self.previous_anchor)
        self.last_in_flight = self.pending.in_flight_seconds
        self.total_wait += self.last_wait
        self.waits += 1
        self.pending = None

    def drain(self) -> None:
        self._wait()

    # ------------------------------------------------------------------ model and state
    def eval_model(self) -> nn.Module:
        """The average over ranks of the models after the last inner step (collective
        within a round: every rank must call it)."""
        cached = self._eval.current(self.inner_steps)
        if cached is not None:
            return cached
        self.drain()
        if self.at_round_end and self.has_average:
            mean = self.average
        else:
            mean = self.flat.read()
            with self.comm.traffic("parameters"):
                self.comm.all_reduce(mean, op="avg")
        return self._eval.set(mean, self.inner_steps)

    def identity(self) -> dict:
        return {**super().identity(), "outer_every": self.every}

    def state_dict(self) -> tuple[dict, dict]:
        self.drain()
        outer = {
            "rounds": self.rounds,
            "outer_every": self.every,
            "anchor": self.anchor,
            "previous_anchor": self.previous_anchor,
            "momentum": self.momentum,
            "average": self.average if self.has_average else None,
            "at_round_end": self.at_round_end,
            "last_lr": self.last_lr,
            "inner_steps": self.inner_steps,
            "gap_average": self.gap_average,
            "gap_rounds": self.gap_rounds,
        }
        per_rank = {"optimizer": self.optimizer.state_dict(), "params": self.flat.read()}
        if self.outer_codec.state_dict():
            per_rank["outer_codec"] = self.outer_codec.state_dict()
        return {"strategy": self.identity(), "local_steps": outer}, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        outer = shared.get("local_steps")
        if outer is None:
            # Another strategy's checkpoint (a new phase): its optimizer state, if any; the
            # anchor is taken at the first step from the loaded weights.
            if same_run:
                super().load_state_dict(shared, per_rank, same_run)
            elif "optimizer" in shared:
                state = dict(shared["optimizer"])
                state.pop("per_rank", None)
                self.optimizer.load_state_dict(state)
            return
        saved = shared.get("strategy", {})
        if same_run and saved.get("name") != self.name:
            super().load_state_dict(shared, per_rank, same_run)  # the identity error
        if same_run and outer["outer_every"] != self.every:
            raise ValueError(
                f"the checkpoint was written with strategy.outer_every "
                f"{outer['outer_every']} and this run sets {self.every}; resume with the "
                f"same value (the round structure is part of the trajectory)"
            )
        self.drain()
        self.rounds = outer["rounds"]
        self.anchor = outer["anchor"]
        self.previous_anchor = outer["previous_anchor"]
        self.momentum.copy_(outer["momentum"])
        self.has_average = outer["average"] is not None
        if self.has_average:
            self.average.copy_(outer["average"])
        self.at_round_end = outer["at_round_end"]
        self.last_lr = outer["last_lr"]
        self.inner_steps = outer["inner_steps"]
        if "gap_average" in outer:  # (checkpoints from before the penalty measured staleness
            # start it afresh)
            self.gap_average.copy_(outer["gap_average"])
            self.gap_rounds = outer["gap_rounds"]
        self._eval.forget()
        if self.asynchronous and self.anchor is not None and self.previous_anchor is None:
            self.previous_anchor = self.anchor.clone()
        if per_rank is not None:
            self.optimizer.load_state_dict(per_rank["optimizer"])
            self.flat.write(per_rank["params"])
            self.outer_codec.load_state_dict(per_rank.get("outer_codec") or {})
        else:
            log.warning(
                "another world size wrote this checkpoint: every rank starts from the "
                "average model, with fresh inner optimizer state"
            )

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict:
        out = super().metrics()
        out["stage"] = "local"
        out["outer_rounds"] = self.rounds
        if self.waits:
            out["outer_wait_seconds"] = self.last_wait
            out["outer_wait_seconds_mean"] = self.total_wait / self.waits
            out["outer_in_flight_seconds"] = self.last_in_flight
        if self.last_penalty is not None:
            out["gap_penalty_min"] = float(self.last_penalty.min())
            out["gap_penalty_mean"] = float(self.last_penalty.mean())
        if self.last_clip_scale is not None:
            out["outer_clip_scale"] = float(self.last_clip_scale)
        out["outer_momentum_norm"] = float(self.momentum.norm())
        return out


# ---------------------------------------------------------------------- registry entries
OUTER_FIELDS = ("outer_every", "outer_lr", "outer_momentum", "inner_state", "asynchronous")
"""The ``strategy.*`` fields every local-step strategy reads."""
DILOCO_FIELDS = (*OUTER_FIELDS, "nesterov", "outer_weight_decay")


def local_steps_entry(name: str, summary: str, variant: OuterStep, **keys) -> StrategySpec:
    """The registry entry of a local-step strategy: the keys the family shares, then
    ``keys`` (its own ``fields``, or another ``build`` and ``check``)."""
    shared = dict(
        build=lambda args: LocalSteps.build(args, cfg=args.cfg, name=args.name, policy=args.policy),
        family="local_steps",
        optimizers=("lamb", "adamw"),
        optimizer_hint="it steps each rank with its own inner optimizer",
        fields=OUTER_FIELDS,
        traffic=("outer",),
        hierarchy=True,
        check=check_local_step_config,
    )
    return StrategySpec(name, summary=summary, variant=variant, **{**shared, **keys})


DILOCO = OuterStep(outer_sgd=True, lr=DILOCO_OUTER_LR, momentum=DILOCO_OUTER_MOMENTUM)
"""DiLoCo's outer step (also Streaming DiLoCo's)."""

for _spec in (
    local_steps_entry(
        "co2",
        "local steps; the round's average enters one round late (CO2)",
        OuterStep(stale=True),
        fields=(*OUTER_FIELDS, "gap_penalty", "clip_threshold", "clip_mode"),
    ),
    local_steps_entry(
        "slowmo",
        "local steps, a synchronous average and a slow momentum step (SlowMo)",
        OuterStep(normalise_by_lr=True),
    ),
    local_steps_entry(
        "local_sgd",
        "local steps and a synchronous parameter average (slowmo without momentum)",
        OuterStep(normalise_by_lr=True, plain_average=True),
    ),
    local_steps_entry(
        "diloco",
        "local steps, then outer SGD with Nesterov momentum on the pseudo-gradient (DiLoCo)",
        DILOCO,
        fields=DILOCO_FIELDS,
    ),
):
    register_strategy(_spec)
