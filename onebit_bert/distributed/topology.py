"""Communication graphs for decentralised training: who receives whose vector, and with
what weight (the mixing matrix W, as BlueFog's ``topology_util`` builds it).

Every graph here is *circulant*: node i keeps ``self_weight`` of its own vector and takes
weight ``w`` of the vector of node ``(i - shift) mod n`` for each ``(shift, w)``; it sends
its own vector to ``(i + shift) mod n``. Row i of W is node i's receive weights:
``W[i, i] = self_weight``, ``W[i, (i - shift) mod n] = w``.

- ``ring``: receive from the left and right neighbours (i-1, i+1), weights 1/3 each and
  1/3 self (BlueFog's ``RingGraph``). With two nodes the left and right neighbour are the
  same node: it is counted once and the weights are 1/2, 1/2 (BlueFog's ``RingGraph(2)``,
  which is also the exact average); with one node there is no neighbour.
- ``exponential`` (static; BlueFog's ``ExponentialTwoGraph``): receive from i - 2^j,
  j = 0 .. ceil(log2 n) - 1, plus self, uniform weights 1 / (1 + #neighbours).
- ``one_peer_exponential`` (time-varying; BlueFog's ``GetDynamicOnePeerSendRecvRanks`` over
  the exponential graph): at step k node i sends to (i + 2^(k mod tau)) mod n and
  receives from (i - 2^(k mod tau)) mod n, tau = log2 n, weights 1/2 self, 1/2 peer. Only
  for n a power of 2: then any tau consecutive matrices multiply to the exact average
  11^T/n, which is what the graph is for.
- ``full``: every other node, uniform 1/n (the exact average; for tests).

A circulant matrix with non-negative weights summing to one is doubly stochastic, so the
average over nodes is preserved by every round; :func:`check_topology` still builds the
matrices and checks it, so that a graph added later cannot skip the check.

Doubly stochastic is not enough for DecentLaM: its momentum carries the consensus residual
(x_i - sum_j w_ij x_j) / lr, and with momentum beta that feedback loop makes the ranks'
disagreement grow on graphs whose matrices have complex eigenvalues, the directed ones
(``exponential`` beyond two nodes, ``one_peer_exponential`` beyond two), whatever the
gradients: :func:`decentlam_growth` computes the factor and :func:`check_decentlam`
refuses a graph where it exceeds 1. The symmetric ``ring`` (real eigenvalues) is stable
for every beta < 1. DmSGD mixes its whole iterate and has no such loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOPOLOGIES = ("ring", "exponential", "one_peer_exponential", "full")
STOCHASTIC_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Mixing:
    """One round of mixing on a circulant graph of ``world_size`` nodes: keep
    ``self_weight`` of the own vector, take weight ``w`` of the vector of node
    ``i - shift`` for each ``(shift, w)`` in ``shifts`` (distinct shifts in 1 .. n-1)."""

    world_size: int
    self_weight: float
    shifts: tuple[tuple[int, float], ...]

    def send_to(self, rank: int, shift: int) -> int:
        """The node ``rank`` sends its vector to for ``shift``."""
        return (rank + shift) % self.world_size

    def recv_from(self, rank: int, shift: int) -> int:
        """The node ``rank`` receives from for ``shift``."""
        return (rank - shift) % self.world_size

    @property
    def neighbours(self) -> int:
        """How many vectors each node sends (and receives) in this round."""
        return len(self.shifts)


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ..."""
    return n >= 1 and n & (n - 1) == 0


def period(topology: str, world_size: int) -> int:
    """How many steps the graph takes to repeat (1 for a static graph)."""
    if topology == "one_peer_exponential" and world_size > 1:
        return max(1, world_size.bit_length() - 1)  # log2 n for n a power of 2
    return 1


def _uniform(world_size: int, shifts: list[int]) -> Mixing:
    distinct = sorted({s % world_size for s in shifts} - {0})
    weight = 1.0 / (1 + len(distinct))
    return Mixing(world_size, weight, tuple((s, weight) for s in distinct))


def mixing_at(topology: str, world_size: int, step: int = 0) -> Mixing:
    """The mixing round of ``topology`` on ``world_size`` nodes at step ``step`` (0-based;
    only ``one_peer_exponential`` depends on it)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    n = world_size
    if n == 1:
        return Mixing(1, 1.0, ())
    if topology == "ring":
        return _uniform(n, [1, -1])
    if topology == "exponential":
        return _uniform(n, [2**j for j in range((n - 1).bit_length())])  # ceil(log2 n)
    if topology == "full":
        return _uniform(n, list(range(1, n)))
    shift = 2 ** (step % period(topology, n))
    return Mixing(n, 0.5, ((shift % n, 0.5),))


def mixing_matrix(mixing: Mixing) -> torch.Tensor:
    """W (float64, ``n x n``): row i holds node i's receive weights."""
    n = mixing.world_size
    w = torch.eye(n, dtype=torch.float64) * mixing.self_weight
    for i in range(n):
        for shift, weight in mixing.shifts:
            w[i, mixing.recv_from(i, shift)] += weight
    return w


