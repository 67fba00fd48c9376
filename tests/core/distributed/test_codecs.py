"""Codecs behind the communicator: each one's encoding, its error-feedback invariant, the
two-phase all-reduce on real gloo ranks against a plain one-process simulation, exact
byte counts, state round trips, PowerSGD by PyTorch's hook, and the hierarchy."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from onebit_bert.distributed import Communicator
from onebit_bert.distributed.codecs import (
    INT4_LEVELS,
    INT8_LEVELS,
    HalfCodec,
    Int4Codec,
    Int8Codec,
    bits_per_element,
    build_codec,
    compressed_all_reduce,
)
from onebit_bert.distributed.policy import CommConfig, CommPolicy, CompressionConfig
from tests.helpers.compression import per_tensor_calls
from tests.helpers.distributed_harness import run_ranks

SHAPES = [(37, 5), (11,), (64, 3)]
NUMEL = 37 * 5 + 11 + 64 * 3  # 388: padding in every codec


def rank_inputs(rank: int, calls: int = 3) -> list[list[torch.Tensor]]:
    """Per call, this rank's tensors (different on every rank and call)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [[torch.randn(s, generator=g) * (1 + c) for s in SHAPES] for c in range(calls)]


# ----------------------------------------------------------------------------- encodings


def one_rank():
    return Communicator(None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_encoding_is_rounding_to_the_format(dtype):
    codec = HalfCodec(one_rank(), dtype)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    message, decoded = codec._encode(x)
    assert message.dtype == torch.uint8 and message.shape == (4, 64 * 2)
    assert torch.equal(decoded, x.to(dtype).float())
    assert torch.equal(codec._decode(message), decoded)


def test_int8_encoding_bounds_the_error_by_half_a_step():
    codec = Int8Codec(one_rank(), block=16)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    x[1, :16] = 0.0  # an all-zero block
    message, decoded = codec._encode(x)
    assert message.shape == (2, 64 + 4 * 4)  # codes, then one fp32 scale per block
    assert torch.equal(codec._decode(message), decoded)
    blocks = x.view(2, 4, 16)
    step = blocks.abs().amax(dim=2, keepdim=True) / INT8_LEVELS
    err = (decoded.view(2, 4, 16) - blocks).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-6) + 1e-12)
    assert torch.equal(decoded[1, :16], torch.zeros(16))
    codes = message[:, :64].contiguous().view(torch.int8)
    assert codes.min() >= -INT8_LEVELS and codes.max() <= INT8_LEVELS
    # each block's largest magnitude is a full-scale code
    assert torch.equal(
        codes.view(2, 4, 16).abs().amax(dim=2)[0], torch.full((4,), 127, dtype=torch.int8)
    )


def test_int8_block_must_be_positive():
    with pytest.raises(ValueError, match="int8_block"):
        Int8Codec(one_rank(), block=0)


