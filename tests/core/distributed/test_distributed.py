"""Process-group setup from launcher environments, and the plain collectives."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from onebit_bert.distributed import Communicator, resolve_launch_env
from onebit_bert.distributed.env import expand_hostlist
from tests.helpers.distributed_harness import run_ranks

# ----------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "hostlist,expected",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[08-10,15],login1", ["gpu08", "gpu09", "gpu10", "gpu15", "login1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("x1,y[7]", ["x1", "y7"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29511",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    launch = resolve_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == (
        "10.0.0.5",
        29511,
        "torchrun",
    )


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[03-06]",
        "SLURM_JOB_ID": "4242",
    }
    launch = resolve_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank) == (5, 8, 1)
    assert launch.master_addr == "gpu03" and launch.launcher == "slurm"
    assert 29500 <= launch.master_port < 30500
    assert resolve_launch_env(env).master_port == launch.master_port  # same job, same port
    assert resolve_launch_env({**env, "MASTER_PORT": "31000"}).master_port == 31000


def test_no_launcher_means_a_world_of_one():
    launch = resolve_launch_env({})
    assert (launch.rank, launch.world_size, launch.launcher) == (0, 1, "single")


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 of world size 4"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, r"RANK='x' is not an integer"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST"),
    ],
)
def test_bad_environment(env, match):
    with pytest.raises(ValueError, match=match):
        resolve_launch_env(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_from_env(rank, env_for_rank, out_dir):
    from onebit_bert.distributed import destroy_distributed, init_distributed

    os.environ.update(env_for_rank(rank))
    torch.set_num_threads(1)
    ctx = init_distributed()
    try:
        x = torch.tensor([float(ctx.rank + 1)])
        ctx.comm.all_reduce(x)
        torch.save(
            {
                "rank": ctx.rank,
                "world": ctx.world_size,
                "backend": ctx.backend,
                "launcher": ctx.launch.launcher,
                "sum": x.item(),
            },
            os.path.join(out_dir, f"{rank}.pt"),
        )
    finally:
        destroy_distributed()


def _slurm_env(port):
    def env(rank):
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": str(port),
        }

    return env


def _torchrun_env(port):
    def env(rank):
        return {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }

    return env


class _Env:  # picklable wrapper for spawn
    def __init__(self, kind, port):
        self.kind, self.port = kind, port

    def __call__(self, rank):
        return (_slurm_env if self.kind == "slurm" else _torchrun_env)(self.port)(rank)


@pytest.mark.parametrize("kind", ["slurm", "torchrun"])
def test_init_distributed_joins_real_gloo_group(tmp_path, kind):
    mp.spawn(_init_from_env, args=(_Env(kind, _free_port()), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    for r, res in enumerate(results):
        assert res == {"rank": r, "world": 2, "backend": "gloo", "launcher": kind, "sum": 3.0}


def test_init_distributed_alone_creates_no_group():
    from onebit_bert.distributed import init_distributed

    ctx = init_distributed(env={})
    assert ctx.world_size == 1 and ctx.backend is None and ctx.comm.group is None
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- collectives


def test_world_of_one_collectives_are_no_ops():
    comm = Communicator(None)
    x = torch.arange(6.0)
    assert comm.all_reduce(x, op="avg") is x and torch.equal(x, torch.arange(6.0))
    comm.all_reduce_coalesced([x])
    out = torch.empty(6)
    comm.all_gather(out, x)
    assert torch.equal(out, x)
    rows = torch.empty(1, 6)
    comm.all_to_all(rows, x.view(1, 6))
    assert torch.equal(rows[0], x)
    comm.broadcast(x)
    comm.barrier()
    assert comm.stats.bytes_sent == 0 and comm.stats.calls == 0


def test_bad_collective_arguments():
    comm = Communicator(None)
    with pytest.raises(ValueError, match="op must be"):
        comm.all_reduce(torch.ones(2), op="prod")
    with pytest.raises(ValueError, match="needs 1 x 3"):
        comm.all_gather(torch.empty(4), torch.ones(3))
    with pytest.raises(ValueError, match="first dimension 1"):
        comm.all_to_all(torch.empty(2, 3), torch.ones(2, 3))


def _collectives(comm):
    p, r = comm.world_size, comm.rank
    out = {}
    x = torch.full((10,), float(r + 1))
    comm.all_reduce(x, op="avg")
    out["avg"] = x
    m = torch.tensor([float(r)])
    comm.all_reduce(m, op="max")
    out["max"] = m.item()
    a, b = torch.full((3,), float(r)), torch.full((2, 2), float(10 * r))
    comm.all_reduce_coalesced([a, b], op="sum")
    out["coalesced"] = (a, b)
    gathered = torch.empty(p, 4)
    comm.all_gather(gathered, torch.full((4,), float(r)))
    out["gather"] = gathered
    send = torch.stack([torch.full((5,), float(100 * r + j)) for j in range(p)])
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)
    out["a2a"] = recv
    y = torch.full((7,), float(r))
    comm.broadcast(y, src=1)
    out["bcast"] = y
    out["bytes"] = comm.stats.bytes_sent
    out["calls"] = comm.stats.calls
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_and_their_byte_counts(world_size):
    p = world_size
    results = run_ranks(_collectives, p)
    for r, res in enumerate(results):
        assert torch.allclose(res["avg"], torch.full((10,), (p + 1) / 2))
        assert res["max"] == p - 1
        assert torch.equal(res["coalesced"][0], torch.full((3,), float(sum(range(p)))))
        assert torch.equal(res["coalesced"][1], torch.full((2, 2), float(10 * sum(range(p)))))
        assert torch.equal(
            res["gather"], torch.arange(p, dtype=torch.float32)[:, None].expand(p, 4)
        )
        assert torch.equal(res["a2a"][:, 0], torch.tensor([100.0 * i + r for i in range(p)]))
        assert torch.equal(res["bcast"], torch.ones(7))
        ring = lambda nbytes: 2 * (p - 1) * nbytes // p  # noqa: E731
        expected = (
            ring(40)
            + ring(4)
            + ring(4 * 7)  # avg, max, coalesced 3 + 4 floats
            + (p - 1) * 16  # all_gather of 4 floats
            + (p - 1) * 20  # all_to_all: the rows for other ranks, 5 floats each
            + (0 if r == 0 else 28)  # broadcast from rank 1: all but rank 0 forward it
        )
        assert res["bytes"] == expected
        assert res["calls"] == 6


def _gather_and_scatter(comm, hide_new_names: bool):
    """Communicator.all_gather, reduce_scatter, the asynchronous all_gather and a 1-bit
    all-reduce (whose all-gather is asynchronous), optionally with torch's post-2.13 names
    removed, as on an older torch."""
    import torch.distributed as dist

    from onebit_bert.distributed.codecs import compressed_all_reduce
    from onebit_bert.distributed.codecs.compression import ErrorFeedback

    if hide_new_names:
        for name in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, name):
                delattr(dist, name)
    rank, p = comm.rank, comm.world_size
    mine = torch.arange(3, dtype=torch.float32) + 10 * rank
    gathered = comm.all_gather(torch.empty(3 * p), mine)
    full = torch.arange(2 * p, dtype=torch.float32) * (rank + 1)
    averaged = comm.reduce_scatter(torch.empty(2), full)
    later = torch.empty(3 * p)
    comm.all_gather_async(later, mine).wait()
    feedback = ErrorFeedback(4096, p, rank=rank, bucket_numel=1024)
    onebit = torch.zeros(feedback.padded_numel)
    onebit[:4096] = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    compressed_all_reduce(comm, onebit, feedback)
    return gathered, averaged, hasattr(dist, "all_gather_single"), later, onebit


def test_collectives_work_under_older_torch_names():
    new = run_ranks(_gather_and_scatter, 2, False)
    old = run_ranks(_gather_and_scatter, 2, True)
    assert old[0][2] is False  # the new names really were gone
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
        torch.testing.assert_close(a[3], b[3], rtol=0, atol=0)
        torch.testing.assert_close(a[4], b[4], rtol=0, atol=0)
        torch.testing.assert_close(a[3], a[0], rtol=0, atol=0)
    torch.testing.assert_close(new[0][0], torch.tensor([0.0, 1, 2, 10, 11, 12]))
    torch.testing.assert_close(new[1][1], torch.tensor([2.0, 3.0]) * 1.5)


def test_onebit_lamb_without_foreach_max_takes_the_same_steps(monkeypatch):
    """On a torch without ``torch._foreach_max`` 1-bit LAMB reduces per tensor: the same
    bits (a maximum is exact), trust-ratio factors included."""
    from onebit_bert.distributed import Communicator
    from tests.helpers.compression import run_onebit_lamb

    fused = run_onebit_lamb(Communicator(None), 8, 2, None)
    monkeypatch.delattr(torch, "_foreach_max")
    per_tensor = run_onebit_lamb(Communicator(None), 8, 2, None)
    assert per_tensor["stages"][-1] == "compression"
    assert torch.equal(per_tensor["factors"], fused["factors"])
    for a, b in zip(per_tensor["params"], fused["params"], strict=True):
        assert torch.equal(a, b)
