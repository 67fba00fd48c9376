"""``python -m pretrain export``: an intermediate checkpoint in HF format with its tokenizer,
the same weights as the checkpoint; a missing step names the steps there are."""

from __future__ import annotations

import pytest
import torch

from onebit_bert.checkpoint import load_file
from pretrain.__main__ import main
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.runs import tiny_config, train_in_process


@pytest.fixture(scope="module")
def run_dir(tiny_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = tiny_config(tiny_corpus, run, **{"schedule.max_steps": 4, "checkpoint.every": 2})
    run_ranks(train_in_process, 1, cfg)
    return run


def test_a_checkpoint_is_exported_with_its_weights_and_tokenizer(run_dir, tmp_path, capsys):
    from transformers import AutoTokenizer, BertForPreTraining

    out = tmp_path / "step2"
    assert main(["export", str(run_dir), "--step", "2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model = BertForPreTraining.from_pretrained(out)
    saved = load_file(run_dir / "checkpoints" / "step_00000002" / "shared.pt")["model"]
    exported = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    final = BertForPreTraining.from_pretrained(run_dir / "final")
    assert not torch.equal(  # step 2 is not the end of the run
        final.state_dict()["bert.embeddings.word_embeddings.weight"],
        exported["bert.embeddings.word_embeddings.weight"],
    )
    assert AutoTokenizer.from_pretrained(out).mask_token is not None


def test_the_default_is_the_newest_checkpoint(run_dir):
    assert main(["export", str(run_dir)]) == 0
    assert (run_dir / "exports" / "step_00000004" / "config.json").is_file()


def test_a_missing_step_names_the_steps_there_are(run_dir, capsys):
    assert main(["export", str(run_dir), "--step", "3"]) == 2
    assert "no checkpoint at step 3; it has steps 2, 4" in capsys.readouterr().err


def test_a_damaged_checkpoint_is_not_exported(run_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shared = copy / "checkpoints" / "step_00000004" / "shared.pt"
    data = bytearray(shared.read_bytes())
    data[-10] ^= 0xFF
    shared.write_bytes(bytes(data))
    assert main(["export", str(copy)]) == 2
    assert "does not match its sha256" in capsys.readouterr().err
