"""Whether ``torch.compile`` can build its CPU kernels here."""

from __future__ import annotations

import os
import shutil

import pytest

CXX = [c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)]
"""The C++ compilers found: Inductor builds the CPU kernels of a compiled model with one."""

NEEDS_CXX = pytest.mark.skipif(
    not CXX, reason="torch.compile on the CPU needs a C++ compiler (g++: apt install g++)"
)
"""For tests that run a compiled model on the CPU."""
