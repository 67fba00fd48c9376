"""A process group of one rank is not short-circuited: every collective, codec and
asynchronous path runs on it (the paths a one-rank NCCL group exercises on a single GPU,
``tests/test_gpu.py``), from the main thread, and gives a world of one's answer: exact
where nothing is rounded, within each codec's rounding where something is."""

from __future__ import annotations

import torch

from tests.helpers.distributed_harness import run_ranks
from tests.helpers.nccl import every_collective

LOSSY = {
    "bf16": 0.02,
    "fp16": 0.01,
    "int8": 0.1,
    "int4": 0.75,
    "onebit": None,
    "onebit_tensor": None,
    "powersgd": None,
}
"""Each lossy codec's absolute error bound on these inputs (None: no elementwise bound, a
sign and a scale per chunk, or a low-rank approximation)."""


SKIP = (
    "calls",
    "off_main_thread",
    "from_python_threads",
    "backend",
    "onebit_errors",
    "comm_seconds",
)
"""Entries that are not results to compare."""


def test_a_one_rank_group_runs_every_collective_and_changes_nothing_lossless():
    (grouped,) = run_ranks(every_collective, 1, backend="gloo")
    (alone,) = run_ranks(every_collective, 1)
    assert grouped["backend"] == "gloo" and alone["backend"] is None
    assert alone["calls"] == []  # no group: nothing reaches torch.distributed
    for name in ("all_reduce", "all_to_all_single", "broadcast", "barrier"):
        assert name in grouped["calls"], name
    assert {"all_gather_into_tensor", "all_gather_single"} & set(grouped["calls"])
    assert {"reduce_scatter_tensor", "reduce_scatter_single"} & set(grouped["calls"])
    # PyTorch's PowerSGD hook (the codec runs it) issues each next all-reduce from a
    # callback of the last one's future, which gloo completes on its own thread when the
    # callback is attached first: only there may a call come from another thread
    off_main = grouped["off_main_thread"]
    assert off_main["plain"] == off_main["ddp"] == off_main["onebit"] == []
    assert all(name == "all_reduce" for name, *_ in off_main["codecs"])
    assert all(calls == [] for calls in grouped["from_python_threads"].values())
    for key, want in alone.items():
        if key in SKIP:
            continue
        got = grouped[key]
        got, want = _flat(grouped[key]), _flat(want)
        warmup = key in ("codec/powersgd/0", "codec/powersgd/1")
        if any(key.startswith(f"codec/{c}/") for c in LOSSY) and not warmup:
            # a codec on a one-rank group still encodes (alone it returns at once):
            # rounded, not exact; PowerSGD's first two calls are its uncompressed warmup
            assert not torch.equal(got, want), key
            assert torch.isfinite(got).all(), key
            bound = LOSSY[key.split("/")[1]]
            if bound is not None:
                torch.testing.assert_close(got, want, rtol=0.01, atol=bound, msg=key)
        else:
            # the communicator's own 1-bit all-reduce compresses in both cases
            assert torch.equal(got, want), key
    # 1-bit: the whole buffer and bucket by bucket (all-to-alls in flight together) agree
    assert torch.equal(grouped["onebit"], grouped["onebit_by_bucket"])


def _flat(value) -> torch.Tensor:
    values = value if isinstance(value, list) else [value]
    return torch.cat([v.reshape(-1).double() for v in values])
