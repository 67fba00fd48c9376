"""Decentralised momentum SGD: DecentLaM and DmSGD (Yuan et al., ICCV'21, arXiv 2104.11981).

No rank ever sees the global average during training: every step each rank sends its
parameter vector (one flat fp32 buffer) to its out-neighbours in a communication graph and
averages what it receives with the weights of the mixing matrix W
(:mod:`onebit_bert.distributed.topology`: ring, static or one-peer exponential, full).
Each rank i keeps its own parameters x_i and momentum m_i (zero at the start; the initial
parameters are identical). With gamma the step's learning rate, beta the momentum
(``optimizer.betas[0]``), g_i this rank's gradient and wd the weight decay of the
tensor's parameter group (none on biases and LayerNorm, as BERT)::

    DmSGD (adapt-then-combine; BlueFog's DistributedAdaptThenCombineOptimizer):
        m_i = beta m_i + g_i
        x_i = sum_j w_ij (x_j - gamma (m_j + wd x_j))           one neighbour exchange

    DecentLaM (momentum on the gradient that decentralised SGD induces):
        y_i = x_i - gamma g_i;  y~_i = sum_j w_ij y_j            one neighbour exchange
        g~_i = (x_i - y~_i) / gamma
        m_i = beta m_i + g~_i
        x_i = x_i - gamma (m_i + wd x_i)  =  y~_i - gamma beta m_i_old - gamma wd x_i

DecentLaM's parameters are computed in the second form, which does not go through the
division by gamma (at a tiny learning rate, (x_i - y~_i) / gamma times gamma would carry
the division's amplified rounding into x; only the momentum holds it). With W the exact
average both methods are parallel momentum SGD; with beta 0 both are decentralised SGD;
for any doubly stochastic W the ranks' average follows momentum SGD on the averaged
gradient (tests/core/strategies/test_decentralized.py checks all three).

The project's decisions where the sources are silent:

- **Weight decay** is decoupled, as in LAMB and AdamW: it does not enter the momentum.
- **A learning rate of zero** (the first step of a linear warm-up) leaves g~ undefined.
  The exchange then uses the peak learning rate instead (y_i = x_i - lr_peak g_i, g~_i =
  (x_i - y~_i) / lr_peak) and the parameters do not move. When the ranks agree (they do
  at step 0: identical initial weights) g~_i = sum_j w_ij g_j, the limit of DecentLaM's
  g~ as gamma goes to 0.
- **``layerwise: lamb``** multiplies each tensor's update direction u (m_i + wd x_i) by
  a LAMB trust ratio clamp(|x| / |u|, min_coeff, max_coeff) (1 where a norm is 0). This
  is the project's extension for large batches, not part of either paper; in DmSGD it
  scales each rank's own step before the mix.
- The learning-rate schedule rescales DecentLaM's momentum implicitly (m holds a consensus
  residual divided by gamma); nothing corrects for it, as in the reference code.

**Evaluation and export** use the average of the ranks' models: one all-reduce of the
parameters (traffic kind ``parameters``), cached until the next step, so validation and a
checkpoint at the same step share it. Every ``consensus_every`` steps the same average
gives the consensus distance, the mean over ranks of |x_i - x̄| / |x̄|, logged until the
next measurement. Checkpoints keep the average model as ``model``, the step count k (the
one-peer graph's clock), the topology and the world size as shared state, and each rank's
parameters and momentum per rank; a resume on another number of ranks is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from onebit_bert.distributed.topology import (
    Mixing,
    check_decentlam,
    check_topology,
    mixing_at,
)
from onebit_bert.optim import defaults
from onebit_bert.optim.lamb import trust_ratios
from onebit_bert.strategies.base import Strategy, StrategyConfig
from onebit_bert.strategies.flat import AverageModel, FlatParams
from onebit_bert.strategies.registry import (
    StrategySpec,
    family,
    register_strategy,
    variant_of,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gossip:
    """What makes one decentralised strategy its own (the ``variant`` of its registry
    entry; the module docstring has the update rules)."""

    topology: str
    """The graph when ``strategy.topology`` is null (valid on any number of ranks)."""
    decentlam: bool
    """DecentLaM's update (momentum on the gossip-induced gradient; its momentum must not
    diverge on the graph, :func:`~onebit_bert.distributed.topology.check_decentlam`);
    else DmSGD's (adapt, then combine)."""