def check_doubly_stochastic(w: torch.Tensor, what: str) -> None:
    """Refuse a mixing matrix with a negative weight or a row or column that does not sum
    to one (then the nodes' average drifts, and the method is not what it claims)."""
    rows, cols = w.sum(1), w.sum(0)
    bad = (
        bool((w < 0).any())
        or not torch.allclose(rows, torch.ones_like(rows), rtol=0, atol=STOCHASTIC_TOLERANCE)
        or not torch.allclose(cols, torch.ones_like(cols), rtol=0, atol=STOCHASTIC_TOLERANCE)
    )
    if bad:
        raise ValueError(
            f"the mixing matrix of {what} is not doubly stochastic (row sums "
            f"{rows.tolist()}, column sums {cols.tolist()}): the ranks' average would "
            f"drift; use strategy.topology ring or exponential"
        )


def check_topology(topology: str, world_size: int) -> None:
    """A clear error when ``topology`` cannot run on ``world_size`` ranks: a one-peer
    exponential graph on a world size that is not a power of 2, or any round's matrix not
    doubly stochastic."""
    if topology == "one_peer_exponential" and not is_power_of_two(world_size):
        raise ValueError(
            f"strategy.topology one_peer_exponential needs a power-of-2 number of ranks, "
            f"got {world_size}: its peer cycles through shifts 2^(k mod log2 n), and only "
            f"for n = 2^p do log2 n consecutive rounds average exactly; run on a power-of-2 "
            f"number of ranks or use strategy.topology exponential (any number of ranks)"
        )
    for step in range(period(topology, world_size)):
        what = f"strategy.topology {topology} on {world_size} ranks (step {step})"
        check_doubly_stochastic(mixing_matrix(mixing_at(topology, world_size, step)), what)


def _eigenvalues(mixing: Mixing) -> torch.Tensor:
    """W's eigenvalues (complex128), one per Fourier mode k = 0 .. n-1: for a circulant W,
    lambda_k = self_weight + sum over shifts of w exp(-2 pi i k shift / n)."""
    n = mixing.world_size
    k = torch.arange(n, dtype=torch.float64)
    lam = torch.full((n,), mixing.self_weight, dtype=torch.complex128)
    for shift, w in mixing.shifts:
        lam = lam + w * torch.exp(torch.complex(torch.zeros(n, dtype=torch.float64),
                                                -2 * torch.pi * k * shift / n))  # fmt: skip
    return lam


def decentlam_growth(topology: str, world_size: int, beta: float) -> float:
    """Factor per step by which DecentLaM's disagreement between ranks (x_i minus the
    average, with lr x the momentum) grows or shrinks without gradients, at its worst
    mode: below 1 it dies out, above 1 it grows geometrically.

    Per Fourier mode of a circulant W with eigenvalue lambda, DecentLaM's update without
    gradients (x' = W x - lr beta m, m' = beta m + (x - W x) / lr) is, with u = lr m::

        [x', u'] = [[lambda, -beta], [1 - lambda, beta]] [x, u]

    (the learning rate cancels while it is constant). Over the graph's period the mode's
    matrices multiply; the growth is the largest spectral radius of those products over the
    modes other than the average's (k = 0), to the power 1 / period."""
    if world_size < 2:
        return 0.0
    steps = period(topology, world_size)
    product = torch.eye(2, dtype=torch.complex128).repeat(world_size - 1, 1, 1)
    for step in range(steps):
        lam = _eigenvalues(mixing_at(topology, world_size, step))[1:]
        a = torch.empty(world_size - 1, 2, 2, dtype=torch.complex128)
        a[:, 0, 0], a[:, 0, 1], a[:, 1, 0], a[:, 1, 1] = lam, -beta, 1 - lam, beta
        product = a @ product
    radius = torch.linalg.eigvals(product).abs().amax().item()
    return radius ** (1.0 / steps)


def largest_stable_momentum(topology: str, world_size: int) -> float:
    """The largest beta on a 0.01 grid up to 0.99 such that DecentLaM's growth is below 1
    for it and every grid value below it (0.0 when none)."""
    best = 0.0
    for i in range(100):
        beta = i / 100
        if decentlam_growth(topology, world_size, beta) > 1.0 + 1e-9:
            break
        best = beta
    return best


def check_decentlam(topology: str, world_size: int, beta: float) -> None:
    """A clear error when DecentLaM's disagreement would grow on this graph (see
    :func:`decentlam_growth`)."""
    growth = decentlam_growth(topology, world_size, beta)
    if growth <= 1.0 + 1e-9:  # not growing (slow mixing on a long ring is just below 1)
        return
    safe = largest_stable_momentum(topology, world_size)
    raise ValueError(
        f"strategy decentlam on strategy.topology {topology} with {world_size} ranks and "
        f"momentum {beta:g} (optimizer.betas[0]) is unstable: the ranks' disagreement grows "
        f"{growth:.3f}x per step whatever the gradients (DecentLaM's momentum carries the "
        f"consensus residual (x_i - sum_j w_ij x_j) / lr, and this directed graph's complex "
        f"eigenvalues make that loop grow); use strategy.topology ring (symmetric, stable "
        f"for any momentum < 1), strategy.name dmsgd, or optimizer.betas[0] <= {safe:g}"
    )