def test_int4_packs_two_codes_per_byte_and_bounds_the_error_by_half_a_step():
    codec = Int4Codec(one_rank(), block=16)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[2, 16:32] = 0.0  # an all-zero block
    message, decoded = codec._encode(x)
    assert message.dtype == torch.uint8
    assert message.shape == (3, 64 // 2 + 4 * 4)  # codes two per byte, then the scales
    assert codec._row_bytes(64) == message.shape[1]
    assert torch.equal(codec._decode(message), decoded)
    blocks = x.view(3, 4, 16)
    scale = blocks.abs().amax(dim=2, keepdim=True) / INT4_LEVELS
    assert torch.all((decoded.view(3, 4, 16) - blocks).abs() <= scale / 2 * (1 + 1e-6) + 1e-12)
    assert torch.equal(decoded[2, 16:32], torch.zeros(16))
    nibbles = torch.cat([message[:, :32] & 0x0F, message[:, :32] >> 4])
    assert nibbles.min() >= 8 - INT4_LEVELS and nibbles.max() <= 8 + INT4_LEVELS
    # the codes sit where the docstring says: element 2i low, 2i + 1 high
    codes = torch.round(blocks / scale.clamp_min(1e-30)).view(3, 64)
    assert torch.equal((message[:, :32] & 0x0F).float() - 8, codes[:, 0::2])
    assert torch.equal((message[:, :32] >> 4).float() - 8, codes[:, 1::2])
    assert bits_per_element("int4", int4_block=16) == 4 + 32 / 16


def test_int4_block_must_be_even():
    with pytest.raises(ValueError, match="int4_block"):
        Int4Codec(one_rank(), block=7)
    with pytest.raises(ValueError, match="int4_block"):
        CommConfig(int4_block=3)


def test_unknown_codec_is_named():
    with pytest.raises(ValueError, match="unknown codec 'int2'"):
        build_codec("int2", one_rank())


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4", "onebit", "powersgd"])
def test_every_codec_is_a_no_op_on_one_rank(name):
    codec = build_codec(name, one_rank())
    tensors = [t.clone() for t in rank_inputs(0, 1)[0]]
    codec.all_reduce(tensors, "x")
    assert all(torch.equal(a, b) for a, b in zip(tensors, rank_inputs(0, 1)[0], strict=True))


# ----------------------------------------------------------------------------- simulation


def _bf16(rows):
    return rows.to(torch.bfloat16).float()


def _fp16(rows):
    return rows.to(torch.float16).float()


def _int8(rows, block, levels=127):
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        for a in range(0, rows.shape[1], block):
            v = rows[r, a : a + block]
            s = v.abs().max() / levels
            q = torch.zeros_like(v) if s == 0 else torch.round(v / s).clamp(-levels, levels)
            out[r, a : a + block] = q * s
    return out


def simulate_two_phase(inputs, roundtrip, quantum, errors=None):
    """The two phases for p ranks in one process, written out plainly. ``inputs``: per
    rank a flat fp32 tensor; ``errors``: per rank [worker, server] or None (updated)."""
    p = len(inputs)
    numel = inputs[0].numel()
    padded = max(p * quantum, -(-numel // (p * quantum)) * (p * quantum))
    chunk = padded // p
    sent = []
    for i in range(p):
        x = torch.zeros(padded)
        x[:numel] = inputs[i]
        if errors is not None:
            x = x + errors[i][0]
        d = roundtrip(x.view(p, chunk)).reshape(-1)
        if errors is not None:
            errors[i][0] = x - d
        sent.append(d)
    result = torch.zeros(padded)
    for j in range(p):
        mine = torch.stack([sent[i][j * chunk : (j + 1) * chunk] for i in range(p)]).sum(0) / p
        if errors is not None:
            mine = mine + errors[j][1]
        d = roundtrip(mine.view(1, chunk)).reshape(-1)
        if errors is not None:
            errors[j][1] = mine - d
        result[j * chunk : (j + 1) * chunk] = d
    return result[:numel]


def _codec_calls(comm, name):
    codec = build_codec(name, comm, int8_block=32, int4_block=32)
    outputs, counted = [], []
    for tensors in rank_inputs(comm.rank):
        before = comm.snapshot()
        codec.all_reduce(tensors, "buf")
        counted.append((comm.snapshot() - before).bytes_sent)
        outputs.append(torch.cat([t.reshape(-1) for t in tensors]))
    return {"outputs": outputs, "bytes": counted, "state": codec.state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4"])
def test_two_phase_codecs_match_the_simulation_bit_for_bit(name, world_size):
    ranks = run_ranks(_codec_calls, world_size, name)
    roundtrip, quantum, feedback = {
        "bf16": (_bf16, 1, False),
        "fp16": (_fp16, 1, False),
        "int8": (lambda rows: _int8(rows, 32), 32, True),
        "int4": (lambda rows: _int8(rows, 32, INT4_LEVELS), 32, True),
    }[name]
    errors = None
    if feedback:
        padded = -(-NUMEL // (world_size * 32)) * world_size * 32
        errors = [[torch.zeros(padded), torch.zeros(padded // world_size)] for _ in ranks]
    inputs = [rank_inputs(r) for r in range(world_size)]
    for call in range(3):
        flat = [torch.cat([t.reshape(-1) for t in inputs[r][call]]) for r in range(world_size)]
        want = simulate_two_phase(flat, roundtrip, quantum, errors)
        for r in ranks:
            assert torch.equal(r["outputs"][call], want), f"{name}: call {call} differs"
        exact = torch.stack(flat).mean(0)
        tolerance = {"bf16": 2e-2, "fp16": 3e-3, "int8": 0.1, "int4": 0.5}[name]
        assert (want - exact).abs().max() <= tolerance * exact.abs().max()
    # exact bytes: two phases, (p-1) rows each, of the encoded chunk (+ scales)
    padded = -(-NUMEL // (world_size * quantum)) * world_size * quantum
    chunk = padded // world_size
    row = {"bf16": 2 * chunk, "fp16": 2 * chunk, "int8": chunk + 4 * (chunk // 32),
           "int4": chunk // 2 + 4 * (chunk // 32)}[name]  # fmt: skip
    for r in ranks:
        assert r["bytes"] == [2 * (world_size - 1) * row] * 3
    if feedback:  # the errors each rank keeps are the simulation's
        for rank, r in enumerate(ranks):
            worker, server = r["state"]["errors"]["buf"]
            assert torch.equal(worker, errors[rank][0])
            assert torch.equal(server, errors[rank][1])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_error_feedback_carries_what_rounding_left_out(name):
    """Summed over calls, the average int8 (int4) delivers differs from the exact average
    by no more than the errors still held (nothing is lost, only delayed)."""
    ranks = run_ranks(_codec_calls, 2, name)
    inputs = [rank_inputs(r) for r in range(2)]
    exact = sum(
        torch.stack([torch.cat([t.reshape(-1) for t in inputs[r][c]]) for r in range(2)]).mean(0)
        for c in range(3)
    )
    delivered = sum(ranks[0]["outputs"])
    held = sum(r["state"]["errors"]["buf"][0][:NUMEL] for r in ranks) / 2
    server = torch.cat([r["state"]["errors"]["buf"][1] for r in ranks])[:NUMEL]
    assert torch.allclose(delivered + held + server, exact, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_codecs_give_every_rank_the_same_result(world_size):
    for name in ("bf16", "int8", "onebit"):
        ranks = run_ranks(_codec_calls, world_size, name)
        for r in ranks[1:]:
            assert all(
                torch.equal(a, b) for a, b in zip(r["outputs"], ranks[0]["outputs"], strict=True)
            ), name


def _plain_vs_coalesced(comm):
    tensors = rank_inputs(comm.rank, 1)[0]
    copies = [t.clone() for t in tensors]
    build_codec("none", comm).all_reduce(tensors, "g")
    comm.all_reduce_coalesced(copies)
    return all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))


def test_none_is_the_plain_coalesced_all_reduce():
    assert all(run_ranks(_plain_vs_coalesced, 2))


def _onebit_codec_vs_comm(comm):
    from onebit_bert.distributed import ErrorFeedback

    codec = build_codec("onebit", comm)
    feedback = ErrorFeedback(NUMEL, comm.world_size, rank=comm.rank)
    same = True
    for tensors in rank_inputs(comm.rank):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        buffer = torch.zeros(feedback.padded_numel)
        buffer[:NUMEL] = flat
        compressed_all_reduce(comm, buffer, feedback)
        codec.all_reduce(tensors, "m")
        same &= torch.equal(torch.cat([t.reshape(-1) for t in tensors]), buffer[:NUMEL])
    return same


def test_onebit_codec_is_the_communicators_one_bit_all_reduce():
    assert all(run_ranks(_onebit_codec_vs_comm, 2))


def _resumed(comm, name):
    """Three calls straight, against two calls, a state round trip, and the third."""
    kw = {"int8_block": 32, "powersgd_start_step": 2}
    straight = build_codec(name, comm, **kw)
    inputs = rank_inputs(comm.rank)
    for tensors in inputs:
        straight.all_reduce(tensors, "k")
    inputs2 = rank_inputs(comm.rank)
    first = build_codec(name, comm, **kw)
    for tensors in inputs2[:2]:
        first.all_reduce(tensors, "k")
    state = first.state_dict()
    second = build_codec(name, comm, **kw)
    second.load_state_dict(state)
    second.all_reduce(inputs2[2], "k")
    return all(torch.equal(a, b) for a, b in zip(inputs[2], inputs2[2], strict=True))


@pytest.mark.parametrize("name", ["int8", "onebit", "powersgd"])
def test_codec_state_round_trip_continues_exactly(name):
    assert all(run_ranks(_resumed, 2, name))


# ----------------------------------------------------------------------------- PowerSGD


def _powersgd(comm, start_step):
    g = torch.Generator().manual_seed(comm.rank)
    codec = build_codec("powersgd", comm, powersgd_rank=1, powersgd_start_step=start_step)
    out = []
    for _ in range(4):
        tensors = [torch.randn(16, 12, generator=g), torch.randn(7, generator=g)]
        plain = [t.clone() for t in tensors]
        comm.all_reduce_coalesced(plain)
        before = comm.snapshot()
        codec.all_reduce(tensors, "grad/0")
        out.append(
            {
                "equal_to_plain": all(
                    torch.equal(a, b) for a, b in zip(tensors, plain, strict=True)
                ),
                "bytes": (comm.snapshot() - before).bytes_sent,
                "result": [t.clone() for t in tensors],
                "plain": plain,
            }
        )
    return out


def test_powersgd_by_the_torch_hook_counts_its_factors():
    start = 2
    ranks = run_ranks(_powersgd, 2, start)
    for step, entry in enumerate(ranks[0]):
        if step < start:  # fp32 steps: the hook's plain all-reduce
            assert entry["equal_to_plain"]
            assert entry["bytes"] == 2 * 1 * 4 * (16 * 12 + 7) // 2
        else:  # rank-1 factors of the matrix (16 + 12), the vector in fp32
            assert not entry["equal_to_plain"]
            assert entry["bytes"] == 2 * 1 * 4 * (16 + 12 + 7) // 2
            matrix = entry["result"][0]
            assert torch.linalg.matrix_rank(matrix) == 1
            # the uncompressed vector is the exact average
            assert torch.allclose(entry["result"][1], entry["plain"][1])
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["result"], b["result"], strict=True))


def test_powersgd_start_step_must_leave_a_full_precision_step():
    with pytest.raises(ValueError, match="powersgd_start_step"):
        build_codec("powersgd", one_rank(), powersgd_start_step=1)


# ----------------------------------------------------------------------------- policy


def test_policy_defaults_are_todays_behaviour():
    cfg = CommConfig()
    assert cfg.is_default
    assert (cfg.compression.grad, cfg.compression.momentum) == ("none", "onebit")


@pytest.mark.parametrize(
    ("kind", "codec", "message"),
    [
        ("stats", "int8", "stats traffic takes none"),
        ("outer", "onebit", "outer traffic takes none, bf16, fp16, int8"),
        ("neighbour", "int8", "neighbour traffic takes none, bf16, fp16"),
        ("momentum", "powersgd", "momentum traffic takes"),
        ("grad", "zip", "unknown codec 'zip'"),
    ],
)
def test_policy_refuses_a_codec_a_kind_cannot_take(kind, codec, message):
    with pytest.raises(ValueError, match=message):
        CompressionConfig(**{kind: codec})


def test_hierarchy_refuses_powersgd():
    with pytest.raises(ValueError, match="per-node slices"):
        CommConfig(compression=CompressionConfig(grad="powersgd"), hierarchy="node")


def _hierarchical(comm, local_world_size, name):
    cfg = CommConfig(compression=CompressionConfig(grad=name), hierarchy="node", int8_block=32)
    policy = CommPolicy(cfg, comm, comm.rank % local_world_size, local_world_size)
    codec = policy.codec("grad")
    tensors = rank_inputs(comm.rank, 1)[0]
    before, intra_before = comm.snapshot(), comm.intra_stats.copy()
    with comm.traffic("gradients"):
        codec.all_reduce(tensors, "g")
    return {
        "out": torch.cat([t.reshape(-1) for t in tensors]),
        "inter": (comm.snapshot() - before).bytes_sent,
        "intra": (comm.intra_stats.copy() - intra_before).bytes_sent,
    }


def test_hierarchy_averages_exactly_in_full_precision():
    """2 nodes x 2 ranks, codec none: the exact average (up to fp32 summation order),
    half the buffer (194 elements) per rank across nodes, a reduce-scatter and an
    all-gather inside."""
    ranks = run_ranks(_hierarchical, 4, 2, "none")
    inputs = [torch.cat([t.reshape(-1) for t in rank_inputs(r, 1)[0]]) for r in range(4)]
    exact = torch.stack(inputs).mean(0)
    for r in ranks:
        assert torch.allclose(r["out"], exact, atol=1e-6)
        assert torch.equal(r["out"], ranks[0]["out"])
        # across nodes: a 2-rank ring all-reduce of the slice
        assert r["inter"] == 2 * 1 * 194 * 4 // 2
        # inside the node: reduce-scatter and all-gather, one slice each
        assert r["intra"] == 2 * 194 * 4


def test_hierarchy_compresses_between_nodes_only():
    """int8 between nodes: each node's mean is computed exactly first, so the result is
    the int8 two-phase average of the two node means."""
    ranks = run_ranks(_hierarchical, 4, 2, "int8")
    inputs = [torch.cat([t.reshape(-1) for t in rank_inputs(r, 1)[0]]) for r in range(4)]
    node_means = [(inputs[0] + inputs[1]) / 2, (inputs[2] + inputs[3]) / 2]
    # local rank 0 carries elements [0, 194) across nodes, local rank 1 [194, 388)
    halves = [[m[:194] for m in node_means], [m[194:] for m in node_means]]
    errors = [[[torch.zeros(256), torch.zeros(128)] for _ in range(2)] for _ in halves]
    want = torch.cat(
        [
            simulate_two_phase(half, lambda rows: _int8(rows, 32), 32, err)
            for half, err in zip(halves, errors, strict=True)
        ]
    )
    for r in ranks:
        assert torch.allclose(r["out"], want, atol=1e-6)
        assert torch.equal(r["out"], ranks[0]["out"])


def _copied(run) -> int:
    """Elements written by copies and concatenations while ``run()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counted = {torch.ops.aten.copy_.default, torch.ops.aten.cat.default}

    class Copies(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in counted:
                Copies.elements += out.numel()
            return out

    with Copies():
        run()
    return Copies.elements


def _hierarchical_fused(comm, local_world_size, name, whole=False):
    """Three averages of a fused buffer (387 elements, zero-padded to 400) by two
    hierarchical codecs with the same state: one through ``all_reduce`` of its first 387
    elements, one through ``all_reduce_fused`` in place; with ``whole``, ``all_reduce`` of
    388 elements as two tensors and as one. The elements each copied."""
    cfg = CommConfig(compression=CompressionConfig(grad=name), hierarchy="node", int8_block=32)
    codecs = [
        CommPolicy(cfg, comm, comm.rank % local_world_size, local_world_size).codec("grad", c)
        for c in (comm, comm.side_channel())
    ]
    g = torch.Generator().manual_seed(comm.rank)
    numel, outs, copied = 387, {"plain": [], "fused": []}, {"plain": [], "fused": []}
    buffers = {"plain": torch.zeros(400), "fused": torch.zeros(400)}
    averages = {
        "plain": lambda codec, buffer: codec.all_reduce([buffer[:numel]], "g"),
        "fused": lambda codec, buffer: codec.all_reduce_fused(buffer, numel, "g"),
    }
    if whole:  # one tensor of 388 elements (2 divides it) against the same in two pieces
        numel = 388
        averages = {
            "plain": lambda codec, buffer: codec.all_reduce([buffer[:100], buffer[100:388]], "g"),
            "fused": lambda codec, buffer: codec.all_reduce([buffer[:388]], "g"),
        }
    for _ in range(3):
        values = torch.randn(numel, generator=g)
        for (way, buffer), codec in zip(buffers.items(), codecs, strict=True):
            buffer[:numel] = values
            copied[way].append(_copied(partial(averages[way], codec, buffer)))
            outs[way].append(buffer.clone())
    return {"outs": outs, "copied": copied}


@pytest.mark.parametrize("name", ["none", "onebit", "int8"])
def test_hierarchy_averages_a_fused_buffer_in_place(name):
    """2 nodes x 2 ranks: ``all_reduce_fused`` gives the same bits as ``all_reduce``, step
    after step (the inner codec's errors carry over), leaves the padding zero, and copies
    three buffers' worth (387 x 3 elements) fewer: no flattening, padding or copying back
    of the whole buffer."""
    for r in run_ranks(_hierarchical_fused, 4, 2, name):
        for plain, fused in zip(r["outs"]["plain"], r["outs"]["fused"], strict=True):
            assert torch.equal(plain[:387], fused[:387])
            assert torch.all(fused[387:] == 0)
        saved = [a - b for a, b in zip(r["copied"]["plain"], r["copied"]["fused"], strict=True)]
        assert saved == [3 * 387] * 3, r["copied"]


@pytest.mark.parametrize("name", ["none", "onebit"])
def test_hierarchy_averages_one_tensor_in_place(name):
    """2 nodes x 2 ranks: one contiguous tensor whose size the node's 2 ranks divide (a DDP
    bucket's buffer) is averaged where it is, with the bits of the same elements passed
    as two tensors (which go through a padded copy)."""
    for r in run_ranks(_hierarchical_fused, 4, 2, name, True):
        for plain, whole in zip(r["outs"]["plain"], r["outs"]["fused"], strict=True):
            assert torch.equal(plain, whole)
        saved = [a - b for a, b in zip(r["copied"]["plain"], r["copied"]["fused"], strict=True)]
        assert saved == [3 * 388] * 3, r["copied"]


def test_hierarchy_needs_ranks_numbered_node_by_node():
    from onebit_bert.distributed.policy import node_layout

    assert node_layout(5, 8, 1, 4) == 2
    with pytest.raises(ValueError, match="numbered node by node"):
        node_layout(5, 8, 0, 4)
    with pytest.raises(ValueError, match="do not split into nodes"):
        node_layout(0, 6, 0, 4)


def test_powersgd_on_cpu_tensors_is_refused_where_cuda_exists(monkeypatch):
    # torch's PowerSGD hook synchronises the tensors' device whenever CUDA is available,
    # which fails for CPU tensors: one clear error at build time instead
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="powersgd on CPU tensors .* CUDA_VISIBLE_DEVICES"):
        build_codec("powersgd", Communicator(None))


# ----------------------------------------------------------------------------- fused buffers


def _fused_vs_direct(comm):
    """The 1-bit codec on an optimizer's padded buffer (in place, and from an unpadded
    one) against the communicator's 1-bit all-reduce with an error feedback of its own."""
    from onebit_bert.distributed.codecs import OneBitCodec
    from onebit_bert.distributed.codecs.compression import ErrorFeedback, padded_size

    padded = padded_size(NUMEL, comm.world_size)
    inplace, copied = OneBitCodec(comm), OneBitCodec(comm)
    direct = ErrorFeedback(NUMEL, comm.world_size, rank=comm.rank)
    out = []
    for tensors in rank_inputs(comm.rank):
        values = torch.cat([t.reshape(-1) for t in tensors])
        a = torch.zeros(padded)
        a[:NUMEL] = values
        b = values.clone()  # no padding: the codec pads a copy
        c = a.clone()
        error = inplace.all_reduce_fused(a, NUMEL, "fused")
        copied.all_reduce_fused(b, NUMEL, "fused")
        norm = torch.linalg.vector_norm(c)
        compressed_all_reduce(comm, c, direct)
        expected = torch.linalg.vector_norm(direct.worker_error) / norm
        out.append((a, b, c, error, expected))
    inplace.reset()
    zeroed = all(not f.worker_error.any() for f in inplace.feedback.values())
    try:
        inplace.all_reduce_fused(torch.zeros(padded), NUMEL - 1, "fused")
    except ValueError as err:
        refused = str(err)
    return {"out": out, "zeroed": zeroed, "refused": refused}


@pytest.mark.parametrize("world_size", [1, 2])
def test_onebit_codec_on_a_fused_buffer_is_the_communicators_all_reduce(world_size):
    ranks = run_ranks(_fused_vs_direct, world_size) if world_size > 1 else [
        _fused_vs_direct(one_rank())]  # fmt: skip
    for r in ranks:
        for a, b, c, error, expected in r["out"]:
            assert torch.equal(a, c)  # in place, bit for bit, padding included
            assert torch.equal(b, c[:NUMEL])
            assert torch.equal(error, expected)
            assert not a[NUMEL:].any()
        assert r["zeroed"]
        assert "cover 388 elements but the fused buffer has 387" in r["refused"]


def _per_tensor_vs_separate(comm):
    """onebit_tensor on two tensors (as a list and as a fused buffer with sizes) against
    the fused onebit codec on each tensor alone; and the per-step error of a low-noise
    layer beside a large one, fused (one chunk scale) and per tensor."""
    from onebit_bert.distributed.codecs import OneBitCodec, build_codec
    from onebit_bert.distributed.codecs.compression import padded_size

    g = torch.Generator().manual_seed(7 + comm.rank)
    large = torch.randn(96, generator=g) * 100.0
    small = 0.01 + 0.001 * torch.randn(40, generator=g)
    listed = build_codec("onebit_tensor", comm)
    fused_per_tensor = build_codec("onebit_tensor", comm)
    alone = OneBitCodec(comm)
    a, b = large.clone(), small.clone()
    listed.all_reduce([a, b], "k")
    buffer = torch.zeros(padded_size(136, comm.world_size))
    buffer[:136] = torch.cat([large, small])
    error = fused_per_tensor.all_reduce_fused(buffer, 136, "k", [96, 40])
    c, d = large.clone(), small.clone()
    alone.all_reduce([c], "k/0")
    alone.all_reduce([d], "k/1")
    shared = OneBitCodec(comm)
    e = torch.cat([large, small])
    shared.all_reduce([e], "k")
    return {
        "listed": (a, b),
        "fused": buffer[:136].clone(),
        "alone": (c, d),
        "error": error,
        "inputs": (large, small),
        "shared": e,
        "keys": sorted(listed.state_dict()),
    }


def test_onebit_tensor_compresses_each_tensor_with_its_own_scales():
    ranks = run_ranks(_per_tensor_vs_separate, 2)
    exact_small = (ranks[0]["inputs"][1] + ranks[1]["inputs"][1]) / 2
    for r in ranks:
        (a, b), (c, d) = r["listed"], r["alone"]
        assert torch.equal(a, c) and torch.equal(b, d)
        assert torch.equal(r["fused"], torch.cat([c, d]))
        assert r["error"] is None and r["keys"] == ["k/0", "k/1"]
        # the small layer: its own scale keeps it near its mean; the shared chunk scale of
        # the fused buffer throws it to the large layer's magnitude
        per_tensor = (b - exact_small).norm() / exact_small.norm()
        shared = (r["shared"][96:] - exact_small).norm() / exact_small.norm()
        assert per_tensor < 1.0 < shared


@pytest.mark.parametrize(("world_size", "bucket_numel"), [(2, None), (4, 64)])
def test_onebit_tensor_sends_every_tensor_in_one_exchange_with_the_same_numbers(
    world_size, bucket_numel
):
    """onebit_tensor on four tensors of unequal sizes (one of them over several buckets),
    three steps so that the errors carry over, against the fused codec on each tensor
    alone; and the collectives the per-tensor codec issues in a step."""
    ranks = run_ranks(per_tensor_calls, world_size, (300, 7, 64, 1), 3, bucket_numel)
    for r in ranks:
        for batched, separate, collectives in zip(r["batched"], r["alone"], r["collectives"],
                                                  strict=True):  # fmt: skip
            for a, b in zip(batched, separate, strict=True):
                assert torch.equal(a, b)  # bit for bit, every tensor, every step
            assert collectives == ["all_to_all_async", "all_gather_async"]
        assert r["errors"].keys() == r["alone_errors"].keys() == {f"m/{i}" for i in range(4)}
        for key, error in r["errors"].items():
            assert torch.equal(error, r["alone_errors"][key])
    for a, b in zip(ranks[0]["batched"][-1], ranks[-1]["batched"][-1], strict=True):
        assert torch.equal(a, b)  # the same average on every rank


def _ddp_per_tensor(comm):
    """A two-layer model under DDP with the onebit_tensor codec's hook, against the same
    codec applied by hand to this rank's gradients, each tensor on its own."""
    from torch.nn.parallel import DistributedDataParallel

    from onebit_bert.distributed.codecs import build_codec

    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    hooked = build_codec("onebit_tensor", comm)
    ddp.register_comm_hook(None, hooked.ddp_hook())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(comm.rank))
    ddp(x).pow(2).sum().backward()
    alone = [p.clone().requires_grad_() for p in reference]
    hidden = torch.nn.functional.linear(x, alone[0], alone[1])
    torch.nn.functional.linear(hidden, alone[2], alone[3]).pow(2).sum().backward()
    by_hand = [p.grad.clone() for p in alone]
    build_codec("onebit_tensor", comm).all_reduce(by_hand, "k")
    return {"hooked": [p.grad.clone() for p in model.parameters()], "by_hand": by_hand,
            "keys": sorted(hooked.state_dict())}  # fmt: skip


def test_the_per_tensor_ddp_hook_compresses_each_gradient_on_its_own():
    ranks = run_ranks(_ddp_per_tensor, 2)
    for r in ranks:
        assert len(r["keys"]) == 4 and all(k.startswith("grad/0/") for k in r["keys"])
        for got, want in zip(r["hooked"], r["by_hand"], strict=True):
            torch.testing.assert_close(got, want)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["hooked"], ranks[1]["hooked"],
                                                 strict=True))  # fmt: skip
