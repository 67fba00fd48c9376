"""The emulated cluster of :mod:`bench.netem`: network namespaces on one bridge, links
rate-limited with tc, and processes started inside the namespaces.

Each host is a network namespace joined to a bridge by a veth pair (host side
``<tag>h<i>``, namespace side ``eth0``, addresses 198.18.0.0/24); an htb qdisc limits both
directions of every link. Names carry the creating pid, so clusters left behind by a
process that no longer exists can be found and removed. Needs root (``ip netns``, ``tc``).

Slow links send single frames: a veth hands the qdisc GSO packets of up to 64 KB, and a
shaped link sends one whole (21 ms at 25 Mbit/s) before anything queued behind it, so a
small message sharing a busy link (the trainer's per-step statistics all-reduce while
CO2's parameter average is in flight) waited several of them per hop. :meth:`Cluster.shape`
caps a GSO packet at what the link sends in :data:`GSO_BURST_SECONDS` (at least one
frame; from about 500 Mbit/s on, no cap at MTU 9000). With 4 hosts at 25 Mbit/s and a
45 MB all-reduce in flight on another process group, a 72-byte all-reduce took 410 ms
(median of 30) uncapped and 100 ms capped, 4 ms on an idle link; the link's throughput
is the same. (The leaf queue stays htb's FIFO: fq_codel, whose flow isolation would serve
such a sparse flow first, is not built into every kernel, this machine's included.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO
from pretrain.outputs import pid_alive

SUBNET = "198.18.0"
MASTER_PORT = 29500
GSO_BURST_SECONDS = 1e-3
"""The longest a shaped link spends on one GSO packet (see the module docstring)."""


# ----------------------------------------------------------------------------- the cluster


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def gso_segments(rate_mbit: float, mtu: int) -> int:
    """Frames one GSO packet may carry on a link of ``rate_mbit`` Mbit/s: what the link
    sends in :data:`GSO_BURST_SECONDS`, at least one."""
    return max(1, int(rate_mbit * 1e6 / 8 * GSO_BURST_SECONDS) // mtu)


def remove_stale_clusters(prefix: str = "obn") -> list[str]:
    """Delete namespaces and bridges left by a benchmark process that no longer exists
    (names carry the creating pid: ``obn<pid>...``)."""
    removed = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    link_names = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
    for name in [n for n in names if n.startswith(prefix)] + [
        n for n in link_names if n.startswith(prefix) and n.endswith("br")
    ]:
        digits = name[len(prefix) :].split("h")[0].split("br")[0]
        if digits.isdigit() and not pid_alive(int(digits)):
            if name.endswith("br"):
                _ip("link", "del", name, check=False)
            else:
                _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Cluster:
    """``hosts`` namespaces on one bridge; every link shaped in both directions."""

    hosts: int
    mtu: int = 9000
    prefix: str = "obn"

    def __post_init__(self):
        tag = f"{self.prefix}{os.getpid()}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}h{i}" for i in range(self.hosts)]
        self.veths = [f"{tag}h{i}" for i in range(self.hosts)]  # host-side ends
        if any(len(v) > 15 for v in self.veths + [self.bridge]):
            raise ValueError("interface names too long; use a shorter prefix")
        self.rate_mbit: float | None = None

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Cluster:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "mtu", str(self.mtu), "up")
            for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                    "eth0", "mtu", str(self.mtu), "netns", ns)  # fmt: skip
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _links(self):
        for ns, veth in zip(self.namespaces, self.veths, strict=True):
            yield [], veth  # bridge -> host direction
            yield ["ip", "netns", "exec", ns], "eth0"  # host -> bridge direction

    def shape(self, rate_mbit: float) -> None:
        """Limit every link, both directions, to ``rate_mbit`` Mbit/s (htb), and cap its GSO
        packets (:func:`gso_segments`; a kernel that cannot leaves them uncapped). Affects
        connections opened afterwards."""
        rate = f"{rate_mbit:g}mbit"
        segments = str(gso_segments(rate_mbit, self.mtu))
        for prefix, dev in self._links():
            _run([*prefix, "ip", "link", "set", "dev", dev, "gso_max_segs", segments],
                 check=False)  # fmt: skip
            if self.rate_mbit is None:  # htb cannot be replaced in place: add it once
                _run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                      "default", "10"])  # fmt: skip
            _run([*prefix, "tc", "class", "replace", "dev", dev, "parent", "1:", "classid",
                  "1:10", "htb", "rate", rate, "ceil", rate, "burst", "512kb", "cburst", "512kb",
                  "quantum", "200000"])  # fmt: skip
        self.rate_mbit = rate_mbit

    def cleanup(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its veth pair with it
        _ip("link", "del", self.bridge, check=False)

    def prefix_for(self, i: int, core: int | None = None) -> list[str]:
        """Run in host ``i``'s namespace, pinned to core ``core`` (default ``i``) mod cores
        (ranks of one run then share the cores evenly and do not migrate: steadier step
        times)."""
        cores = sorted(os.sched_getaffinity(0))
        k = i if core is None else core
        pin = ["taskset", "-c", str(cores[k % len(cores)])] if shutil.which("taskset") else []
        return ["ip", "netns", "exec", self.namespaces[i], *pin]


def check_privileges() -> str | None:
    """Why the cluster cannot be built here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces and tc rate limits needs root: run it as root"
    for tool in ("ip", "tc"):
        if _run(["sh", "-c", f"command -v {tool}"], check=False).returncode != 0:
            return f"`{tool}` is missing: install iproute2"
    probe = f"obnprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