class Decentralized(Strategy):
    """decentlam and dmsgd (the module docstring has the update rules). ``optimizer``
    supplies the learning rate, ``momentum`` and per-group ``weight_decay`` (a
    :class:`~onebit_bert.optim.sgd.MomentumSGD`); this strategy applies the update."""

    def __init__(
        self,
        model,
        loss_module,
        optimizer,
        ctx,
        cfg: StrategyConfig,
        name: str,
        trust_bounds: tuple[float, float] = (defaults.MIN_COEFF, defaults.MAX_COEFF),
        neighbour_codec: str = "none",
    ):
        super().__init__(model, loss_module, optimizer, ctx)
        rule = variant_of(name, Gossip)
        self.name = name
        self.decentlam = rule.decentlam
        self.topology = cfg.topology or rule.topology
        check_topology(self.topology, ctx.world_size)
        if self.decentlam:
            for beta in sorted({float(g.get("momentum", 0.0)) for g in optimizer.param_groups}):
                check_decentlam(self.topology, ctx.world_size, beta)
        self.layerwise = cfg.layerwise == "lamb"
        self.min_coeff, self.max_coeff = trust_bounds
        self.consensus_every = cfg.consensus_every
        self.flat = FlatParams(self.params)
        self.decay_groups = self._decay_groups()
        self.momentum = torch.zeros(self.flat.numel, device=self.flat.device)
        self.steps = 0
        """Steps taken: the time index k of a time-varying graph."""
        self._x, self._y, self._mixed, self._recv = (self.flat.empty() for _ in range(4))
        # comm.compression.neighbour: what the neighbours receive is rounded to 16 bits;
        # each rank's own term stays exact
        self.wire_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
            neighbour_codec
        ]
        if self.wire_dtype is not None:
            self._send_half = torch.empty_like(self._x, dtype=self.wire_dtype)
            self._recv_half = torch.empty_like(self._x, dtype=self.wire_dtype)
        self._mean_key: int | None = None  # self._recv holds the average of this step
        self._eval = AverageModel(model, self.flat)
        self.last_trust_ratios: torch.Tensor | None = None
        self.consensus_distance: float | None = None
        self.consensus_step: int | None = None

    def _decay_groups(self) -> list[tuple[float, list[int]]]:
        """(weight decay, indices into ``self.params``) per parameter group with decay."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = self.optimizer.param_groups
        for key in ("lr", "momentum", "weight_decay"):
            if any(key not in g for g in groups):
                raise TypeError(
                    f"strategy {self.name} takes lr, momentum and weight_decay from its "
                    f"optimizer's parameter groups (optimizer.name sgd); "
                    f"{type(self.optimizer).__name__} has no {key!r}"
                )
        out = []
        for group in groups:
            if group["weight_decay"]:
                ids = [index[id(p)] for p in group["params"] if id(p) in index]
                out.append((float(group["weight_decay"]), ids))
        return out

    # ------------------------------------------------------------------ one step
    def _hyperparameters(self) -> tuple[float, float, float]:
        """(lr, the lr the exchange uses, momentum) of this step."""
        groups = self.optimizer.param_groups
        lrs = {float(g["lr"]) for g in groups}
        betas = {float(g["momentum"]) for g in groups}
        if len(lrs) != 1 or len(betas) != 1:
            raise ValueError(
                f"strategy {self.name} needs one learning rate and momentum for all "
                f"parameter groups, got lr {sorted(lrs)} and momentum {sorted(betas)}"
            )
        lr, beta = lrs.pop(), betas.pop()
        exchange_lr = lr if lr > 0 else float(groups[0].get("initial_lr", groups[0]["lr"]))
        if not exchange_lr > 0:
            exchange_lr = 1.0  # no learning rate anywhere: gradients cannot move anything
        return lr, exchange_lr, beta

    def step(self) -> None:
        lr, exchange_lr, beta = self._hyperparameters()
        x = self.flat.read(self._x)
        if self.decentlam:
            self._decentlam(x, lr, exchange_lr, beta)
        else:
            self._dmsgd(x, lr, beta)
        self.steps += 1

    def _decentlam(self, x: torch.Tensor, lr: float, exchange_lr: float, beta: float) -> None:
        y = self.flat.read_grads(self._y).mul_(-exchange_lr).add_(x)  # y = x - lr g
        mixed = self._mix(y, self._mixed)
        d = torch.sub(x, mixed, out=y)  # exchange_lr * g~
        if not self.layerwise and exchange_lr == lr:
            # x = y~ - lr beta m_old - lr wd x
            mixed.sub_(self.momentum, alpha=lr * beta)
            self._add_decay(mixed, x, -lr)
            self.momentum.mul_(beta).add_(d, alpha=1.0 / exchange_lr)
            self.flat.write(mixed)
            return
        rest = torch.mul(self.momentum, beta, out=self._recv)  # beta m_old + wd x
        self._add_decay(rest, x, 1.0)
        ratios = None
        if self.layerwise:  # the direction m_new + wd x = rest + g~
            direction = torch.add(rest, d, alpha=1.0 / exchange_lr, out=mixed)
            ratios = self._trust_ratios(x, direction)
        self.momentum.mul_(beta).add_(d, alpha=1.0 / exchange_lr)
        # x = x - r (lr / exchange_lr d + lr rest), r the trust ratio (1 without layerwise)
        step = d.mul_(lr / exchange_lr).add_(rest, alpha=lr)
        if ratios is not None:
            torch._foreach_mul_(self.flat.views(step), list(ratios.unbind(0)))
        self.flat.write(x.sub_(step))

    def _dmsgd(self, x: torch.Tensor, lr: float, beta: float) -> None:
        grads = self.flat.read_grads(self._y)
        self.momentum.mul_(beta).add_(grads)
        direction = self._y.copy_(self.momentum)  # m + wd x
        self._add_decay(direction, x, 1.0)
        if self.layerwise:
            ratios = self._trust_ratios(x, direction)
            torch._foreach_mul_(self.flat.views(direction), list(ratios.unbind(0)))
        y = direction.mul_(-lr).add_(x)  # x - lr r (m + wd x)
        self.flat.write(self._mix(y, self._mixed))

    def _add_decay(self, out: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        """out += scale * wd * x on every tensor whose group decays."""
        if not self.decay_groups:
            return
        out_views, x_views = self.flat.views(out), self.flat.views(x)
        for wd, ids in self.decay_groups:
            torch._foreach_add_(
                [out_views[i] for i in ids], [x_views[i] for i in ids], alpha=scale * wd
            )

    def _trust_ratios(self, x: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """clamp(|x| / |direction|, min_coeff, max_coeff) per tensor (1 where a norm is 0)."""
        ratios = trust_ratios(
            self.flat.views(x), self.flat.views(direction), self.min_coeff, self.max_coeff
        )
        self.last_trust_ratios = ratios
        return ratios

    def _mix(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = sum_j w_ij y_j: one point-to-point round per neighbour (one receive
        buffer; the transfers are bandwidth-bound, so posting them together would save
        only latency)."""
        mixing = self.mixing()
        torch.mul(y, mixing.self_weight, out=out)
        rank = self.comm.rank
        send, recv = y, self._recv
        if self.wire_dtype is not None:
            send, recv = self._send_half.copy_(y), self._recv_half
        for shift, weight in mixing.shifts:
            with self.comm.traffic("neighbour"):
                self.comm.neighbour_exchange(
                    send,
                    [mixing.send_to(rank, shift)],
                    [mixing.recv_from(rank, shift)],
                    out=[recv],
                )
            if recv is not self._recv:
                self._recv.copy_(recv)
            out.add_(self._recv, alpha=weight)
        self._mean_key = None  # the receive buffer no longer holds an average
        return out

    def mixing(self, step: int | None = None) -> Mixing:
        """The mixing round of step ``step`` (0-based; default: the next step's)."""
        step = self.steps if step is None else step
        return mixing_at(self.topology, self.ctx.world_size, step)

    def after_step(self, step: int) -> None:
        if not self.consensus_every or step % self.consensus_every:
            return
        self.consensus_step = step
        if self.ctx.world_size == 1:
            self.consensus_distance = 0.0
            return
        mean = self._average()
        x = self.flat.read(self._x).sub_(mean)
        distance = (x.norm() / mean.norm()).reshape(1)
        with self.comm.traffic("statistics"):
            self.comm.all_reduce(distance, op="avg")
        self.consensus_distance = float(distance)

    # ------------------------------------------------------------------ model and state
    def _average(self) -> torch.Tensor:
        """The average of the ranks' parameters (collective; cached until the next step)."""
        if self._mean_key != self.steps:
            mean = self.flat.read(self._recv)
            with self.comm.traffic("parameters"):
                self.comm.all_reduce(mean, op="avg")
            self._mean_key = self.steps
        return self._recv

    def eval_model(self) -> nn.Module:
        """The average of the ranks' models (collective: every rank must call it)."""
        if self.ctx.world_size == 1:
            return self.model
        cached = self._eval.current(self.steps)
        if cached is not None:
            return cached
        return self._eval.set(self._average(), self.steps)

    def state_dict(self) -> tuple[dict, dict]:
        state = {
            "steps": self.steps,
            "topology": self.topology,
            "world_size": self.ctx.world_size,
            "consensus_distance": self.consensus_distance,
            "consensus_step": self.consensus_step,
        }
        shared = {
            "strategy": self.identity(),
            "optimizer": self.optimizer.state_dict(),
            "decentralized": state,
        }
        per_rank = {"params": self.flat.read(), "momentum": self.momentum.clone()}
        return shared, per_rank

    def load_state_dict(self, shared: dict, per_rank: dict | None, same_run: bool = True) -> None:
        state = shared.get("decentralized")
        saved = shared.get("strategy") or {}
        if same_run and (state is None or saved != self.identity()):
            raise ValueError(
                f"the checkpoint was written by strategy {saved.get('name', 'unknown')} with "
                f"optimizer {saved.get('optimizer', 'unknown')}, and this run uses strategy "
                f"{self.name} with {type(self.optimizer).__name__}; resume with the same "
                f"optimizer.name and strategy.name, or start a new phase from it with "
                f"model.init_from"
            )
        if state is None:
            raise ValueError(
                f"model.init_optimizer takes the momenta of a decentlam or dmsgd checkpoint, "
                f"and this one was written by strategy {saved.get('name', 'unknown')}; set "
                f"model.init_optimizer=false to start from its weights alone"
            )
        if same_run:
            self._check_same_run(state, per_rank)
            self.consensus_distance = state["consensus_distance"]
            self.consensus_step = state["consensus_step"]
            self.flat.write(per_rank["params"])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.steps = state["steps"]
        self._mean_key = None
        self._eval.forget()
        if per_rank is not None:
            self.momentum.copy_(per_rank["momentum"])
        else:
            log.warning(
                "another world size wrote this checkpoint: every rank starts from its "
                "average model with zero momentum"
            )

    def _check_same_run(self, state: dict, per_rank: dict | None) -> None:
        """Refuse to resume on another topology or number of ranks."""
        if state["topology"] != self.topology:
            raise ValueError(
                f"the checkpoint was written with strategy.topology {state['topology']} and "
                f"this run uses {self.topology}; resume with the same topology, or start a "
                f"new phase from it with model.init_from"
            )
        if state["world_size"] != self.ctx.world_size or per_rank is None:
            raise ValueError(
                f"the checkpoint was written by {state['world_size']} ranks and this run has "
                f"{self.ctx.world_size}: {self.name} keeps each rank's own parameters and "
                f"momentum, which do not carry over to another number of ranks; resume on "
                f"{state['world_size']} ranks, or start a new phase from its average model "
                f"with model.init_from"
            )

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict:
        last = self.mixing(max(self.steps - 1, 0))
        out = {"stage": "decentralized", "neighbours": last.neighbours}
        if self.last_trust_ratios is not None:
            out["trust_ratio_min"] = float(self.last_trust_ratios.min())
            out["trust_ratio_mean"] = float(self.last_trust_ratios.mean())
            out["trust_ratio_max"] = float(self.last_trust_ratios.max())
        if self.consensus_step is not None:
            out["consensus_distance"] = self.consensus_distance
            out["consensus_step"] = self.consensus_step
        out["momentum_norm"] = float(self.momentum.norm())
        return out


