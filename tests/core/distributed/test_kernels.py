"""The fused kernels (onebit_bert.kernels) against the reference, on the CPU in Triton's
interpreter; the same checks on a GPU are in tests/test_gpu.py.

The checks (tests/helpers/kernel_checks.py) run in one child process started with
``TRITON_INTERPRET=1``: Triton fixes when it is first imported whether its library runs
compiled or interpreted, so this process's mode must not depend on what ran before.
Without Triton these tests are skipped (``pip install '.[gpu]'``, which ``make setup``
does); the kernel selection is checked either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onebit_bert.distributed.codecs import OneBitCodec
from onebit_bert.distributed.codecs.compression import SignOps, sign_ops
from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import interpreter_problem, triton_available, use_fused
from tests.helpers.kernel_checks import CHECKS
from tests.helpers.paths import REPO


def test_the_reference_is_chosen_on_the_cpu_unless_fused_is_asked_for(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_fused("cpu", "auto") and not use_fused("cpu", "reference")
    assert isinstance(sign_ops("cpu"), SignOps)
    assert OneBitCodec(Communicator(None)).sign_ops.name == "reference"
    with pytest.raises(RuntimeError, match="kernels=fused"):
        use_fused("cpu", "fused")
    with pytest.raises(ValueError, match="kernels must be one of"):
        use_fused("cpu", "fast")


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch):
    """Triton's interpreter before 3.7 cannot run the kernels with NumPy 2.4 or later: the
    fused kernels on the CPU are then refused with the versions and the way out, instead of
    failing inside a kernel."""
    from importlib import metadata

    import onebit_bert.kernels as kernels

    for text, numbers in [("2.11.0+cu130", (2, 11, 0)), ("3.0.0rc1", (3, 0, 0)), ("dev", None)]:
        with monkeypatch.context() as patched:
            patched.setattr(metadata, "version", lambda name, text=text: text)
            assert kernels._version("triton") == numbers, text
    versions = {"triton": (3, 6, 0), "numpy": (2, 5, 2)}
    monkeypatch.setattr(kernels, "_version", lambda name: versions.get(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.interpreter_problem.cache_clear()
    try:
        problem = kernels.interpreter_problem()
        assert "Triton 3.6.0's interpreter" in problem and "NumPy 2.5.2" in problem
        if triton_available():
            with pytest.raises(RuntimeError, match="needs Triton 3.7 or later"):
                use_fused("cpu", "fused")
        for triton, numpy in (((3, 7, 1), (2, 5, 2)), ((3, 6, 0), (2, 3, 5)), (None, (2, 5))):
            versions.update(triton=triton, numpy=numpy)
            kernels.interpreter_problem.cache_clear()
            assert kernels.interpreter_problem() is None, (triton, numpy)
    finally:
        kernels.interpreter_problem.cache_clear()


def test_a_bucket_past_the_kernels_32_bit_indices_is_refused_before_any_kernel():
    """The sign kernels index a bucket's elements in int32: a bucket of 2**31 elements
    (8 GiB of fp32; a model of over 2 billion parameters in one bucket) would read and
    write out of bounds on a GPU. Worker, server and expansion refuse it with the setting
    to change, before a kernel runs (meta tensors: nothing is allocated)."""
    import torch

    from onebit_bert.kernels.signs import MAX_BUCKET, FusedSignOps

    ops = FusedSignOps()
    big = torch.empty(MAX_BUCKET + 8, device="meta")
    with pytest.raises(ValueError, match="set optimizer.bucket_numel to at most"):
        ops.compress(big, big, big.numel(), None, rows=1)
    with pytest.raises(ValueError, match="past the fused kernels' limit"):
        ops.serve(torch.empty(1, 4, dtype=torch.uint8, device="meta"), big, big.numel(), None)
    with pytest.raises(ValueError, match="past the fused kernels' limit"):
        ops.expand(torch.empty(1, 4, dtype=torch.uint8, device="meta"), big, big.numel(), None)
    assert ops._grid(MAX_BUCKET // 8) == (-(-MAX_BUCKET // 8 // ops.block),)  # the largest


@pytest.mark.skipif(not triton_available(), reason="needs Triton (pip install '.[gpu]')")
@pytest.mark.skipif(
    triton_available() and interpreter_problem() is not None, reason=str(interpreter_problem())
)
def test_an_optimizer_whose_bucket_the_kernels_cannot_take_is_refused_when_built(monkeypatch):
    """The kernels' bucket limit is met when the optimizer is built, not at the first
    compression step after a whole warmup stage (the limit lowered to 64 elements here);
    buckets within it are taken."""
    import torch

    from onebit_bert.kernels import signs
    from onebit_bert.optim import OneBitLamb

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused kernels on the CPU
    monkeypatch.setattr(signs, "MAX_BUCKET", 64)
    params = [torch.zeros(50, requires_grad=True), torch.zeros(30, requires_grad=True)]
    comm = Communicator(None)
    with pytest.raises(ValueError, match="a 1-bit bucket of 80 elements is past"):
        OneBitLamb(params, kernels="fused", comm=comm)
    OneBitLamb(params, kernels="fused", comm=comm, bucket_numel=64)  # buckets of 64 and 16
    OneBitLamb(params, kernels="reference", comm=comm)  # the reference takes any size


def test_the_tables_tell_where_16_byte_accesses_are_safe():
    """The fused kernels access memory 16 bytes at a time (``ALIGNED``) only where every
    block starts and ends at a multiple of 4 elements and every operand's address is a
    multiple of 16 bytes; a wrong claim would make a GPU read across a boundary."""
    import torch

    from onebit_bert.kernels.multi_tensor import TensorTable

    assert TensorTable([torch.zeros(8), torch.zeros(4100)]).blocks_aligned
    assert not TensorTable([torch.zeros(8), torch.zeros(6)]).blocks_aligned  # ends at 6
    assert not TensorTable([torch.zeros(8), torch.zeros(12)], cuts=(10,)).blocks_aligned
    assert TensorTable([torch.zeros(8), torch.zeros(12)], cuts=(12,)).blocks_aligned
    flat = torch.zeros(64)
    assert flat.data_ptr() % 16 == 0  # torch's CPU allocations: 64-byte aligned
    table = TensorTable([torch.zeros(8), torch.zeros(12)])
    table.pointers("exp_avg", [flat[0:8], flat[8:20]])
    assert table._aligned["exp_avg"] == [True, True]
    table.pointers("exp_avg", [flat[2:10], flat[10:22]])  # 8 bytes past an aligned start
    assert table._aligned["exp_avg"] == [False, False]
    table.pointers("masks", [None, None])  # no mask: never read
    assert table._aligned["masks"] == [True, True]


def test_each_run_of_tensors_gets_its_own_alignment():
    """A pass is launched once per run of consecutive tensors that agree on 16-byte
    accesses, (first block, blocks, aligned), covering every block once in order; one
    misaligned gradient (as DDP's bucket views place some) leaves the others aligned;
    past MAX_RUNS runs, one launch without 16-byte accesses."""
    import torch

    from onebit_bert.kernels.multi_tensor import MAX_RUNS, TensorTable

    sizes = [4100, 8, 12, 6, 16]  # 3, 1, 1, 1, 1 blocks of 2,048; the fourth ends at 6
    table = TensorTable([torch.zeros(n) for n in sizes])
    flat = torch.zeros(sum(sizes) + 16)
    own = [torch.zeros(n) for n in sizes]
    table.pointers("params", own)
    assert table.runs(["params"]) == [(0, 5, True), (5, 1, False), (6, 1, True)]
    shifted = [own[0], flat[2:10], own[2], own[3], own[4]]  # tensor 1 8 bytes off
    table.pointers("grads", shifted)
    assert table.runs(["params", "grads"]) == [(0, 3, True), (3, 1, False), (4, 1, True),
                                               (5, 1, False), (6, 1, True)]  # fmt: skip
    table.pointers("grads", [flat[2 : 2 + n] for n in sizes])  # every one off
    assert table.runs(["params", "grads"]) == [(0, 7, False)]
    table.pointers("grads", own)
    assert table.runs(["params", "grads"]) == table.runs(["params"])
    many = TensorTable([torch.zeros(n) for n in [8, 6] * MAX_RUNS])  # alternating
    many.pointers("params", [torch.zeros(n) for n in [8, 6] * MAX_RUNS])
    assert many.runs(["params"]) == [(0, 2 * MAX_RUNS, False)]
    few = TensorTable([torch.zeros(n) for n in [8, 6] * (MAX_RUNS // 2)])
    few.pointers("params", [torch.zeros(n) for n in [8, 6] * (MAX_RUNS // 2)])
    assert len(few.runs(["params"])) == MAX_RUNS


def test_sums_made_elsewhere_are_refused_where_they_cannot_fit():
    """An overlapped step's folds write their block sums into slices of one table and hand
    a bucket's sums to the codec: a slice of the wrong length, or sums for sign ops that
    sum for themselves, is refused before anything runs."""
    import torch

    from onebit_bert.distributed.codecs.compression import ErrorFeedback
    from onebit_bert.distributed.codecs.onebit import FusedOneBitBuckets
    from onebit_bert.kernels.multi_tensor import TensorTable, onebit_fold_compensated

    p = torch.zeros(10)
    table = TensorTable([p], block=4)  # blocks of 4, 4, 2
    fold = (table, [p], [p.clone()], [p.clone()], [0], torch.zeros(1), 16, torch.ones(1), 0.9)
    with pytest.raises(ValueError, match="three contiguous tensors of 3 block sums"):
        onebit_fold_compensated(*fold, out=(torch.zeros(3), torch.zeros(3), torch.zeros(2)))
    with pytest.raises(ValueError, match="three contiguous tensors of 3 block sums"):
        onebit_fold_compensated(*fold, out=(torch.zeros(3), torch.zeros(3)))
    comm = Communicator(None)
    feedback = ErrorFeedback(16, 1, rank=0, device="cpu")
    buckets = FusedOneBitBuckets(comm, torch.zeros(16), feedback, sign_ops("cpu"))
    with pytest.raises(ValueError, match="reference sign ops cannot take a bucket's squares"):
        buckets.start(0, torch.zeros(3))


_RUN_ALL = """
import json, traceback
from tests.helpers.kernel_checks import CHECKS
failures = {}
for name in sorted(CHECKS):
    try:
        CHECKS[name]("cpu")
        failures[name] = None
    except Exception:
        failures[name] = traceback.format_exc()
print("KERNEL-CHECKS " + json.dumps(failures))
"""


@pytest.fixture(scope="module")
def interpreted_checks() -> dict[str, str | None]:
    """Every check run once, in one child process under the interpreter: each check's
    traceback, or None where it passed (one interpreter start instead of one per check)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", _RUN_ALL], cwd=REPO, env=env, capture_output=True, text=True
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("KERNEL-CHECKS ")]
    assert run.returncode == 0 and lines, (
        f"the interpreted checks did not finish:\n{run.stdout[-3000:]}{run.stderr[-6000:]}"
    )
    return json.loads(lines[-1].removeprefix("KERNEL-CHECKS "))


@pytest.mark.skipif(not triton_available(), reason="needs Triton (pip install '.[gpu]')")
@pytest.mark.skipif(
    triton_available() and interpreter_problem() is not None,
    reason=str(interpreter_problem()),
)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_fused_kernels_in_the_interpreter_match_the_reference(check, interpreted_checks):
    assert check in interpreted_checks, f"{check} did not run"
    assert interpreted_checks[check] is None, f"{check} failed:\n{interpreted_checks[check]}"
