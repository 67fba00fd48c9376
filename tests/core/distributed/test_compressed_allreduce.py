"""Sign packing and the error-compensated 1-bit all-reduce, against a plain simulation."""

from __future__ import annotations

import pytest
import torch

from onebit_bert.distributed import Communicator, ErrorFeedback
from onebit_bert.distributed.codecs import compressed_all_reduce, packing
from onebit_bert.distributed.codecs.packing import pack_signs, unpack_signs
from tests.helpers.compression import compressed_calls, rank_inputs, simulate
from tests.helpers.distributed_harness import run_ranks

# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("numel", [8, 16, 104, 8 * 1001, 8 * 4097])
def test_pack_round_trip(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::7] = 0.0  # sign(0) = +1
    x[1::11] = -0.0  # -0.0 >= 0 as well
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == numel // 8
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), expected)
    assert torch.equal(unpack_signs(packed, 2.5), 2.5 * expected)
    out = torch.empty(numel)
    unpack_signs(packed, torch.tensor(0.5), out=out)
    assert torch.equal(out, 0.5 * expected)


@pytest.mark.parametrize("scale", [1.0, 2.5, 0.0, -0.0, 1e-30, 3e38, -0.75])
def test_unpacking_by_shifts_gives_the_table_lookups_bits(scale):
    # The path GPUs take (bits shifted out, an elementwise select), run on the CPU against
    # the CPU's table lookup: the same bits for every byte value, scale and output form.
    packed = torch.cat([torch.arange(256, dtype=torch.uint8), torch.tensor([0, 255, 170, 85])])
    packed = packed.to(torch.uint8)
    want = unpack_signs(packed, torch.tensor(scale))
    got = packing._unpack_by_shifts(packed, torch.tensor(scale), None)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    out = torch.full((8 * packed.numel(),), float("nan"))
    assert packing._unpack_by_shifts(packed, scale, out) is out
    assert torch.equal(out.view(torch.int32), unpack_signs(packed, scale).view(torch.int32))


def test_pack_bit_order():
    x = -torch.ones(16)
    x[0] = 1.0  # byte 0, bit 0
    x[10] = 1.0  # byte 1, bit 2
    assert pack_signs(x).tolist() == [1, 4]


def test_pack_rejects_bad_lengths():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(13))
    with pytest.raises(ValueError, match="flat uint8"):
        unpack_signs(torch.zeros(3, dtype=torch.int32))


