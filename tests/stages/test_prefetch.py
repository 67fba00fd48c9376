"""Training micro-batches built one ahead on a background thread (pretrain.data.Prefetcher):
the same batches as building each when needed, errors surfacing in the training thread,
and a run that is identical with data.prefetch on and off."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.data import Prefetcher


def _recording_build(threads: list[str]):
    def build(n: int, fill: int) -> dict:
        threads.append(threading.current_thread().name)
        if n < 0:
            raise ValueError(f"no batch {n}")
        return {"x": np.full(n, fill, dtype=np.int64)}

    return build


def test_the_next_batch_is_built_behind_the_current_one():
    threads: list[str] = []
    prefetcher = Prefetcher(_recording_build(threads), pin=False)
    try:
        arrays, tensors = prefetcher.get("a", (3, 1), then=("b", (4, 2)))
        assert threads[0] == threading.main_thread().name  # nothing ahead yet: built here
        assert torch.equal(tensors["x"], torch.full((3,), 1))
        assert np.shares_memory(arrays["x"], tensors["x"].numpy())
        arrays, tensors = prefetcher.get("b", (4, 2), then=("c", (5, 3)))
        assert threads[1].startswith("prefetch-batches")  # "b" came from the thread
        assert torch.equal(tensors["x"], torch.full((4,), 2))
        # another key than the one ahead: that one is dropped, this one built here
        _, tensors = prefetcher.get("z", (2, 9))
        assert torch.equal(tensors["x"], torch.full((2,), 9))
        assert threads[-1] == threading.main_thread().name
        # a failure on the thread is raised where the batch is asked for
        prefetcher.get("d", (1, 0), then=("bad", (-1, 0)))
        with pytest.raises(ValueError, match="no batch -1"):
            prefetcher.get("bad", (-1, 0))
    finally:
        prefetcher.close()


def test_without_a_thread_every_batch_is_built_when_asked():
    threads: list[str] = []
    prefetcher = Prefetcher(_recording_build(threads), pin=False, enabled=False)
    prefetcher.get("a", (3, 1), then=("b", (4, 2)))
    prefetcher.get("b", (4, 2))
    prefetcher.close()
    assert threads == [threading.main_thread().name] * 2


def test_a_run_is_the_same_with_and_without_prefetching(tiny_corpus, tmp_path):
    from onebit_bert.distributed import Communicator
    from tests.helpers.runs import mlm_losses, tiny_config, train_in_process

    runs = {}
    for prefetch in (True, False):
        cfg = tiny_config(
            tiny_corpus,
            tmp_path / f"prefetch-{prefetch}",
            **{"schedule.max_steps": 4, "batch.micro_batch_size": 4, "data.prefetch": prefetch},
        )
        result = train_in_process(Communicator(None), cfg)
        runs[prefetch] = (mlm_losses(Path(cfg["run_dir"])), result["model"])
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 4
    for name, tensor in runs[True][1].items():
        assert torch.equal(tensor, runs[False][1][name]), name
