"""Fused kernels for the optimizer steps, and the choice between them and the reference.

The reference is plain torch (the same code on every device): the 1-bit all-reduce's
per-bucket arithmetic in :mod:`onebit_bert.distributed.codecs.compression`, LAMB's and 1-bit
LAMB's updates as ``torch._foreach_*`` calls. It defines every result: the golden
trajectories and the CPU tier run it, bit for bit as before. The fused kernels
(:mod:`onebit_bert.kernels.signs`, :mod:`onebit_bert.kernels.multi_tensor`) are Triton
kernels that do the same arithmetic in fewer passes over memory; they run on CUDA, or on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, for tests). Where the
arithmetic is exact (signs, packing, unpacking, the server's sum of ±scales) they give the
reference's bits; where it sums (norms, scales) or may fuse a multiply with an add, they
agree within floating-point tolerance.

``kernels`` settings (optimizer.kernels): ``auto`` picks the fused kernels on CUDA when
Triton is importable (it ships with torch's CUDA builds) and the reference otherwise;
``reference`` and ``fused`` force one (``fused`` fails with a clear message where it
cannot run).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import torch

KERNELS = ("auto", "reference", "fused")
"""The accepted ``kernels`` settings."""

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Triton's compiler options for every launch of a fused kernel: multiplies fused with
adds, as Triton up to 3.9 does by default. Set explicitly because Triton 3.10 turns the
default off: the kernels' results then stay those of every Triton from 3.2 on (and the
warning Triton 3.9 gives when the option is left unset goes). The interpreter ignores it."""


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed here. Found without importing it: Triton fixes at its
    import whether its own library functions run compiled or interpreted."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``), which takes
    CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _version(package: str) -> tuple[int, ...] | None:
    """``package``'s installed version as numbers (release part only), or None where it
    is not installed or its version does not start with a number."""
    from importlib import metadata

    try:
        text = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() != len(part):  # "0rc1": the release part ends here
            break
    return tuple(numbers) or None


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels here, or None. Before Triton 3.7
    the interpreter turns a scalar loaded from memory (a loop bound) into a Python int in a
    way NumPy 2.4 and later refuse; compiled for a GPU the same kernels build with Triton
    3.2 and later."""
    triton, numpy = _version("triton"), _version("numpy")
    if triton is None or numpy is None or triton >= (3, 7) or numpy < (2, 4):
        return None
    return (
        f"Triton {'.'.join(map(str, triton))}'s interpreter cannot run the fused kernels with "
        f"NumPy {'.'.join(map(str, numpy))} (it needs Triton 3.7 or later, or NumPy below "
        f"2.4; make setup installs a Triton that can); on a GPU they compile either way"
    )


def check_kernels(kernels: str) -> None:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {kernels!r}")


def use_fused(device: torch.device | str, kernels: str = "auto") -> bool:
    """Whether buffers on ``device`` go through the fused kernels under setting ``kernels``
    (``auto``: on CUDA with Triton). ``fused`` where they cannot run raises, naming why."""
    check_kernels(kernels)
    device = torch.device(device)
    if kernels == "reference":
        return False
    if kernels == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError(
            "kernels=fused needs Triton (pip install 'onebit-bert[gpu]', or a CUDA build of "
            "torch, which ships it); use kernels=auto or reference"
        )
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"kernels=fused runs on CUDA, or on the CPU under Triton's interpreter "
            f"(TRITON_INTERPRET=1); the buffers are on {device}"
        )
    if device.type != "cuda" and interpreter_problem() is not None:
        raise RuntimeError(f"kernels=fused on {device}: {interpreter_problem()}")
    return True


_loaded: dict[tuple[str, bool], object] = {}


def triton_module(name: str):
    """The Triton kernel definitions in ``triton_src/<name>.py``, loaded for the current
    Triton mode. The folder is not a package, so importing every module of
    ``onebit_bert`` never needs Triton. Triton decides when a kernel is defined whether it
    is compiled or interpreted (``TRITON_INTERPRET``), so each mode gets its own copy; its
    own library functions (``tl.sum``) are fixed when Triton is first imported, so a
    process that interprets sets ``TRITON_INTERPRET=1`` before that."""
    from pathlib import Path

    key = (name, interpreting())
    if key not in _loaded:
        path = Path(__file__).with_name("triton_src") / f"{name}.py"
        mode = "interpreted" if key[1] else "compiled"
        spec = importlib.util.spec_from_file_location(f"{__name__}.{name}_{mode}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[key] = module
    return _loaded[key]
