"""Network interface counters (/proc/net/dev) that the trainer logs next to its own count."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from onebit_bert.distributed.netdev import (
    InterfaceBytes,
    InterfaceCounter,
    read_interfaces,
    resolve_interface,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/net/dev is Linux's")


def test_parses_the_kernel_format(tmp_path):
    path = tmp_path / "dev"
    path.write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets "
        "errs drop fifo colls carrier compressed\n"
        "    lo: 1234 10 0 0 0 0 0 0 5678 11 0 0 0 0 0 0\n"
        "  eth0:99 1 0 0 0 0 0 0 77 1 0 0 0 0 0 0\n"
    )
    assert read_interfaces(path) == {
        "lo": InterfaceBytes(rx=1234, tx=5678),
        "eth0": InterfaceBytes(rx=99, tx=77),
    }


def test_loopback_counter_sees_a_megabyte_sent_over_tcp():
    server = socket.create_server(("127.0.0.1", 0))
    received = []

    def drain():
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 16):
                received.append(len(chunk))

    thread = threading.Thread(target=drain)
    thread.start()
    counter = InterfaceCounter("lo")
    before = counter.snapshot()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(b"\0" * (1 << 20))
    thread.join(timeout=30)
    server.close()
    delta = counter.snapshot() - before
    assert sum(received) == 1 << 20
    assert delta.tx >= 1 << 20 and delta.rx >= 1 << 20  # payload plus headers


def test_resolve_interface():
    assert resolve_interface(None) is None
    assert resolve_interface("lo") == "lo"
    assert resolve_interface("auto", {"GLOO_SOCKET_IFNAME": "lo,eth1"}) == "lo"
    assert resolve_interface("auto", {"NCCL_SOCKET_IFNAME": "=lo"}) == "lo"
    assert resolve_interface("auto", {}) is None
    with pytest.raises(ValueError, match=r"net_interface='nosuch0' is not an interface.*lo"):
        resolve_interface("nosuch0")
