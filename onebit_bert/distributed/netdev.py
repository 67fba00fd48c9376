"""Bytes a network interface has sent and received, from Linux's ``/proc/net/dev``.

The communicator counts the bytes of the tensors it hands to the backend; these counters are
what actually crossed the interface (payload plus TCP/IP and Ethernet headers, plus anything
else using the link). Logging both per step shows that the compressed traffic is what the
wire carries. ``/proc/net/dev`` describes the network namespace of the reading process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PROC_NET_DEV = Path("/proc/net/dev")
_ENV_INTERFACES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class InterfaceBytes:
    """Bytes received (``rx``) and sent (``tx``) by one network interface; subtracting
    two readings gives the traffic between them."""

    rx: int
    tx: int

    def __sub__(self, other: InterfaceBytes) -> InterfaceBytes:
        return InterfaceBytes(self.rx - other.rx, self.tx - other.tx)


def read_interfaces(path: Path = PROC_NET_DEV) -> dict[str, InterfaceBytes]:
    """All interfaces of this process's network namespace -> received/sent bytes."""
    out: dict[str, InterfaceBytes] = {}
    for line in path.read_text().splitlines()[2:]:  # two header lines
        name, _, fields = line.partition(":")
        values = fields.split()
        if len(values) >= 9:
            out[name.strip()] = InterfaceBytes(rx=int(values[0]), tx=int(values[8]))
    return out


def resolve_interface(name: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """``None`` -> None; ``"auto"`` -> the first interface named by GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME (None when neither is set); a name -> itself, checked to exist."""
    if name is None:
        return None
    env = os.environ if env is None else env
    if name == "auto":
        for var in _ENV_INTERFACES:
            if env.get(var):
                name = env[var].split(",")[0].lstrip("^=")
                break
        else:
            return None
    if not PROC_NET_DEV.is_file():
        raise ValueError(
            f"logging.net_interface={name!r}: {PROC_NET_DEV} does not exist (Linux only); "
            "set logging.net_interface to null"
        )
    known = read_interfaces()
    if name not in known:
        raise ValueError(
            f"logging.net_interface={name!r} is not an interface of this host "
            f"(have: {', '.join(sorted(known))})"
        )
    return name


class InterfaceCounter:
    """Reads one interface's counters; ``snapshot()`` is cheap (one small procfs read)."""

    def __init__(self, interface: str):
        self.interface = interface

    def snapshot(self) -> InterfaceBytes:
        return read_interfaces()[self.interface]
