"""Process-group setup from a launcher's environment: torchrun, SLURM's srun, or nothing.

Precedence: torchrun variables (RANK/WORLD_SIZE) win over SLURM's, because a job that runs
one ``torchrun`` per node under ``srun`` has both and torchrun's are the per-process ones.
With neither, the process runs alone: no process group is created and every collective of
:class:`onebit_bert.distributed.comm.Communicator` is a no-op.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from onebit_bert.distributed.comm import Communicator

# Ports 29500-30499: torchrun's default port plus an offset derived from the job id, so
# two jobs sharing a node do not collide on the rendezvous port.
_DEFAULT_PORT = 29500
_PORT_SPREAD = 1000


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"
    local_world_size: int = 1
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node)."""


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM hostlist such as ``gpu[01-03,07],login1`` into host names.

    Pure Python so it works where ``scontrol`` is absent (login nodes, tests).
    """
    hosts: list[str] = []
    # Split on commas that are not inside brackets.
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        item = item.strip()
        if not item:
            continue
        hosts.extend(_expand_one(item))
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST {hostlist!r} names no hosts")
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end() :]
    out: list[str] = []
    for part in match.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                out.extend(_expand_one(f"{prefix}{n:0{width}d}{suffix}"))
        else:
            out.extend(_expand_one(f"{prefix}{part}{suffix}"))
    return out


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        launch = LaunchEnv(
            rank=_int_env(env, "RANK"),
            world_size=_int_env(env, "WORLD_SIZE"),
            local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else _DEFAULT_PORT,
            launcher="torchrun",
            local_world_size=(
                _int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
            ),
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if "MASTER_ADDR" in env:
            master_addr = env["MASTER_ADDR"]
        elif "SLURM_JOB_NODELIST" in env:
            master_addr = expand_hostlist(env["SLURM_JOB_NODELIST"])[0]
        else:
            raise ValueError(
                "SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST is: "
                "launch with srun inside an allocation, or export MASTER_ADDR"
            )
        if "MASTER_PORT" in env:
            port = _int_env(env, "MASTER_PORT")
        else:
            job = env.get("SLURM_JOB_ID", "0")
            port = _DEFAULT_PORT + zlib.crc32(job.encode()) % _PORT_SPREAD
        launch = LaunchEnv(
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=_int_env(env, "SLURM_NTASKS"),
            local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=master_addr,
            master_port=port,
            launcher="slurm",
            local_world_size=_slurm_tasks_per_node(env),
        )
    else:
        return LaunchEnv(0, 1, 0, "127.0.0.1", _DEFAULT_PORT, "single")
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise ValueError(
            f"{launch.launcher} environment gives rank {launch.rank} of world size "
            f"{launch.world_size}; the rank must lie in [0, world size)"
        )
    return launch


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else the first count of
    SLURM_TASKS_PER_NODE (``"2(x3),1"``: 2), else 1."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int_env(env, "SLURM_NTASKS_PER_NODE")
    match = re.match(r"\s*(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))
    return int(match.group(1)) if match else 1


def default_backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass
class DistContext:
    """The result of :func:`init_distributed`; pass ``comm`` to optimizers and trainers."""

    launch: LaunchEnv
    backend: str | None
    device: torch.device
    comm: Communicator

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 1800.0,
    env: Mapping[str, str] | None = None,
) -> DistContext:
    """Join the job's process group (or run alone) and pick this process's device.

    ``backend`` defaults to NCCL with CUDA and gloo without. On CUDA the device is
    ``cuda:<local_rank>``. A world of one creates no process group at all.
    """
    launch = resolve_launch_env(env)
    use_cuda = torch.cuda.is_available() and (backend in (None, "nccl"))
    if use_cuda:
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if launch.world_size == 1:
        return DistContext(launch, None, device, Communicator(group=None, device=device))
    backend = backend or default_backend()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{_bracket(launch.master_addr)}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistContext(launch, backend, device, Communicator(group=dist.group.WORLD, device=device))


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


ABORT_GRACE_S = 10.0
"""Seconds a failing rank waits for the others to reach the same error before it leaves
without them (:func:`abort_distributed`)."""


def abort_distributed(grace_s: float = ABORT_GRACE_S) -> bool:
    """Leave the process group after an error without waiting in a collective that may
    never complete: returns True when every rank reached this point within ``grace_s``
    seconds (they all failed alike; the group is torn down), False when some did not (a
    rank still waits in a collective of the step). On False the caller must end the process
    at once (``os._exit``): the rank left behind then sees its peer's connection close and
    fails within seconds instead of waiting ``collective_timeout_s`` (a
    :func:`destroy_distributed` here would wait in its barrier for that long)."""
    if not dist.is_initialized():
        gc.collect()
        return True
    try:
        # A barrier that may never complete, waited on for grace_s only (gloo honours the
        # wait's timeout; its pending work dies with the process on False).
        work = dist.barrier(async_op=True)
        if not work.wait(timeout=datetime.timedelta(seconds=grace_s)):
            return False
    except Exception:  # timed out, or a peer's connection is already gone
        return False
    dist.destroy_process_group()
    gc.collect()
    return True


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank's process ended
    (gloo: "Connection closed by peer"): that rank's own error is the cause."""
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _PEER_LOST)


def destroy_distributed() -> None:
    """Tear down the process group if one exists; safe to call more than once."""
    if dist.is_initialized():
        # Without a final barrier a fast rank can close its sockets while a peer is still
        # reading its last message, which gloo reports as a fatal "connection closed".
        dist.barrier()
        dist.destroy_process_group()
    # Free what still holds collective buffers (optimizer and trainer cycles) while the
    # interpreter is fully alive: if it is left to interpreter shutdown, gloo's worker
    # threads can drop the last reference to a tensor when they can no longer take the
    # GIL, which aborts the process ("terminate called without an active exception").
    gc.collect()
