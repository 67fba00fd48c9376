"""Every collective in the library is issued from the main thread, in the same order on
every rank: traced on 2 gloo ranks for every strategy (Streaming DiLoCo with a fragment in
flight across a checkpoint and a validation), every codec each kind of traffic
accepts, with overlap on and off (a few steps past 1-bit's warmup, with a checkpoint and
a validation). NCCL and gloo match collectives by their order on each process group; an
order that depends on thread timing can deadlock a multi-node job."""

from __future__ import annotations

import pytest

from tests.helpers.collective_trace import CollectiveTrace
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process

SGD = {"optimizer.name": "sgd", "optimizer.lr": 0.05}
LOCAL = {"strategy.outer_every": 2}

SETTINGS = {
    **{
        f"lamb/grad={codec}": {"comm.compression.grad": codec}
        for codec in ("none", "bf16", "fp16", "int8", "int4", "onebit", "powersgd")
    },
    **{
        f"onebit_lamb/momentum={codec}": {
            "optimizer.name": "onebit_lamb",
            "comm.compression.momentum": codec,
        }
        for codec in ("onebit", "int8", "bf16", "fp16", "none")
    },
    "onebit_lamb/overlap": {"optimizer.name": "onebit_lamb", "comm.overlap": True},
    "onebit_lamb/grad=int8": {"optimizer.name": "onebit_lamb", "comm.compression.grad": "int8"},
    "onebit_adam": {"optimizer.name": "onebit_adam", "optimizer.lr": 1e-3},
    "onebit_adam/overlap": {
        "optimizer.name": "onebit_adam",
        "optimizer.lr": 1e-3,
        "comm.overlap": True,
    },
    "zero_one_adam": {"optimizer.name": "zero_one_adam", "optimizer.lr": 1e-3},
    **{
        f"{name}/outer={codec}": {
            "strategy.name": name,
            **LOCAL,
            "comm.compression.outer": codec,
        }
        for name in ("local_sgd", "slowmo", "co2")
        for codec in ("none", "bf16", "fp16", "int8")
    },
    **{
        f"diloco/outer={codec}": {
            "optimizer.name": "adamw",
            "strategy.name": "diloco",
            **LOCAL,
            "comm.compression.outer": codec,
        }
        for codec in ("none", "int4")
    },
    # fragments synchronised at steps 2 and 4, each landing one step later
    **{
        f"streaming_diloco/outer={codec}": {
            "optimizer.name": "adamw",
            "strategy.name": "streaming_diloco",
            "strategy.outer_every": 4,
            "strategy.fragments": 2,
            "strategy.fragment_sync_delay": 1,
            "comm.compression.outer": codec,
        }
        for codec in ("none", "int4")
    },
    "co2/synchronous/outer=int8": {
        "strategy.name": "co2",
        **LOCAL,
        "strategy.asynchronous": False,
        "comm.compression.outer": "int8",
    },
    **{
        f"{name}/neighbour={codec}": {
            **SGD,
            "strategy.name": name,
            "strategy.topology": "ring",
            "comm.compression.neighbour": codec,
        }
        for name in ("decentlam", "dmsgd")
        for codec in ("none", "bf16", "fp16")
    },
}


def _trace_all(comm, corpus, root) -> dict:
    out = {}
    for label, overrides in SETTINGS.items():
        cfg = tiny_config(
            corpus,
            root / label.replace("/", "_").replace("=", "-"),
            **{
                "schedule.max_steps": 5,
                "optimizer.freeze_step": 2,
                "checkpoint.every": 3,
                "data.validation_every": 4,
                **overrides,
            },
        )
        with CollectiveTrace() as trace:
            train_in_process(comm, cfg)
        out[label] = {"calls": trace.calls, "off_main": trace.off_main_thread}
    return out


@pytest.mark.slow
def test_every_collective_is_issued_from_the_main_thread_in_one_order(tiny_corpus, tmp_path):
    ranks = run_ranks(_trace_all, 2, tiny_corpus, tmp_path)
    for label in SETTINGS:
        first, second = (r[label] for r in ranks)
        assert first["calls"], label
        assert first["off_main"] == second["off_main"] == [], label
        assert first["calls"] == second["calls"], label
    # the overlapped and the lossy asynchronous averages run on groups of their own
    overlap = {group for _, group in ranks[0]["onebit_lamb/overlap"]["calls"]}
    assert len(overlap) >= 2
    co2 = {group for _, group in ranks[0]["co2/outer=int8"]["calls"]}
    assert len(co2) >= 2
    streaming = {group for _, group in ranks[0]["streaming_diloco/outer=none"]["calls"]}
    assert len(streaming) >= 2
