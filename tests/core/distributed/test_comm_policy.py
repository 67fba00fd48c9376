"""The comm section in pretraining runs (real gloo ranks): a codec per kind of traffic,
exact bytes per kind, resume with codec state, the node hierarchy, the overlap of 1-bit
LAMB's and 1-bit Adam's momentum all-reduce with backward (bit for bit), and configs that
must fail. The defaults are today's trajectories bit for bit: tests/test_golden.py runs
with the default comm section."""

from __future__ import annotations

import pytest
import torch

from onebit_bert.config import from_dict
from onebit_bert.metrics_log import read_metrics
from pretrain.config import PretrainConfig
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import mlm_losses, tiny_config, train_in_process, train_on_nodes


def _records(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "stage" in r]


def _same_model(a: dict, b: dict) -> bool:
    return all(torch.equal(t, b[k]) for k, t in a.items())


def _assert_same_runs(dir_a, ranks_a: list[dict], dir_b, ranks_b: list[dict]) -> None:
    """Two runs trained alike: the same MLM losses and every rank's model, bit for bit."""
    assert mlm_losses(dir_a) == mlm_losses(dir_b)
    for a, b in zip(ranks_a, ranks_b, strict=True):
        assert _same_model(a["model"], b["model"])


# ----------------------------------------------------------------------------- overlap


def _overlap_buckets(comm, bucket_mb, bucket_numel):
    from onebit_bert.distributed.policy import CommConfig
    from onebit_bert.optim.build import OptimizerConfig
    from onebit_bert.strategies import StrategyConfig, build_strategy
    from tests.helpers.runs import dist_context
    from tests.helpers.toy import ToyConfig, build_model

    model = build_model(ToyConfig(width=4, inputs=3))
    strategy = build_strategy(
        StrategyConfig(),
        OptimizerConfig(name="onebit_lamb", bucket_numel=bucket_numel),
        model,
        model,
        dist_context(comm),
        comm_cfg=CommConfig(overlap=True, bucket_mb=bucket_mb),
    )
    return strategy.optimizer.codec.bucket_numel


def test_overlap_cuts_the_momentum_into_buckets_of_bucket_mb():
    """comm.overlap without optimizer.bucket_numel compresses in buckets of
    comm.bucket_mb (in fp32 elements); optimizer.bucket_numel, where set, wins."""
    assert run_ranks(_overlap_buckets, 2, 0.5, None) == [131_072] * 2
    assert run_ranks(_overlap_buckets, 2, 0.5, 4096) == [4096] * 2


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["onebit_lamb", "onebit_adam"])
def test_overlap_with_backward_is_bit_identical(tiny_corpus, tmp_path, optimizer):
    """Compression steps whose bucket all-reduces start during the last micro-batch's
    backward give the same parameters and losses, to the bit, as the steps that
    all-reduce after it (same buckets; no clipping in either)."""
    common = {
        "optimizer.name": optimizer,
        "optimizer.lr": 0.02 if optimizer == "onebit_lamb" else 1e-3,
        "optimizer.freeze_step": 3,
        "optimizer.bucket_numel": 40_000,
        "schedule.max_steps": 8,
        "clip_grad_norm": 0.0,
    }
    plain = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "plain", **common))
    overlap = run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "overlap", **common, **{"comm.overlap": True}),
    )
    _assert_same_runs(tmp_path / "plain", plain, tmp_path / "overlap", overlap)
    records = _records(tmp_path / "overlap")
    assert [bool(r.get("overlapped")) for r in records] == [False] * 3 + [True] * 5
    plain_records = _records(tmp_path / "plain")
    for a, b in zip(plain_records[3:], records[3:], strict=True):
        assert a["comm_bytes_momentum"] == b["comm_bytes_momentum"] > 0
        assert a["compression_error"] == pytest.approx(b["compression_error"], rel=1e-5)


def _torch_coefficient(max_norm: float, norms: list[torch.Tensor]) -> torch.Tensor:
    return torch.clamp(max_norm / (torch.linalg.vector_norm(torch.stack(norms)) + 1e-6), max=1.0)


