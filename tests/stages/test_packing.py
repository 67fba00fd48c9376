"""Packed sequences (``data.packing``): every sequence keeps its tokens, labels and
positions in the packed rows; the model gives each sequence the hidden states, and the
batch the losses and gradients, it has unpacked (SDPA and eager attention); and a 2-rank
run with packing follows the unpacked run's trajectory."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from onebit_bert.shards import PretrainingShards
from pretrain.config import DataConfig, ModelConfig
from pretrain.data import make_batch
from pretrain.model import PretrainingLoss, build_model
from pretrain.packing import pack_batch, pack_order
from pretrain.startup import token_ids
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import mlm_losses, tiny_config, train_in_process


def test_rows_are_filled_first_fit_by_decreasing_length():
    rows = pack_order(np.array([10, 60, 30, 34, 5, 64]), 64)
    assert rows == [[5], [1], [3, 2], [0, 4]]  # 64 | 60 | 34 + 30 | 10 + 5
    assert sorted(i for r in rows for i in r) == list(range(6))
    with pytest.raises(ValueError, match="65 tokens does not fit rows of 64"):
        pack_order(np.array([65]), 64)


def _batch(corpus, packing, n=16, micro=0):
    shards = PretrainingShards(corpus, "train")
    data = DataConfig(path=str(corpus), packing=packing)
    batch = make_batch(shards, np.arange(n), token_ids(shards), data, seed=3, step=5, micro=micro)
    return batch, shards


def test_every_sequence_keeps_its_tokens_labels_and_positions(tiny_corpus):
    plain, shards = _batch(tiny_corpus, packing=False)
    packed, _ = _batch(tiny_corpus, packing=True)
    lengths = plain["attention_mask"].sum(axis=1)
    assert len(packed["input_ids"]) < len(plain["input_ids"])  # it saves rows
    assert packed["attention_mask"].sum() == lengths.sum()  # every token, once
    seen = 0
    for r in range(len(packed["input_ids"])):
        ids = packed["sequence_ids"][r]
        for k in range(1, ids.max() + 1):
            where = np.flatnonzero(ids == k)
            tokens = packed["input_ids"][r, where]
            (match,) = [i for i in range(len(lengths)) if lengths[i] == len(where)
                        and (plain["input_ids"][i, : len(where)] == tokens).all()]  # fmt: skip
            assert (
                packed["mlm_labels"][r, where] == plain["mlm_labels"][match, : len(where)]
            ).all()
            assert (packed["token_type_ids"][r, where]
                    == plain["token_type_ids"][match, : len(where)]).all()  # fmt: skip
            assert (packed["position_ids"][r, where] == np.arange(len(where))).all()
            seen += 1
    assert seen == len(lengths)
    assert len(packed["mlm_positions"]) == len(plain["mlm_positions"])
    flat = packed["input_ids"].reshape(-1)
    assert (flat[packed["nsp_positions"]] == token_ids(shards).cls).all()
    assert sorted(packed["nsp_labels"]) == sorted(plain["nsp_labels"][plain["nsp_labels"] >= 0])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_and_unpacked_batches_give_the_same_losses_and_gradients(tiny_corpus, attention):
    plain, shards = _batch(tiny_corpus, packing=False, n=24)
    packed, _ = _batch(tiny_corpus, packing=True, n=24)
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="bert-tiny", max_position_embeddings=64,
                                    dropout=0.0, attention=attention),
                        token_ids(shards).vocab_size)  # fmt: skip
    loss_module = PretrainingLoss(model)

    def run(batch):
        model.zero_grad()
        loss, stats = loss_module(**{k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()})
        loss.backward()
        return loss.detach(), stats, [p.grad.clone() for p in model.parameters()]

    loss_a, stats_a, grads_a = run(plain)
    loss_b, stats_b, grads_b = run(packed)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for key in stats_a:
        torch.testing.assert_close(stats_b[key], stats_a[key], rtol=1e-5, atol=1e-5)
    assert stats_a["nsp_examples"] > 0  # the corpus has next-sentence labels: NSP is checked
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_mlm_only_rows_pack_and_keep_the_nsp_head_in_the_graph(tiny_corpus):
    plain, shards = _batch(tiny_corpus, packing=False, n=12)
    plain["nsp_labels"] = np.full_like(plain["nsp_labels"], -1)  # as full-sentence data
    plain["nsp_rows"] = np.flatnonzero(plain["nsp_labels"] >= 0)
    packed = pack_batch(plain)
    assert packed["nsp_labels"].size == 0 and packed["nsp_positions"].size == 0
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="bert-tiny", max_position_embeddings=64, dropout=0.0),
                        token_ids(shards).vocab_size)  # fmt: skip
    loss_module = PretrainingLoss(model)
    losses = []
    for batch in (plain, packed):
        model.zero_grad()
        loss, stats = loss_module(**{k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()})
        loss.backward()
        assert "nsp_examples" not in stats
        # every parameter gets a gradient (DDP needs them all in the graph): zeros for NSP's
        assert all(p.grad is not None for p in model.parameters())
        assert not model.cls.seq_relationship.weight.grad.any()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_packed_run_follows_the_unpacked_trajectory(tiny_corpus, tmp_path):
    runs = {}
    for packing in (False, True):
        run_dir = tmp_path / f"packing_{packing}"
        cfg = tiny_config(tiny_corpus, run_dir, **{"model.dropout": 0.0,
                                                   "data.packing": packing})  # fmt: skip
        run_ranks(train_in_process, 2, cfg)
        runs[packing] = mlm_losses(run_dir)
    assert len(runs[True]) == len(runs[False]) == 12
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-4, atol=0)


def test_the_packing_benchmark_reports_padding_and_rows_saved(tiny_corpus, tmp_path, capsys):
    from bench.packing import main, padding_figures

    figures = padding_figures(np.array([64, 32, 32, 16, 16, 16]), 64, 3)
    # the first micro-batch packs into 2 rows (64 | 32 + 32), the second into 1 (16 x 3)
    assert figures["padding_share"] == pytest.approx(1 - 176 / 6 / 64, abs=1e-4)
    assert figures["packed_rows_per_micro_batch"] == 1.5
    assert figures["rows_saved_share"] == 0.5
    (tmp_path / "seq64").symlink_to(tiny_corpus)
    out = main(["--prepared", str(tmp_path)])
    assert json.loads(capsys.readouterr().out) == out
    (length,) = out["lengths"]
    row = out["lengths"][length]
    assert 0 < row["padding_share"] < 1 and 0 < row["rows_saved_share"] < 1
    first = main(["--prepared", str(tmp_path), "--sequences", "16"])["lengths"][length]
    assert first["sequences"] == 16 < row["sequences"]  # the start of the shards only
    with pytest.raises(SystemExit):
        main(["--prepared", str(tmp_path / "seq64")])  # a seq folder, not its parent