# ----------------------------------------------------------------------------- processes


def _exit_status(code: int) -> str:
    """``exit code 2`` or ``signal SIGABRT`` for a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _launch(cmds: list[list[str]], envs: list[dict], logs: Path, timeout: float) -> None:
    """Start every command, wait for all; on a failure stop the others and raise."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            out = open(logs / f"proc{i}.log", "wb")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out), out))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in procs):
            failed = [i for i, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i = failed[0]
                tail = (logs / f"proc{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"process {i} ({' '.join(cmds[i][-4:])}) failed with "
                    f"{_exit_status(procs[i][0].returncode)}:\n{tail}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"run did not finish within {timeout:.0f} s (logs: {logs})")
            time.sleep(0.2)
        for i, (p, _) in enumerate(procs):
            if p.returncode != 0:
                tail = (logs / f"proc{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"process {i} failed with {_exit_status(p.returncode)}:\n{tail}")
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()


def _env(threads: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_distributed(
    cluster: Cluster,
    cfg_path: Path,
    logs: Path,
    threads: int,
    timeout: float,
    ranks_per_host: int = 1,
):
    """One pretraining run of ``cfg_path`` over every host: ``ranks_per_host`` ranks in each
    namespace (rank ``i`` on host ``i // ranks_per_host``, numbered host by host as torchrun
    numbers them, with LOCAL_RANK and LOCAL_WORLD_SIZE set), rendezvous at host 0, gloo on
    ``eth0``. Ranks of one host reach each other over the namespace's loopback, so ``eth0``
    carries only what crosses hosts."""
    world = cluster.hosts * ranks_per_host
    cmds, envs = [], []
    for i in range(world):
        cmds.append([*cluster.prefix_for(i // ranks_per_host, core=i), sys.executable, "-m",
                     "pretrain", "--config", str(cfg_path)])  # fmt: skip
        envs.append(
            _env(
                threads,
                RANK=str(i),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(i % ranks_per_host),
                LOCAL_WORLD_SIZE=str(ranks_per_host),
                MASTER_ADDR=cluster.address(0),
                MASTER_PORT=str(MASTER_PORT),
                GLOO_SOCKET_IFNAME="eth0",
            )
        )
    _launch(cmds, envs, logs, timeout)


def run_compute_only(
    cluster: Cluster,
    cfg_paths: list[Path],
    logs: Path,
    threads: int,
    timeout,
    ranks_per_host: int = 1,
):
    """Independent single-process pretraining runs, ``cfg_paths[i]`` in namespace
    ``i // ranks_per_host``, started together."""
    cmds = [
        [
            *cluster.prefix_for(i // ranks_per_host, core=i),
            sys.executable,
            "-m",
            "pretrain",
            "--config",
            str(path),
        ]  # fmt: skip
        for i, path in enumerate(cfg_paths)
    ]
    _launch(cmds, [_env(threads) for _ in cmds], logs, timeout)
