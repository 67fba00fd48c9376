"""Mistakes that cannot pass silently. A 1-bit optimizer inside a DDP model without the
compression hook warns once, naming ``register_compression_hook``, and its byte counters
include DDP's fp32 all-reduce (2 gloo ranks against the hooked script). The health check
warns or raises on non-finite parameters and on a compression error that stays too high."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.ddp import register_compression_hook
from onebit_bert.distributed import Communicator
from onebit_bert.optim import Lamb, OneBitLamb
from onebit_bert.optim.health import HealthConfig, OptimizerHealthError, watch_health
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.tiny_bert import FREEZE, HYPER, STEPS, batch, tiny_bert

HINT = "register_compression_hook"


def _ddp_run(comm, hooked: bool) -> dict:
    """The DDP script of the guide, with or without the hook: per step the gradient bytes
    the communicator counted, the optimizer's ``last_step_bytes``, and the warnings."""
    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny_bert(), process_group=comm.group)
    optimizer = OneBitLamb(model.parameters(), comm=comm, **HYPER)
    if hooked:
        register_compression_hook(model, optimizer, comm)
    gradients, step_bytes, caught_at = [], [], []
    start = comm.snapshot()  # both runs share the communicator
    for step in range(1, STEPS + 1):
        before = comm.snapshot()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**batch(comm.rank, step)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        caught_at += [(step, str(w.message)) for w in caught if HINT in str(w.message)]
        delta = comm.snapshot() - before
        gradients.append(delta.by_kind.get("gradients", [0])[0])
        step_bytes.append(optimizer.last_step_bytes)
    return {
        "gradients": gradients,
        "step_bytes": step_bytes,
        "bytes_sent": optimizer.bytes_sent,
        "total": (comm.snapshot() - start).bytes_sent,
        "warnings": caught_at,
        "params": [p.detach().clone() for p in model.module.parameters()],
    }


def hooked_and_not(comm):
    return {"hooked": _ddp_run(comm, True), "unhooked": _ddp_run(comm, False)}


@pytest.fixture(scope="module")
def ddp_runs():
    return run_ranks(hooked_and_not, 2)


def test_a_forgotten_hook_warns_once_at_the_first_compression_step(ddp_runs):
    for rank in ddp_runs:
        assert rank["hooked"]["warnings"] == []
        warned = rank["unhooked"]["warnings"]
        assert [step for step, _ in warned] == [FREEZE + 1], warned
        assert "DistributedDataParallel" in warned[0][1]


def test_a_forgotten_hook_counts_ddps_all_reduce_in_the_bytes(ddp_runs):
    for rank in ddp_runs:
        hooked, unhooked = rank["hooked"], rank["unhooked"]
        per_step = hooked["gradients"][0]  # the hook's fp32 all-reduce of one step
        assert per_step > 0 and hooked["gradients"][FREEZE:] == [0] * (STEPS - FREEZE)
        # without the hook DDP all-reduces the same gradients on every step, compression too
        assert unhooked["gradients"] == [per_step] * STEPS
        # and the optimizer's own counters say so, on top of its compressed momentum
        momentum = hooked["step_bytes"][FREEZE]
        assert momentum > 0
        assert unhooked["step_bytes"][:FREEZE] == [per_step] * FREEZE
        assert unhooked["step_bytes"][FREEZE:] == [per_step + momentum] * (STEPS - FREEZE)
        assert unhooked["bytes_sent"] == sum(unhooked["step_bytes"])
        assert unhooked["total"] == hooked["total"] + (STEPS - FREEZE) * per_step


def _one_bit(**overrides):
    model = tiny_bert()
    return model, OneBitLamb(model.parameters(), comm=Communicator(None), **HYPER | overrides)


def _train(model, optimizer, steps: int) -> None:
    for step in range(1, steps + 1):
        model(**batch(0, step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_health_check_raises_when_the_compression_error_stays_above_the_bound():
    model, optimizer = _one_bit()
    check = watch_health(
        optimizer, HealthConfig(max_compression_error=0.5, patience=2, action="raise")
    )
    with pytest.raises(OptimizerHealthError, match="compression error .* for 2 steps in a row"):
        _train(model, optimizer, STEPS)
    # warmup steps have no compression error; the 2nd compression step is the 2nd bad one
    assert optimizer.step_count == FREEZE + 2 and check.bad_steps == 2


def test_health_check_stays_quiet_on_a_healthy_run_and_warns_once_per_bad_run():
    model, optimizer = _one_bit()
    healthy = watch_health(optimizer)  # the defaults
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, STEPS)
    assert healthy.steps == STEPS and healthy.problems == []
    assert 0 < float(optimizer.last_compression_error) < HealthConfig().max_compression_error
    healthy.remove()
    strict = watch_health(optimizer, HealthConfig(max_compression_error=1e-3, patience=2))
    with pytest.warns(UserWarning, match="compression error") as caught:
        _train(model, optimizer, 4)
    assert len([w for w in caught if "compression error" in str(w.message)]) == 1
    assert len(strict.problems) == 1 and strict.bad_steps == 4


@pytest.mark.parametrize("make", ["lamb", "onebit_lamb"])
def test_health_check_reports_non_finite_parameters_at_once(make):
    model = tiny_bert()
    if make == "lamb":
        optimizer = Lamb(model.parameters(), lr=0.02)
    else:
        optimizer = OneBitLamb(model.parameters(), comm=Communicator(None), **HYPER)
    check = watch_health(optimizer, HealthConfig(action="raise"))
    _train(model, optimizer, 1)
    assert check.problems == []
    model(**batch(0, 2)).loss.backward()
    next(model.parameters()).grad[0, 0] = math.inf
    with pytest.raises(OptimizerHealthError, match="non-finite parameters after step 2"):
        optimizer.step()


def test_health_config_refuses_nonsense():
    with pytest.raises(ValueError, match="health action must be one of"):
        HealthConfig(action="ignore")
    with pytest.raises(ValueError, match="patience must be >= 1"):
        HealthConfig(patience=0)
    with pytest.raises(ValueError, match="max_compression_error must be a positive number"):
        HealthConfig(max_compression_error=math.nan)