# ----------------------------------------------------------------------------- simulation


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,numel,bucket",
    [(1, 13, None), (2, 13, None), (2, 1001, 64), (4, 1, None), (4, 997, None), (4, 5000, 640)],
)
def test_compressed_allreduce_matches_simulation(world_size, numel, bucket):
    calls = 5
    results = run_ranks(compressed_calls, world_size, numel, calls, bucket)
    padded = results[0]["outs"][0].numel()
    assert padded % (8 * world_size) == 0 and padded - numel < 8 * world_size
    worker_errors = [torch.zeros(padded) for _ in range(world_size)]
    server_errors = [torch.zeros(padded // world_size) for _ in range(world_size)]
    for call in range(calls):
        inputs = [rank_inputs(r, call, numel, padded) for r in range(world_size)]
        expected = simulate(inputs, worker_errors, server_errors, numel, bucket)
        for r, res in enumerate(results):
            got = res["outs"][call]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            assert torch.equal(got, results[0]["outs"][call]), f"rank {r} differs from rank 0"
            assert torch.all(got[numel:] == 0), "padding picked up a value"
    for r, res in enumerate(results):
        torch.testing.assert_close(res["worker_error"], worker_errors[r], rtol=0, atol=1e-6)
        torch.testing.assert_close(res["server_error"], server_errors[r], rtol=0, atol=1e-6)
        assert torch.all(res["worker_error"][numel:] == 0)


def test_bucketing_gives_each_bucket_its_own_scales():
    # One bucket: one server scale per chunk (2 on 2 ranks). Five buckets: ten.
    one = run_ranks(compressed_calls, 2, 4000, 1, None)[0]["outs"][0]
    many = run_ranks(compressed_calls, 2, 4000, 1, 800)[0]["outs"][0]
    assert len(torch.unique(one[:4000].abs())) <= 2  # one scale per server chunk
    assert len(torch.unique(many[:4000].abs())) > 2


def _feedback_tracking(comm, numel, calls):
    feedback = ErrorFeedback(numel, comm.world_size, rank=comm.rank)
    g = torch.Generator().manual_seed(7 + comm.rank)
    fixed = torch.zeros(feedback.padded_numel)
    fixed[:numel] = torch.randn(numel, generator=g) + 0.3 * comm.rank
    total = torch.zeros_like(fixed)
    errors = {}
    for call in range(1, calls + 1):
        x = fixed.clone()
        compressed_all_reduce(comm, x, feedback)
        total += x
        if call in (1, 10, calls):
            errors[call] = total / call
    return {"fixed": fixed, "means": errors}


@pytest.mark.parametrize("world_size", [2, 4])
def test_error_feedback_mean_tracks_input_mean(world_size):
    calls = 400
    results = run_ranks(_feedback_tracking, world_size, 300, calls)
    target = sum(r["fixed"] for r in results) / world_size
    rel = {c: ((m - target).norm() / target.norm()).item() for c, m in results[0]["means"].items()}
    # One 1-bit call is a coarse estimate; error feedback makes the running mean converge.
    assert rel[1] > 0.3
    assert rel[calls] < 0.02
    assert rel[calls] < rel[10] < rel[1]


# ----------------------------------------------------------------------------- errors


def test_compressed_allreduce_rejects_mismatched_world_size():
    comm = Communicator(None)
    feedback = ErrorFeedback(100, 4, rank=0)
    with pytest.raises(ValueError, match="world size 4 but this communicator has 1"):
        compressed_all_reduce(comm, torch.zeros(feedback.padded_numel), feedback)


def test_compressed_allreduce_rejects_wrong_buffer():
    comm = Communicator(None)
    feedback = ErrorFeedback(100, 1)
    with pytest.raises(ValueError, match="flat buffer of 104"):
        compressed_all_reduce(comm, torch.zeros(100), feedback)
    with pytest.raises(ValueError, match="fp32"):
        compressed_all_reduce(comm, torch.zeros(104, dtype=torch.float64), feedback)


def test_error_feedback_bad_arguments():
    with pytest.raises(ValueError, match="at least one element"):
        ErrorFeedback(0, 2)
    with pytest.raises(ValueError, match="outside world size"):
        ErrorFeedback(10, 2, rank=2)
    with pytest.raises(ValueError, match="below the minimum"):
        ErrorFeedback(1000, 4, bucket_numel=16)


def test_error_feedback_state_round_trip_and_reset():
    a = ErrorFeedback(50, 2, rank=1)
    a.worker_error.normal_()
    a.server_error.normal_()
    b = ErrorFeedback(50, 2, rank=1)
    assert b.load_state_dict(a.state_dict())
    assert torch.equal(b.worker_error, a.worker_error)
    c = ErrorFeedback(50, 4, rank=1)
    with pytest.warns(UserWarning, match="world size 2"):
        assert not c.load_state_dict(a.state_dict())
    assert torch.all(c.worker_error == 0) and torch.all(c.server_error == 0)
    with pytest.raises(ValueError, match="different model"):
        ErrorFeedback(51, 2, rank=1).load_state_dict(a.state_dict())


def test_kept_values_are_read_as_the_errors_they_stand_for():
    """Values stored with their buckets' scales pending read back, through the errors,
    the state and a reset, as ``v - s·sign(v)`` on the real elements and 0 after them,
    with the reference's bits; settling is done once and leaves nothing pending."""
    from onebit_bert.distributed.codecs.packing import pack_signs, unpack_signs

    fb = ErrorFeedback(45, 2, rank=1, bucket_numel=32)  # buckets of 32 and 16; 45 real
    assert [b.real for b in fb.buckets] == [32, 13]
    v = torch.randn(48, generator=torch.Generator().manual_seed(0))
    v[:4] = torch.tensor([0.0, -0.0, 1.5, -1.5])
    server = torch.randn(24, generator=torch.Generator().manual_seed(1))
    fb.worker_values.copy_(v)
    fb.server_values.copy_(server)
    fb.worker_scale.copy_(torch.tensor([0.75, 0.5]))
    fb.server_scale.copy_(torch.tensor([0.25, 2.0]))
    fb.pending = True
    want = torch.zeros(48)
    for a, b, real, s in [(0, 32, 32, 0.75), (32, 48, 13, 0.5)]:
        # the reference's error for these values and this scale (compress_in_place)
        want[a:b] = v[a:b] - unpack_signs(pack_signs(v[a:b]), torch.tensor(s))
        want[a + real : b] = 0
    state = fb.state_dict()
    assert not fb.pending and torch.all(fb.worker_scale == 0) and torch.all(fb.server_scale == 0)
    assert torch.equal(state["worker_error"], want)
    assert torch.equal(fb.worker_error, want)
    # rank 1 serves the second half of each bucket: 16 real of 16, then 5 of 8
    s_want = torch.zeros(24)
    for a, b, real, s in [(0, 16, 16, 0.25), (16, 24, 5, 2.0)]:
        s_want[a:b] = server[a:b] - unpack_signs(pack_signs(server[a:b]), torch.tensor(s))
        s_want[a + real : b] = 0
    assert torch.equal(fb.server_error, s_want)
    fb.settle()  # nothing pending: the errors stay
    assert torch.equal(fb.worker_error, want)
    fb.worker_scale.fill_(3.0)
    fb.pending = True
    fb.reset()
    assert not fb.pending and not fb.worker_error.any() and not fb.worker_scale.any()
    other = ErrorFeedback(45, 2, rank=1, bucket_numel=32)
    other.worker_scale.fill_(1.0)
    other.pending = True
    assert other.load_state_dict(state)
    assert not other.pending and torch.equal(other.worker_error, want)
