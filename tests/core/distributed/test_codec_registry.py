"""The codec registry: the built-in table, what reads it (the policy, bits per element, the
benchmark, the guide), and a toy codec added with nothing but a class and one registry
entry (accepted by the config check where it serves, averaging real traffic on two gloo
ranks, and training like fp32)."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from onebit_bert.distributed.codecs import (
    CODECS,
    CodecSpec,
    TwoPhaseCodec,
    accepted_codecs,
    bits_per_element,
    build_codec,
    codec_table,
    register_codec,
)
from onebit_bert.distributed.policy import CommConfig, CommPolicy, CompressionConfig
from onebit_bert.distributed.traffic import POLICY_KINDS, TRAFFIC_KINDS
from onebit_bert.metrics_log import read_metrics
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.paths import REPO
from tests.helpers.runs import tiny_config, train_in_process

GUIDE = REPO / "docs" / "guide" / "communication.md"


# ----------------------------------------------------------------------------- the toy
class Fp32TwoPhase(TwoPhaseCodec):
    """fp32 bytes through the two phases: lossless, each chunk summed in rank order."""

    name = "toy_fp32"

    def _row_bytes(self, chunk: int) -> int:
        return 4 * chunk

    def _encode(self, rows):
        return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1), rows

    def _decode(self, messages):
        return messages.contiguous().view(torch.float32)


TOY = CodecSpec(
    "toy_fp32",
    lambda comm, options: Fp32TwoPhase(comm),
    serves=("grad", "outer"),
    bits=32,
    lossy=False,
    overlaps=False,
    summary="fp32 in two phases",
)


@pytest.fixture
def toy():
    register_codec(TOY)
    try:
        yield TOY
    finally:
        CODECS.unregister(TOY.name)


def _in_rank(comm, function, *args):
    """In a spawned rank: the registry entry is this process's too."""
    if TOY.name not in CODECS:
        register_codec(TOY)
    return function(comm, *args)


# ----------------------------------------------------------------------------- the table
def test_builtin_codecs_and_the_kinds_they_serve():
    assert tuple(CODECS) == (
        "none", "bf16", "fp16", "int8", "int4", "onebit", "onebit_tensor", "powersgd"
    )  # fmt: skip
    assert accepted_codecs("stats") == ("none",)
    assert accepted_codecs("neighbour") == ("none", "bf16", "fp16")
    assert accepted_codecs("outer") == ("none", "bf16", "fp16", "int8", "int4")
    assert set(accepted_codecs("momentum")) == {"none", "bf16", "fp16", "int8", "onebit",
                                                "onebit_tensor"}  # fmt: skip
    assert accepted_codecs("grad") == tuple(CODECS)
    assert CODECS.names(lambda spec: spec.overlaps) == ("onebit",)
    with pytest.raises(ValueError, match="needs comm.compression.momentum onebit and"):
        CommConfig(compression=CompressionConfig(momentum="int8"), overlap=True)
    assert CODECS.names(lambda spec: not spec.lossy) == ("none",)
    assert bits_per_element("int8", int8_block=64) == 8 + 32 / 64
    assert bits_per_element("onebit") == 1 and math.isnan(bits_per_element("powersgd"))
    assert set(POLICY_KINDS.values()) < set(TRAFFIC_KINDS)


