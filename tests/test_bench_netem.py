"""The emulated-cluster benchmark, as a 2-host, 2-step smoke (root only): it builds the
namespaces, runs LAMB, 1-bit LAMB and the compute-only runs through the real pretraining
stage, reports consistent numbers, and leaves no namespace or bridge behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import netem

REPO = Path(__file__).resolve().parents[1]


REASON = netem.check_privileges() if sys.platform == "linux" else "not Linux"


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def test_without_root_it_says_so_and_exits(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        netem.main(["--data", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "needs root" in capsys.readouterr().err


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_two_hosts_two_steps(tiny_corpus, tmp_path):
    before_ns, before_links = _netns_names(), _links()
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.netem",
            "--data",
            str(tiny_corpus),
            "--model",
            "bert-tiny",
            "--batch",
            "8",
            "--bandwidths",
            "200",
            "--world-sizes",
            "2",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--freeze-step",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "netem.json").read_text())
    assert (out / "netem.png").stat().st_size > 1000
    (row,) = summary["results"]
    assert (row["bandwidth_mbit"], row["world_size"]) == (200, 2)
    for key in ("lamb_samples_per_s", "onebit_samples_per_s", "compute_only_samples_per_s"):
        assert row[key] > 0
    assert 0 < row["lamb_comm_fraction"] < 1
    assert row["speedup"] == pytest.approx(row["onebit_samples_per_s"] / row["lamb_samples_per_s"])
    # 1-bit LAMB's compression stage sends far fewer bytes, by both counts, and the
    # interface saw what the communicator counted (plus headers and acknowledgements).
    assert row["bytes_ratio"] > 5 and row["counted_bytes_ratio"] > 5
    for run in ("lamb_bytes_per_step", "onebit_bytes_per_step"):
        assert 0.95 < row[run]["wire_over_counted"] < 1.25, row[run]
    whole = summary["whole_run"]["2"]
    assert whole["max_steps"] > whole["freeze_step"] > 0 and whole["reduction"] > 1
    assert _netns_names() == before_ns and _links() == before_links