@pytest.mark.parametrize("gaps", [(), ("previous",), ("now",), ("previous", "now")])
def test_overlap_clip_estimates_from_what_each_bucket_has_seen(gaps):
    """OverlapClip's coefficient after each bucket is torch's for the norms seen so far and
    the previous step's for the rest, bit for bit, both while every parameter counts (one
    buffer) and with parameters that had or have no gradient (not counted; one found
    mid-step drops the buffer); measuring the rest early for the step's norm does not
    change what later buckets count as seen."""
    from onebit_bert.optim.compressed import OverlapClip

    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(n, requires_grad=True) for n in (5, 3, 7, 2)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    previous = [p.grad.norm() * 3 for p in params]
    if "previous" in gaps:
        previous[1] = None  # no gradient last step
    if "now" in gaps:
        params[3].grad = None  # none this step, seen in the last bucket
    now = [None if p.grad is None else torch.linalg.vector_norm(p.grad) for p in params]
    clip = OverlapClip(1.0, params, previous)
    order = ([2], [1], [0, 3])  # buckets in issue order

    def expected(seen):
        chosen = [now[i] if i in seen else previous[i] for i in range(4)]
        return _torch_coefficient(1.0, [n for n in chosen if n is not None])

    seen: set[int] = set()
    for k, bucket in enumerate(order):
        clip.see([params[i] for i in bucket])
        seen.update(bucket)
        assert torch.equal(clip.coefficient(), expected(seen))
        assert clip.coefficient() < 1.0
        if k == 0:  # the step's norm measured before the other buckets are sent
            assert [None if n is None else float(n) for n in clip.norms()] == [
                None if n is None else float(n) for n in now
            ]
            assert torch.equal(clip.coefficient(), expected(seen))
    assert torch.equal(clip.coefficient(), expected({0, 1, 2, 3}))