def test_a_spec_must_serve_known_kinds_and_names_are_unique(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_codec(toy)
    with pytest.raises(ValueError, match="the kinds of traffic are grad, momentum"):
        dataclasses.replace(toy, serves=("gradients",))
    with pytest.raises(ValueError, match="unknown codec 'toy_fp3'; choose one of none"):
        build_codec("toy_fp3", None)


def test_the_guide_shows_the_registry():
    """communication.md's codec table is :func:`codec_table`, and its per-kind table lists
    the codecs each kind accepts."""
    text = GUIDE.read_text()
    assert "\n".join(codec_table()) in text, "render codec_table() into communication.md"
    for key in POLICY_KINDS:
        row = re.search(rf"^\| `{key}` \|.*\| (?P<codecs>[^|]+) \| [^|]+ \|$", text, re.M)
        assert row is not None, key
        assert row["codecs"].strip() == ", ".join(accepted_codecs(key)), key


def test_the_benchmark_offers_every_lossy_gradient_codec_for_the_hybrid():
    from bench.netem import hybrid_codecs

    assert hybrid_codecs() == tuple(n for n in accepted_codecs("grad") if n != "none")


# ----------------------------------------------------------------------------- the toy
def test_toy_codec_is_accepted_where_it_serves(toy):
    assert accepted_codecs("grad")[-1] == "toy_fp32"
    assert "toy_fp32" in accepted_codecs("outer")
    CommConfig(compression=CompressionConfig(grad="toy_fp32", outer="toy_fp32"))
    with pytest.raises(ValueError, match="momentum traffic takes none, bf16"):
        CompressionConfig(momentum="toy_fp32")
    assert bits_per_element("toy_fp32") == 32
    assert "| `toy_fp32` | grad, outer | 32 | no | no | fp32 in two phases |" in codec_table()
    codec = build_codec("toy_fp32", None)
    assert isinstance(codec, Fp32TwoPhase) and not codec.lossy and not codec.overlaps_fused


def _average_with_toy(comm):
    policy = CommPolicy(CommConfig(compression=CompressionConfig(grad="toy_fp32")), comm)
    codec = policy.codec("grad")
    g = torch.Generator().manual_seed(comm.rank)
    tensors = [torch.randn(37, 5, generator=g), torch.randn(11, generator=g)]
    before = comm.snapshot()
    with comm.traffic("gradients"):
        codec.all_reduce(tensors, "grad/0")
    sent = comm.snapshot() - before
    return {
        "type": type(codec).__name__,
        "tensors": tensors,
        "sent": sent.by_kind["gradients"][0],
        "expected": codec.wire_bytes(37 * 5 + 11),
    }


def test_toy_codec_averages_real_traffic_on_two_ranks(toy):
    results = run_ranks(_in_rank, 2, _average_with_toy)
    inputs = []
    for rank in range(2):
        g = torch.Generator().manual_seed(rank)
        inputs.append([torch.randn(37, 5, generator=g), torch.randn(11, generator=g)])
    for result in results:
        assert result["type"] == "Fp32TwoPhase"
        # two phases, each one row of half the 196 elements, in fp32
        assert result["sent"] == result["expected"] == 2 * 4 * 196 // 2
        for got, *mine in zip(result["tensors"], *inputs, strict=True):
            assert torch.equal(got, (mine[0] + mine[1]) / 2)


def test_toy_codec_trains_like_fp32_on_two_ranks(toy, tiny_corpus, tmp_path):
    """data_parallel's gradient averages through the toy codec: a sum of two values is the
    same in any order, so the run is the plain fp32 run's, bit for bit."""
    models, records = {}, {}
    for codec in ("none", "toy_fp32"):
        overrides = {"comm.compression.grad": codec, "strategy.grad_sync": "allreduce"}
        overrides.update({"schedule.max_steps": 3, "checkpoint.every": 3})
        cfg = tiny_config(tiny_corpus, tmp_path / codec, **overrides)
        models[codec] = run_ranks(_in_rank, 2, train_in_process, cfg)[0]["model"]
        metrics = read_metrics(tmp_path / codec / "metrics.jsonl")
        records[codec] = [r for r in metrics if "loss" in r]
    assert len(records["toy_fp32"]) == 3
    assert [r["loss"] for r in records["toy_fp32"]] == [r["loss"] for r in records["none"]]
    assert all(r["comm_bytes_gradients"] > 0 for r in records["toy_fp32"])
    for key, value in models["none"].items():
        assert torch.equal(models["toy_fp32"][key], value), key
