"""Device-true timing (onebit_bert/timing.py): the host's clock on the CPU; on CUDA, event
pairs filed while a step runs and resolved once it has waited for the device (the CUDA
half runs in tests/test_gpu.py)."""

from __future__ import annotations

import pytest

from onebit_bert.distributed.comm import CommStats
from onebit_bert.timing import PERF_COUNTER, DeviceClock, PendingTimings


class FakeEvent:
    """A CUDA event at ``ms`` milliseconds, completed unless ``done=False``."""

    def __init__(self, ms: float, done: bool = True):
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.ms - self.ms


def test_the_cpu_clock_is_the_hosts():
    clock = DeviceClock("cpu")
    assert clock.name == PERF_COUNTER and not clock.events
    start = clock.mark()
    assert clock.seconds(start, clock.mark()) >= 0.0
    assert clock.seconds(1.0, 3.5) == 2.5


def test_pending_pairs_go_to_their_stats_and_only_the_chosen_ones_are_returned():
    pending, mine, other = PendingTimings(), CommStats(), CommStats()
    mine.add("momentum", 100, 0.0)  # counted at launch, seconds still unknown
    pending.add(mine, "parameters", FakeEvent(0), FakeEvent(500))  # before the step
    pending.add(mine, "momentum", FakeEvent(1000), FakeEvent(1250))
    pending.add(other, "momentum", FakeEvent(0), FakeEvent(2000))
    pending.add(mine, "statistics", FakeEvent(3000), FakeEvent(3010))  # after the step
    chosen = pending.resolve(since=1, upto=3)
    assert len(pending) == 0
    assert chosen == {id(mine): {"momentum": 0.25}, id(other): {"momentum": 2.0}}
    # every pair's seconds reach its statistics, chosen or not
    assert mine.by_kind["momentum"] == [100, 0.25, 1]
    assert mine.by_kind["parameters"][1] == pytest.approx(0.5)
    assert mine.by_kind["statistics"][1] == pytest.approx(0.01)
    assert mine.seconds == pytest.approx(0.76) and other.seconds == pytest.approx(2.0)
    assert pending.resolve() == {}


def test_unresolved_pairs_do_not_pile_up_in_a_loop_that_never_resolves():
    pending, stats = PendingTimings(limit=3), CommStats()
    for i in range(3):
        pending.add(stats, "gradients", FakeEvent(10 * i), FakeEvent(10 * i + 2))
    assert len(pending) == 3 and stats.seconds == 0.0
    pending.add(stats, "gradients", FakeEvent(100), FakeEvent(101, done=False))
    # the finished head was filed; the unfinished pair waits
    assert len(pending) == 1 and stats.seconds == pytest.approx(0.006)


def test_training_metrics_name_their_clock_and_add_up(tiny_corpus, tmp_path):
    from onebit_bert.config import from_dict
    from onebit_bert.distributed import init_distributed
    from pretrain.config import PretrainConfig
    from pretrain.train import Trainer
    from tests.helpers.runs import tiny_config

    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 2})
    trainer = Trainer(from_dict(PretrainConfig, cfg), init_distributed(backend="gloo", env={}))
    try:
        metrics = trainer.step_metrics(trainer.train_step(1))
    finally:
        trainer.logger.close()
        trainer.release()
    assert metrics["clock"] == PERF_COUNTER
    phases = ("forward_backward_seconds", "grad_sync_seconds", "optimizer_seconds")
    assert all(metrics[k] >= 0 for k in phases)
    assert sum(metrics[k] for k in phases) == pytest.approx(metrics["step_seconds"])
