"""Bit-identity of the training trajectories recorded in tests/golden/trajectories.json
(see tests/helpers/golden.py): every loss, gradient norm, validation loss, byte count and the
final weights of each rank must match the recorded run exactly."""

from __future__ import annotations

import json

import pytest

from tests.helpers.golden import RUNS, cpu_kind, data_digest, golden_path, isa_supported, record


@pytest.fixture(scope="module")
def golden():
    return json.loads(golden_path().read_text())


def test_machine_kinds_are_named_by_their_instruction_sets():
    spr = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16\n"
    assert cpu_kind(spr) == "avx2+fma+avx512f+avx512_bf16+avx512_fp16+amx_tile"
    assert cpu_kind("flags\t: fpu sse2 avx avx2 fma\n") == "avx2+fma"
    assert cpu_kind("processor : 0\n") == "unknown"
    assert golden_path("no-such-kind").name == "trajectories.json"


def test_golden_data_is_the_recorded_data(golden, tiny_corpus):
    assert data_digest(tiny_corpus) == golden["data"], (
        "the prepared test corpus changed; the trajectories below cannot match. If the data "
        "change is intended, record again: python -m tests.helpers.golden --write"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_trajectory_is_bit_identical(golden, tiny_corpus, tmp_path, name):
    if not isa_supported():
        pytest.skip("the trajectories were recorded with x86-64 AVX2 kernels; this CPU lacks them")
    if data_digest(tiny_corpus) != golden["data"]:
        pytest.fail("prepared test corpus differs from the recorded one (see the data test)")
    got = record(name, tiny_corpus, tmp_path)
    want = golden["runs"][name]
    for key in ("loss", "grad_norm", "val_mlm_loss", "comm_bytes"):
        assert got[key] == want[key], f"{name}: {key} differs from the recorded trajectory"
    assert got["model"] == want["model"], f"{name}: final weights differ"
