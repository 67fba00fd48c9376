"""Flushing subnormal floats: the pretraining option reaches every torch thread when set at
start-up and refuses to run half-set, and the bench that measures what it buys times both
settings and counts what it flushes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bench.denormals import main as denormals_main
from bench.denormals import subnormal_count, time_passes
from onebit_bert.config import from_dict
from pretrain.config import PretrainConfig
from pretrain.train import denormals_flushed, train

TINY = torch.finfo(torch.float32).tiny
ROOT = Path(__file__).resolve().parents[2]


def _product() -> float:
    """1e-30 * 1e-10: 1e-40, a subnormal fp32 value unless the CPU flushes it."""
    return float(torch.tensor([1e-30]) * torch.tensor([1e-10]))


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with two torch threads: the CPU's flag is per thread
    and stays set, so it is never switched in the test process itself."""
    prelude = "import torch; torch.set_num_threads(2); "
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)  # fmt: skip


def test_the_option_flushes_on_every_thread_when_set_before_they_start():
    assert PretrainConfig().flush_denormal is False
    assert from_dict(PretrainConfig, {"flush_denormal": True}).flush_denormal is True
    assert 0 < _product() < TINY and not denormals_flushed()
    # set at start-up, as python -m pretrain does: every thread flushes
    done = _python("from pretrain.train import flush_denormals, denormals_flushed; "
                   "flush_denormals(); print(denormals_flushed())")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]
    # set after torch started its threads: only the main thread's share would flush
    late = _python("torch.full((1 << 20,), 1.0).mul(2).sum(); "
                   "from pretrain.train import flush_denormals; flush_denormals()")  # fmt: skip
    assert late.returncode != 0 and "threads were started before it was set" in late.stderr
    # a run asked to flush in a process that does not is refused before any work
    with pytest.raises(ValueError, match="does not flush subnormal floats"):
        train(PretrainConfig(flush_denormal=True), ctx=None)


class _Tiny(nn.Module):
    def forward(self, x):
        return x * 1e-39  # subnormal for |x| of order 1


class _Scaled(nn.Module):
    """A loss module one of whose modules outputs subnormal values."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.tiny = _Tiny()

    def forward(self, x):
        return (self.tiny(self.first(x)) * 1e39).square().mean(), None


def test_the_bench_times_both_settings_and_counts_what_is_flushed():
    assert subnormal_count([torch.tensor([1e-40, 0.0, 1.0, -1e-41]), None]) == 2
    torch.manual_seed(0)
    module, x = _Scaled(), torch.randn(16, 8)
    expected_outputs = subnormal_count([module.first(x).detach() * 1e-39])
    assert expected_outputs > 100  # nearly all 128 of them
    out = time_passes(module, {"x": x}, repeats=3)
    assert len(out["runs_off"]) == len(out["runs_on"]) == 3
    assert out["seconds_off"] == sorted(out["runs_off"])[1]  # the median
    assert out["speedup"] == pytest.approx(out["seconds_off"] / out["seconds_on"], rel=0.05)
    assert out["output_subnormal_off"] == expected_outputs
    module.zero_grad()
    module(x)[0].backward()
    assert out["gradient_subnormal_off"] == subnormal_count(p.grad for p in module.parameters())
    assert out["gradient_entries"] == sum(p.numel() for p in module.parameters())
    assert 0 < _product() < TINY  # the bench leaves the default behind


def test_the_bench_names_a_run_without_checkpoints(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        denormals_main(["--run", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no finished checkpoint" in capsys.readouterr().err