def _train_clipping_bucket_by_bucket(comm, cfg: dict) -> dict:
    """The reference of overlapped clipping through the plain (not overlapped) step: the
    first compression step clips as torch does; on later ones, going through the momentum
    buckets from the last to the first, each bucket's parameters not clipped yet are
    multiplied by torch's coefficient for the norm of (this step's gradients of the
    parameters in that bucket or a later one, the previous compression step's for the
    others)."""
    from onebit_bert.strategies.data_parallel import SelfSyncingDataParallel

    def clip(self, max_norm):
        if self.gradient_sync() != "optimizer":
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        present = [p for p in self.params if p.grad is not None]
        current = dict(
            zip(map(id, present), torch._foreach_norm([p.grad for p in present]), strict=True)
        )
        total = torch.linalg.vector_norm(torch.stack(list(current.values())))
        previous = getattr(self, "reference_norms", None)
        self.reference_norms = current
        if previous is None:
            torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            return float(total)
        opt = self.optimizer
        buckets = opt.codec.fused_feedback(opt._codec_key("momentum"), opt._flat_numel).buckets
        spans, offset = {}, 0
        for _, params in opt._layout("exp_avg", "after the freeze step"):
            for p in params:
                spans[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
        seen, coefficient = set(), {}
        for b in reversed(buckets):
            hit = [i for i, (lo, hi) in spans.items() if lo < b.start + b.size and b.start < hi]
            seen.update(hit)
            chosen = [(current if id(p) in seen else previous).get(id(p)) for p in self.params]
            norms = [n for n in chosen if n is not None]
            c = torch.clamp(
                max_norm / (torch.linalg.vector_norm(torch.stack(norms)) + 1e-6), max=1.0
            )
            for i in hit:
                coefficient.setdefault(i, c)
        for p in present:
            p.grad.mul_(coefficient[id(p)])
        return float(total)

    SelfSyncingDataParallel.clip_gradients = clip
    return train_in_process(comm, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["onebit_lamb", "onebit_adam"])
def test_overlapped_steps_clip_bucket_by_bucket(tiny_corpus, tmp_path, optimizer):
    """An overlapped step sends a bucket before the whole gradient's norm is known, so it
    clips each bucket by the norm estimated from the gradients complete by then and the
    previous compression step's norms for the rest: bit for bit the plain step clipped that
    way (same buckets), and with one bucket the plain step clipped as torch clips. The
    first compression step does not overlap; the clipping binds (a run without it ends
    elsewhere); a stop and a resume give the uninterrupted run (the norms are per-rank
    checkpoint state)."""
    common = {
        "optimizer.name": optimizer,
        "optimizer.lr": 0.02 if optimizer == "onebit_lamb" else 1e-3,
        "optimizer.freeze_step": 3,
        "optimizer.bucket_numel": 40_000,
        "schedule.max_steps": 8,
        "clip_grad_norm": 0.5,
    }
    overlap = {**common, "comm.overlap": True}
    straight = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "o", **overlap))
    reference = run_ranks(
        _train_clipping_bucket_by_bucket, 2, tiny_config(tiny_corpus, tmp_path / "ref", **common)
    )
    _assert_same_runs(tmp_path / "o", straight, tmp_path / "ref", reference)
    records = _records(tmp_path / "o")
    assert [bool(r.get("overlapped")) for r in records] == [False] * 4 + [True] * 4
    assert all(r["grad_norm"] > 0.5 for r in records)  # the limit binds on every step
    unclipped = run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "u", **{**overlap, "clip_grad_norm": 0.0}),
    )
    assert not _same_model(straight[0]["model"], unclipped[0]["model"])
    cut = tiny_config(tiny_corpus, tmp_path / "cut", **overlap)
    run_ranks(train_in_process, 2, {**cut, "stop_after": 6})
    resumed = run_ranks(train_in_process, 2, cut)
    by_step = {r["step"]: r for r in _records(tmp_path / "cut")}
    assert [bool(by_step[s].get("overlapped")) for s in sorted(by_step)] == [False] * 4 + [True] * 4
    for a, b in zip(straight, resumed, strict=True):
        assert _same_model(a["model"], b["model"])
    # one bucket: the plain step clipped by torch, bit for bit
    one = {**common, "optimizer.bucket_numel": 100_000_000}
    plain = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "p1", **one))
    overlapped = run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "o1", **one, **{"comm.overlap": True}),
    )
    _assert_same_runs(tmp_path / "p1", plain, tmp_path / "o1", overlapped)
    assert not _same_model(straight[0]["model"], overlapped[0]["model"])


# ----------------------------------------------------------------------------- gradients


@pytest.mark.slow
@pytest.mark.parametrize(("codec", "ratio"), [("int8", 4.0), ("bf16", 2.0)])
def test_hybrid_onebit_lamb_compresses_its_warmup_gradients(tiny_corpus, tmp_path, codec, ratio):
    """comm.compression.grad applies to the warmup's gradient average; the compression
    stage is 1-bit as before. Bytes per warmup step: the fp32 ring's / ratio (within the
    per-block scales and padding)."""
    common = {"optimizer.name": "onebit_lamb", "schedule.max_steps": 6}
    run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "fp32", **common))
    run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / codec, **common, **{"comm.compression.grad": codec}),
    )
    fp32, hybrid = _records(tmp_path / "fp32"), _records(tmp_path / codec)
    for a, b in zip(fp32[:4], hybrid[:4], strict=True):
        assert a["stage"] == b["stage"] == "warmup"
        assert b["comm_bytes_gradients"] * ratio == pytest.approx(
            a["comm_bytes_gradients"], rel=0.01
        )
    for a, b in zip(fp32[4:], hybrid[4:], strict=True):  # same compression stage traffic
        assert a["comm_bytes_momentum"] == b["comm_bytes_momentum"]
    losses = mlm_losses(tmp_path / codec)
    assert losses != mlm_losses(tmp_path / "fp32")  # the warmup's gradients were rounded
    assert abs(losses[-1] - mlm_losses(tmp_path / "fp32")[-1]) < 0.2


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "powersgd"])
def test_resume_continues_the_gradient_codecs_state_exactly(tiny_corpus, tmp_path, codec):
    """Error feedback (and PowerSGD's factors and generator) are per-rank checkpoint
    state: stopping and resuming gives the uninterrupted run bit for bit."""
    common = {
        "optimizer.name": "lamb",
        "schedule.max_steps": 8,
        "comm.compression.grad": codec,
        "comm.powersgd_start_step": 3,
        "comm.powersgd_rank": 2,
    }
    straight = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "a", **common))
    cut = tiny_config(tiny_corpus, tmp_path / "b", **common)
    run_ranks(train_in_process, 2, {**cut, "stop_after": 5})
    resumed = run_ranks(train_in_process, 2, cut)
    by_step = {r["step"]: r["mlm_loss"] for r in _records(tmp_path / "b")}
    assert mlm_losses(tmp_path / "a") == [by_step[s] for s in sorted(by_step)]
    for a, b in zip(straight, resumed, strict=True):
        assert _same_model(a["model"], b["model"])


