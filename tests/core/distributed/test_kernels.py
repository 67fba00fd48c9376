"""The fused kernels (onebit_bert.kernels) against the reference, on the CPU in Triton's
interpreter; the same checks on a GPU are in tests/test_gpu.py.

Each check (tests/helpers/kernel_checks.py) runs in a child process started with
``TRITON_INTERPRET=1``: Triton fixes when it is first imported whether its library runs
compiled or interpreted, so this process's mode must not depend on what ran before.
Without Triton these tests are skipped (``pip install '.[gpu]'``, which ``make setup``
does); the kernel selection is checked either way.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from onebit_bert.distributed.codecs import OneBitCodec
from onebit_bert.distributed.codecs.compression import SignOps, sign_ops
from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import triton_available, use_fused
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


@pytest.mark.skipif(not triton_available(), reason="needs Triton (pip install '.[gpu]')")
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_fused_kernels_in_the_interpreter_match_the_reference(check):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    code = f"from tests.helpers.kernel_checks import CHECKS; CHECKS[{check!r}]('cpu')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, f"{check} failed:\n{run.stdout[-3000:]}{run.stderr[-6000:]}"
