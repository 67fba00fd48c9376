"""The fast path's host synchronisations, counted on the CPU (bench/host_syncs.py): the
optimizers' steps make none, and a training step makes a fixed number whatever the depth
of the model, never one per parameter. tests/test_gpu.py holds the same on CUDA with
torch's sync debug mode."""

from __future__ import annotations

import pytest
import torch

from bench.host_syncs import count_host_syncs
from tests.helpers.syncs import OURS, optimizer_step_syncs, training_step_syncs


def test_the_cpu_count_sees_what_would_wait_on_a_gpu():
    x = torch.arange(6.0)
    assert count_host_syncs(lambda: x.sum() * 2, "cpu")[1] == 0
    assert count_host_syncs(lambda: x.sum().item(), "cpu") == (15.0, 1)
    assert count_host_syncs(lambda: x[x > 2], "cpu")[1] == 1  # boolean mask: nonzero
    assert count_host_syncs(lambda: [float(v) for v in x], "cpu")[1] == 6


@pytest.mark.parametrize("name", OURS)
def test_optimizer_steps_make_no_host_sync(name):
    """Trust ratios, norms, clamps and 1-bit scales stay on the device: no step reads a
    value back, in any stage. (torch's AdamW reads its step counts on the CPU; on CUDA
    it runs fused, tested in tests/test_gpu.py.)"""
    counts, stages, _ = optimizer_step_syncs(name, "cpu")
    assert counts == [0] * 8, counts
    if name in ("onebit_lamb", "onebit_adam"):
        assert stages == ["warmup"] * 2 + ["compression"] * 6
    if name == "zero_one_adam":
        assert stages[-1] != stages[0], stages


def test_a_training_step_syncs_as_often_at_any_depth(tiny_corpus, tmp_path):
    """bert-tiny (2 layers) and bert-mini (4 layers, 4 heads, twice the width) make the
    same host syncs per step: one per micro-batch (HF's check of the attention mask for
    padding) and one per step (the gradient norm). The masked positions and NSP rows are
    found on the host (make_batch), not by boolean masks on the device."""
    torch.set_num_threads(1)
    tiny = training_step_syncs(tiny_corpus, tmp_path / "tiny", "bert-tiny", "cpu")
    mini = training_step_syncs(tiny_corpus, tmp_path / "mini", "bert-mini", "cpu")
    assert tiny == mini, (tiny, mini)
    micro_batches = 2  # global 16, micro 8
    assert tiny == [micro_batches + 1] * 3, tiny


def test_sites_are_counted_most_frequent_first_with_the_repository_made_relative():
    from pathlib import Path

    from bench.host_syncs import sites_by_count

    root = str(Path(__file__).resolve().parents[3])
    sites = [
        f"{root}/pretrain/train.py:331",
        "aten::nonzero",
        f"{root}/pretrain/train.py:331",
        f"{root}/onebit_bert/ddp.py:10 via /usr/lib/torch/x.py:5",
    ]
    assert sites_by_count(sites) == {
        "pretrain/train.py:331": 2,
        "aten::nonzero": 1,
        "onebit_bert/ddp.py:10 via /usr/lib/torch/x.py:5": 1,
    }
    assert sites_by_count([]) == {}