# ---------------------------------------------------------------------- registry entries
def _build(args) -> Strategy:
    bounds = (args.optimizer_cfg.min_coeff, args.optimizer_cfg.max_coeff)
    neighbour = args.comm.compression.neighbour
    return Decentralized.build(
        args, cfg=args.cfg, name=args.name, trust_bounds=bounds, neighbour_codec=neighbour
    )


def _entry(name: str, summary: str, variant: Gossip) -> StrategySpec:
    return StrategySpec(
        name,
        _build,
        summary,
        family="decentralized",
        optimizers=("sgd",),
        optimizer_hint="it builds its own momentum-SGD update (momentum optimizer.betas[0], "
        "optimizer.lr, optimizer.weight_decay); for LAMB-style per-layer scaling add "
        "strategy.layerwise=lamb",
        fields=("topology", "layerwise", "consensus_every"),
        traffic=("neighbour",),
        variant=variant,
    )


# DecentLaM's momentum makes the ranks drift apart on the directed exponential graphs
# (decentlam_growth), so it takes the symmetric ring; DmSGD the exponential graph, which
# mixes in fewer steps (one_peer_exponential sends less but needs 2^p ranks).
register_strategy(
    _entry(
        "decentlam",
        "decentralised: momentum on the gossip-induced gradient (DecentLaM)",
        Gossip("ring", decentlam=True),
    )
)
register_strategy(
    _entry(
        "dmsgd",
        "decentralised: own momentum step, then the neighbour average (DmSGD)",
        Gossip("exponential", decentlam=False),
    )
)
DEFAULT_TOPOLOGY = {name: variant_of(name, Gossip).topology for name in family("decentralized")}
"""The graph of each built-in decentralised strategy when ``strategy.topology`` is null."""