@pytest.mark.slow
def test_powersgd_sends_low_rank_factors(tiny_corpus, tmp_path):
    common = {
        "optimizer.name": "adamw",
        "optimizer.lr": 1e-3,
        "schedule.max_steps": 5,
        "comm.compression.grad": "powersgd",
        "comm.powersgd_start_step": 2,
        "comm.powersgd_rank": 1,
    }
    run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "run", **common))
    sent = [r["comm_bytes_gradients"] for r in _records(tmp_path / "run")]
    assert sent[0] == sent[1]  # full precision before start_step
    assert all(s < sent[0] / 5 for s in sent[2:])


# ----------------------------------------------------------------------------- outer and neighbour


@pytest.mark.slow
def test_slowmo_outer_average_in_bf16_sends_half(tiny_corpus, tmp_path):
    common = {
        "optimizer.name": "lamb",
        "strategy.name": "slowmo",
        "strategy.outer_every": 2,
        "schedule.max_steps": 4,
    }
    run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "fp32", **common))
    run_ranks(
        train_in_process,
        2,
        tiny_config(tiny_corpus, tmp_path / "bf16", **common, **{"comm.compression.outer": "bf16"}),
    )
    a = [r.get("comm_bytes_parameters", 0) for r in _records(tmp_path / "fp32")]
    b = [r.get("comm_bytes_parameters", 0) for r in _records(tmp_path / "bf16")]
    assert [x > 0 for x in a] == [False, True, False, True]
    assert all(2 * y == pytest.approx(x, rel=1e-3) for x, y in zip(a, b, strict=True))
    # the progress since the anchor travels, not the parameters: close to fp32's result
    la, lb = mlm_losses(tmp_path / "fp32"), mlm_losses(tmp_path / "bf16")
    assert la[:2] == lb[:2] and abs(la[-1] - lb[-1]) < 0.05


@pytest.mark.slow
def test_co2_with_an_int8_outer_average_resumes_exactly(tiny_corpus, tmp_path):
    """CO2's background average through the int8 codec (a thread on its own group): its
    bytes are filed at launch, as the fp32 average's; a stop mid-round and a resume give
    the uninterrupted run."""
    common = {
        "optimizer.name": "lamb",
        "strategy.name": "co2",
        "strategy.outer_every": 2,
        "schedule.max_steps": 8,
        "comm.compression.outer": "int8",
    }
    straight = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "a", **common))
    records = _records(tmp_path / "a")
    sent = [r.get("comm_bytes_parameters", 0) for r in records]
    assert [s > 0 for s in sent] == [False, True] * 4
    cut = tiny_config(tiny_corpus, tmp_path / "b", **common)
    run_ranks(train_in_process, 2, {**cut, "stop_after": 5})
    resumed = run_ranks(train_in_process, 2, cut)
    for a, b in zip(straight, resumed, strict=True):
        assert _same_model(a["model"], b["model"])


