"""The kinds of traffic, defined once: how the config names each one and how the
communicator files its bytes.

A kind has two spellings: its ``comm.compression.<key>`` config key (``grad``), which
chooses its codec, and the communicator's name for it (``gradients``), under which its
bytes and seconds are counted and reported (``comm_bytes_gradients``). Everything else
(the communicator's check, the compression policy, the strategy registry's ``traffic``
field, the codec registry's ``serves``) reads :data:`TRAFFIC`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Traffic:
    """One kind of traffic."""

    key: str
    """Its ``comm.compression`` key: the codec it travels with."""
    kind: str
    """The communicator's name for it (``with comm.traffic(kind)``, the metrics' suffix)."""
    compressible: bool
    """Whether a strategy may send it with a codec other than ``none``."""
    carries: str
    """What it carries."""


TRAFFIC = (
    Traffic("grad", "gradients", True, "averaged gradients"),
    Traffic("momentum", "momentum", True, "compressed optimizer momentum"),
    Traffic("outer", "parameters", True, "model parameters (outer steps)"),
    Traffic("neighbour", "neighbour", True, "a neighbour exchange"),
    Traffic("stats", "statistics", False, "small statistics: losses, counters, stop flags"),
)
"""Every kind of traffic a codec can be chosen for, in config order."""

OTHER = "other"
"""The communicator's kind for collectives outside any ``comm.traffic`` block."""

TRAFFIC_KINDS = (*(t.kind for t in TRAFFIC), OTHER)
"""The communicator's names of the kinds (``comm.traffic(kind)``)."""

POLICY_KINDS = {t.key: t.kind for t in TRAFFIC}
"""Config key -> the communicator's name."""

COMPRESSIBLE_KEYS = tuple(t.key for t in TRAFFIC if t.compressible)
"""The config keys a strategy may declare as traffic it sends with a chosen codec."""