@pytest.mark.slow
def test_neighbour_exchange_in_bf16_sends_half(tiny_corpus, tmp_path):
    common = {
        "optimizer.name": "sgd",
        "optimizer.lr": 0.1,
        "strategy.name": "dmsgd",
        "strategy.topology": "ring",
        "schedule.max_steps": 3,
    }
    run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "fp32", **common))
    run_ranks(
        train_in_process,
        2,
        tiny_config(
            tiny_corpus, tmp_path / "bf16", **common, **{"comm.compression.neighbour": "bf16"}
        ),
    )
    a = [r["comm_bytes_neighbour"] for r in _records(tmp_path / "fp32")]
    b = [r["comm_bytes_neighbour"] for r in _records(tmp_path / "bf16")]
    assert all(x == 2 * y > 0 for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- hierarchy


@pytest.mark.slow
def test_hierarchy_sends_a_slice_across_nodes(tiny_corpus, tmp_path):
    """2 nodes x 2 ranks, LAMB: the gradient average is the flat one up to summation
    order; across nodes each rank sends a 2-rank ring all-reduce of half the gradients
    (P bytes x 2 x 1/2 x 1/2 x 4), inside the node a reduce-scatter and an all-gather."""
    common = {"schedule.max_steps": 3, "model.dropout": 0.0}
    run_ranks(train_in_process, 4, tiny_config(tiny_corpus, tmp_path / "flat", **common))
    run_ranks(
        train_on_nodes,
        4,
        tiny_config(tiny_corpus, tmp_path / "node", **common, **{"comm.hierarchy": "node"}),
        2,
    )
    flat, node = _records(tmp_path / "flat"), _records(tmp_path / "node")
    for a, b in zip(flat, node, strict=True):
        numel = a["comm_bytes_gradients"] // 6  # flat: a ring over 4 ranks, 2 x 3/4 x 4 bytes
        half = -(-numel // 2)
        assert b["comm_bytes_gradients"] == 2 * 1 * half * 4 // 2
        assert b["comm_bytes_intra_node"] == 2 * half * 4
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.slow
def test_hierarchical_onebit_lamb_compresses_between_nodes(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus,
        tmp_path / "run",
        **{
            "optimizer.name": "onebit_lamb",
            "optimizer.freeze_step": 2,
            "schedule.max_steps": 5,
            "comm.hierarchy": "node",
        },
    )
    run_ranks(train_on_nodes, 4, cfg, 2)
    records = _records(tmp_path / "run")
    assert [r["stage"] for r in records] == ["warmup"] * 2 + ["compression"] * 3
    warm, compressed = records[1], records[3]
    assert 0 < compressed["comm_bytes_momentum"] < warm["comm_bytes_gradients"] / 10
    # inside the node the momentum travels in fp32
    assert compressed["comm_bytes_intra_node"] == warm["comm_bytes_intra_node"]


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"comm.compression.grad": "int8", "strategy.name": "co2"}, "averages no full-precision"),
        ({"comm.compression.momentum": "int8"}, "has no compressed momentum all-reduce"),
        ({"comm.compression.outer": "bf16"}, "has no outer parameter average"),
        ({"comm.compression.neighbour": "bf16"}, "exchanges nothing with neighbours"),
        ({"comm.overlap": True}, "has no compressed momentum all-reduce to overlap"),
        (
            {"optimizer.name": "zero_one_adam", "comm.hierarchy": "node"},
            "comm.hierarchy node does not apply to strategy zero_one_adam",
        ),
        (
            {"optimizer.name": "onebit_lamb", "comm.overlap": True, "comm.hierarchy": "node"},
            "needs comm.compression.momentum onebit and comm.hierarchy flat",
        ),
        ({"comm.compression.stats": "bf16"}, "stats traffic takes none"),
    ],
)
def test_comm_settings_a_strategy_would_ignore_are_refused(tmp_path, overrides, message):
    cfg = tiny_config(tmp_path, tmp_path / "run", **overrides)
    with pytest.raises(Exception, match=message):
        from_dict(PretrainConfig, cfg)
