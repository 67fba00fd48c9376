"""Fine-tuning end to end with a tiny model, on data the tests write and on the shared
real data when present; clear errors; the parity report."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import statistics
import time
from pathlib import Path

import pytest
import torch
import yaml

from finetune.config import FinetuneConfig
from finetune.run import run
from onebit_bert.config import from_dict, to_dict
from pipeline.reports.parity import write_report
from tests.helpers.corpus import WORDS, sentence
from tests.helpers.paths import SHARED_DATA

SHARED = SHARED_DATA


def tiny_checkpoint(directory: Path, tokenizer_dir: Path) -> Path:
    """A randomly initialised bert-tiny with the given tokenizer, in HF format."""
    from transformers import AutoTokenizer

    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = build_model(ModelConfig(preset="bert-tiny", max_position_embeddings=512), len(tok))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def write_glue_and_squad(root: Path, seed: int = 0) -> Path:
    """SST-2, MRPC and STS-B files in GLUE's layout and a SQuAD v1.1 JSON, generated."""
    rng = random.Random(seed)
    for folder, header, row in [
        ("SST-2", "sentence\tlabel", lambda s, t: f"{s}\t{int('bright' in s or 'warm' in s)}"),
        (
            "MRPC",
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            lambda s, t: f"{int(s[:10] == t[:10])}\t1\t2\t{s}\t{t if rng.random() < 0.5 else s}",
        ),
        (
            "STS-B",
            "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
            "sentence2\tscore",
            lambda s, t: f"0\tg\tf\ty\t0\ta\tb\t{s}\t{t}\t{rng.uniform(0, 5):.2f}",
        ),
    ]:
        (root / folder).mkdir(parents=True, exist_ok=True)
        for split, n in (("train", 80), ("dev", 40)):
            lines = [header] + [row(sentence(rng), sentence(rng)) for _ in range(n)]
            (root / folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    articles = []
    for a in range(12):
        paragraphs = []
        for p in range(3):
            context = " ".join(sentence(rng) for _ in range(6))
            qas = []
            for q in range(3):
                word = rng.choice([w for w in WORDS if f" {w} " in context] or ["the"])
                start = context.find(f" {word} ") + 1
                qas.append(
                    {
                        "id": f"q{a}-{p}-{q}",
                        "question": f"where is the {word}?",
                        "answers": [{"text": word, "answer_start": start}],
                    }
                )
            paragraphs.append({"context": context, "qas": qas})
        articles.append({"title": f"article {a}", "paragraphs": paragraphs})
    (root / "squad").mkdir(exist_ok=True)
    (root / "squad" / "dev-v1.1.json").write_text(json.dumps({"version": "1.1", "data": articles}))
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_corpus):
    root = tmp_path_factory.mktemp("finetune")
    checkpoint = tiny_checkpoint(root / "checkpoint", tiny_corpus.parent / "tokenizer")
    data = write_glue_and_squad(root / "data")
    return checkpoint, data


def finetune_config(checkpoint, data, out, **overrides) -> FinetuneConfig:
    cfg = {
        "checkpoint": str(checkpoint),
        "tasks": ["sst2", "mrpc", "stsb", "squad"],
        "data_root": str(data),
        "output": str(out),
        "seeds": [1, 2],
        "epochs": [1],
        "batch_size": 16,
        "max_seq_length": 64,
        "doc_stride": 24,
        "squad_eval_fraction": 0.25,
        "precision": "fp32",
        "logging": {"wandb": False},  # test_finetuning_logs_like_pretraining starts it
    }
    cfg.update(overrides)
    return from_dict(FinetuneConfig, cfg)


def test_finetuning_logs_like_pretraining(setup, tmp_path, monkeypatch, capfd):
    """Each (task, lr, epochs, seed) run logs every step to metrics.jsonl, TensorBoard and
    its own wandb run (offline without a key), grouped by the experiment, with progress
    lines on stderr."""
    import wandb

    from onebit_bert.metrics_log import read_metrics

    started = []

    class Run:
        def __init__(self, **kwargs):
            started.append({**kwargs, "mode": os.environ.get("WANDB_MODE"), "logged": []})

        def log(self, data, step):
            started[-1]["logged"].append((step, data))

        def finish(self):
            pass

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: Run(**kwargs))
    checkpoint, data = setup
    out = tmp_path / "out"
    logging = {"experiment": "exp", "run_name": "onebit-seed1", "tensorboard": True}
    cfg = finetune_config(
        checkpoint, data, out, tasks=["sst2"], seeds=[1, 2], max_train_samples=40,
        logging=logging | {"progress_every": 2},
    )  # fmt: skip
    run(cfg)
    steps = 3  # 40 rows in batches of 16, one epoch
    assert [(r["group"], r["name"], r["job_type"], r["mode"]) for r in started] == [
        ("exp", f"onebit-seed1-sst2-lr2e-05-ep1-seed{seed}", "finetune", "offline")
        for seed in (1, 2)
    ]
    for seed, wandb_run in zip((1, 2), started, strict=True):
        logs = out / "sst2" / "logs" / f"lr2e-05_ep1_seed{seed}"
        assert wandb_run["dir"] == str(logs) and wandb_run["config"]["seed"] == seed
        records = read_metrics(logs / "metrics.jsonl")
        train = [r for r in records if "loss" in r]
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert all({"lr", "grad_norm"} <= r.keys() for r in train)
        assert "eval_accuracy" in records[-1] and records[-1]["step"] == steps
        assert [step for step, _ in wandb_run["logged"]] == [r["step"] for r in records]
        assert list((logs / "tensorboard").iterdir())
    err = capfd.readouterr().err
    for seed in (1, 2):
        assert f"sst2 lr=2e-05 epochs=1 seed={seed}: step 2/3  loss" in err
        assert f"sst2 lr=2e-05 epochs=1 seed={seed}: step 3/3  loss" in err


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    checkpoint, data = setup
    out = tmp_path_factory.mktemp("ft") / "out"
    cfg = finetune_config(checkpoint, data, out, max_train_samples_per_task={"mrpc": 10})
    return cfg, run(cfg)


def test_results_have_the_usual_metric_names(finished):
    cfg, results = finished
    expected = {
        "sst2": {"accuracy"},
        "mrpc": {"accuracy", "f1"},
        "stsb": {"pearson", "spearmanr"},
        "squad": {"exact_match", "f1"},
    }
    on_disk = json.loads((Path(cfg.output) / "results.json").read_text())
    assert on_disk.keys() == expected.keys()
    for task, names in expected.items():
        entry = on_disk[task]
        assert names <= entry.keys() and set(entry["std"]) == names
        assert set(entry["per_seed"]) == {"1", "2"}
        assert entry["sizes"]["train"] > 0
        for name in names:
            low, high = (-1.0, 1.0) if name in ("pearson", "spearmanr") else (0.0, 100.0)
            assert low <= entry[name] <= high
        assert (Path(cfg.output) / task / "results.json").is_file()
    assert on_disk["mrpc"]["sizes"]["train"] == 10  # the per-task cap
    assert on_disk["sst2"]["sizes"]["train"] > 10
    assert 0.0 <= on_disk["sst2"]["accuracy"] <= 1.0  # GLUE metrics are fractions


def test_rerun_reuses_finished_runs(finished):
    cfg, results = finished
    runs = sorted((Path(cfg.output) / "sst2" / "runs").iterdir())
    stamps = {p: p.stat().st_mtime_ns for p in runs}
    again = run(cfg)
    assert {p: p.stat().st_mtime_ns for p in runs} == stamps
    assert again["sst2"]["accuracy"] == results["sst2"]["accuracy"]
    for path in runs:  # what a bit-identical repeat needs besides the config
        record = json.loads(path.read_text())
        assert record["device"] == "cpu" and record["threads"] == torch.get_num_threads()


def test_learning_rate_grid_and_seed_spread(setup, tmp_path):
    checkpoint, data = setup
    cfg = finetune_config(
        checkpoint,
        data,
        tmp_path / "out",
        tasks=["sst2"],
        learning_rates=[1e-4, 1e-3],
        seeds=[1, 2, 3],
    )
    result = run(cfg)["sst2"]
    assert [(g["lr"], g["epochs"]) for g in result["grid"]] == [(1e-4, 1.0), (1e-3, 1.0)]
    best = max(result["grid"], key=lambda g: g["mean"]["accuracy"])
    assert result["lr"] == best["lr"] and result["accuracy"] == best["mean"]["accuracy"]


# ----------------------------------------------------------------------------- one writer


def test_a_second_launch_of_one_run_is_refused_before_training(setup, tmp_path, capsys):
    """Two launches training the same (task, lr, epochs, seed) into one output (a double
    sbatch) would race on its record: the second stops at once, naming the live holder.
    Other runs of the same output (SLURM array tasks) are not held up by it."""
    import subprocess

    from finetune.__main__ import main
    from finetune.outputs import artifact_dir
    from onebit_bert.run_lock import LOCK_FILE, read_lock

    checkpoint, data = setup
    out = tmp_path / "out"
    cfg = finetune_config(checkpoint, data, out, tasks=["sst2"], seeds=[1])
    ((lr, epochs),) = cfg.grid("sst2")
    held = artifact_dir(out, "sst2", lr, epochs, 1, "locks")
    config = tmp_path / "ft.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    holder = subprocess.Popen(["sleep", "60"])
    try:
        held.mkdir(parents=True)
        record = {"host": socket.gethostname(), "pids": [holder.pid], "token": "other"}
        (held / LOCK_FILE).write_text(json.dumps({**record, "heartbeat": time.time()}))
        assert main(["run", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert "being written by another launch" in err and f"pid {holder.pid}" in err
        assert not (out / "sst2" / "runs").exists()  # nothing trained
        assert read_lock(held)["token"] == "other"
        # another seed of the same output trains beside it
        assert main(["run", "--config", str(config), "seeds=[2]"]) == 0
        assert sorted(p.name for p in (out / "sst2" / "runs").iterdir()) == [
            f"lr{lr:g}_ep{epochs:g}_seed2.json"
        ]
    finally:
        holder.kill()
        holder.wait()
    # its holder gone, the lock is taken over; a finished run leaves no lock behind
    run(cfg)
    assert (out / "sst2" / "runs" / f"lr{lr:g}_ep{epochs:g}_seed1.json").is_file()
    assert not (out / "sst2" / "locks").exists()


def test_a_run_taken_over_by_another_launch_stops_without_writing(setup, tmp_path, monkeypatch):
    """The heartbeat after every training step notices another launch's takeover: the
    run stops before writing its record."""
    import finetune.run as ft_run
    from onebit_bert.run_lock import LOCK_FILE, RunLock, RunLocked

    class TakenOver(RunLock):
        def __init__(self, run_dir):
            super().__init__(run_dir, interval=0.0)

        def heartbeat(self):
            record = {"host": "elsewhere", "pids": [1], "token": "new", "heartbeat": time.time()}
            (self.run_dir / LOCK_FILE).write_text(json.dumps(record))
            return super().heartbeat()

    monkeypatch.setattr(ft_run, "RunLock", TakenOver)
    checkpoint, data = setup
    cfg = finetune_config(checkpoint, data, tmp_path / "out", tasks=["sst2"])
    with pytest.raises(RunLocked, match="taken over by another launch"):
        run(cfg)
    assert not (tmp_path / "out" / "sst2" / "runs").exists()


# ----------------------------------------------------------------------------- errors


def test_missing_task_folder(setup, tmp_path):
    checkpoint, _ = setup
    cfg = finetune_config(checkpoint, tmp_path, tmp_path / "out", tasks=["cola"])
    with pytest.raises(FileNotFoundError, match="CoLA"):
        run(cfg)
    assert not (tmp_path / "out").exists()  # nothing started


def test_malformed_tsv_row(setup, tmp_path):
    checkpoint, data = setup
    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    with (bad / "SST-2" / "dev.tsv").open("a") as f:
        f.write("a sentence without its label\n")
    cfg = finetune_config(checkpoint, bad, tmp_path / "out", tasks=["sst2"])
    with pytest.raises(ValueError, match=r"dev.tsv, line 42"):
        run(cfg)


def test_checkpoint_without_tokenizer(setup, tmp_path):
    checkpoint, data = setup
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, bare / name)
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        run(finetune_config(bare, data, tmp_path / "out"))


def test_bad_config_values():
    with pytest.raises(ValueError, match="unknown task"):
        FinetuneConfig(checkpoint="x", tasks=["sst3"])
    with pytest.raises(ValueError, match="squad_eval_fraction"):
        FinetuneConfig(checkpoint="x", squad_eval_fraction=1.5)
    assert FinetuneConfig(checkpoint="x", tasks=["SST-2", "sts-b"]).tasks == ["sst2", "stsb"]
    with pytest.raises(ValueError, match="max_train_samples_per_task names unknown"):
        FinetuneConfig(checkpoint="x", max_train_samples_per_task={"sqad": 5})
    with pytest.raises(ValueError, match="positive integers"):
        FinetuneConfig(checkpoint="x", max_train_samples_per_task={"squad": 0})
    cfg = FinetuneConfig(
        checkpoint="x", max_train_samples=9, max_train_samples_per_task={"SQuAD": 3}
    )
    assert (cfg.train_cap("squad"), cfg.train_cap("sst2")) == (3, 9)


# ----------------------------------------------------------------------------- real data


@pytest.mark.skipif(not (SHARED / "glue" / "SST-2").is_dir(), reason=f"no shared data at {SHARED}")
def test_real_glue_and_squad_slices(tmp_path):
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wordpiece = BertWordPieceTokenizer(str(SHARED / "bert_vocab/uncased/vocab.txt"), lowercase=True)
    tok_dir = tmp_path / "tok"
    BertTokenizerFast(tokenizer_object=wordpiece._tokenizer).save_pretrained(tok_dir)
    checkpoint = tiny_checkpoint(tmp_path / "ckpt", tok_dir)
    cfg = finetune_config(
        checkpoint,
        SHARED,
        tmp_path / "out",
        tasks=["sst2", "mrpc", "cola", "stsb", "squad"],
        seeds=[1],
        max_train_samples=64,
        max_eval_samples=64,
        max_seq_length=96,
        doc_stride=32,
        squad_eval_fraction=0.2,
    )
    results = run(cfg)
    assert 0.0 <= results["sst2"]["accuracy"] <= 1.0
    assert 0.0 <= results["mrpc"]["f1"] <= 1.0
    assert -1.0 <= results["cola"]["matthews_correlation"] <= 1.0
    assert results["stsb"]["sizes"] == {"train": 64, "validation": 64}
    assert 0.0 <= results["squad"]["exact_match"] <= results["squad"]["f1"] <= 100.0


# ----------------------------------------------------------------------------- report


def _fake_pretrain_run(
    directory: Path, optimizer: str, losses: list[float], val_acc: float = 0.3, seed: int = 1
) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "seed": seed,
                "optimizer": {"name": optimizer, "freeze_step": 2},
                "batch": {"global_batch_size": 32},
            }
        )
    )
    records = [
        {"step": i + 1, "loss": loss, "comm_bytes": 1000, "comm_bytes_gradients": 1000,
         "comm_seconds_gradients": 0.5, "comm_bytes_intra_node": 200}
        for i, loss in enumerate(losses)
    ]  # fmt: skip
    for r in records:
        r.update(trust_ratio_min=0.5, trust_ratio_mean=1.0, trust_ratio_max=2.0)
        if optimizer == "onebit_lamb" and r["step"] > 2:
            r.update(factor_min=0.9, factor_mean=1.0, factor_max=1.1, compression_error=0.4)
    records.append({"step": len(losses), "val_mlm_accuracy": val_acc, "val_nsp_accuracy": 0.6})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_parity_report(finished, tmp_path):
    cfg, _ = finished
    lamb = _fake_pretrain_run(tmp_path / "lamb", "lamb", [5.0, 4.0, 3.5])
    onebit = _fake_pretrain_run(tmp_path / "onebit", "onebit_lamb", [5.0, 4.1, 3.6])
    report = write_report(
        [f"lamb={lamb}:{cfg.output}", f"onebit={onebit}:{cfg.output}"], tmp_path / "report"
    )
    for name in (
        "report.md",
        "report.json",
        "pretrain_loss.png",
        "val_mlm_accuracy.png",
        "onebit_switch.png",
        "finetune_scores.png",
    ):
        assert (tmp_path / "report" / name).stat().st_size > 0
    # One pretraining seed per arm: no verdict, whatever the fine-tuning seeds say.
    verdicts = {
        row["onebit"]["verdict"]
        for task in report["finetune"].values()
        for row in task["metrics"].values()
    }
    assert verdicts == {"1 seed: no verdict"}
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| sst2 | accuracy (main) |" in text and "onebit_lamb" in text
    # traffic per kind: 3 steps x 1,000 bytes and 0.5 s of gradients (the intra-node share
    # of a node hierarchy is not a kind)
    assert "| lamb | 3,000 B; 1.5 s |" in text
    assert report["arms"][0]["seeds"][0]["comm_by_kind"] == {
        "gradients": {"bytes": 3000, "seconds": 1.5}
    }
    assert "1 seed: no verdict" in text and "Welch" in text
    with pytest.raises(ValueError, match="at least two runs"):
        write_report([f"lamb={lamb}:{cfg.output}"], tmp_path / "r2")
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report([f"a={tmp_path}:{cfg.output}", f"b={lamb}:{cfg.output}"], tmp_path / "r3")


def _fake_finetune(directory: Path, scores: list[float]) -> Path:
    """results.json of one pretraining seed: SST-2 accuracy per fine-tuning seed."""
    directory.mkdir(parents=True)
    mean = sum(scores) / len(scores)
    result = {
        "accuracy": mean,
        "std": {"accuracy": 0.0},
        "main_metric": "accuracy",
        "per_seed": {str(i + 1): {"accuracy": s} for i, s in enumerate(scores)},
    }
    (directory / "results.json").write_text(json.dumps({"sst2": result}))
    return directory


def _arm(tmp_path: Path, name: str, optimizer: str, per_seed: list[list[float]], vals):
    specs = []
    for seed, (scores, val) in enumerate(zip(per_seed, vals, strict=True), start=1):
        pre = _fake_pretrain_run(
            tmp_path / f"{name}{seed}" / "pre", optimizer, [5.0, 4.0, 3.0], val, seed
        )
        ft = _fake_finetune(tmp_path / f"{name}{seed}" / "ft", scores)
        specs.append(f"{name}={pre}:{ft}")
    return specs


def test_report_statistics_on_synthetic_numbers(tmp_path):
    # Fine-tuning: per-pretraining-seed means 1, 2, 3 against 4, 5, 6 (two fine-tuning seeds
    # each, +-0.5 around the mean): Welch t = 3.674, df = 4, two-sided p = 0.0213.
    lamb = _arm(tmp_path, "lamb", "lamb", [[0.5, 1.5], [1.5, 2.5], [2.5, 3.5]], [0.30, 0.31, 0.32])
    far = _arm(
        tmp_path, "far", "onebit_lamb", [[3.5, 4.5], [4.5, 5.5], [5.5, 6.5]], [0.1, 0.2, 0.3]
    )
    near = _arm(tmp_path, "near", "onebit_lamb", [[1, 2], [2, 3], [3, 4]], [0.31, 0.30, 0.32])
    report = write_report([*lamb, *far, *near], tmp_path / "report")
    rows = report["finetune"]["sst2"]["metrics"]["accuracy"]
    # mean ± std over all 3 x 2 values
    assert rows["lamb"]["mean"] == pytest.approx(2.0)
    assert rows["lamb"]["std"] == pytest.approx(statistics.stdev([0.5, 1.5, 1.5, 2.5, 2.5, 3.5]))
    assert rows["lamb"]["n"] == 6
    assert rows["far"]["pretrain_seed_means"] == pytest.approx([4.0, 5.0, 6.0])
    assert rows["far"]["difference"] == pytest.approx(3.0)
    assert rows["far"]["t"] == pytest.approx(3.6742346, rel=1e-6)
    assert rows["far"]["df"] == pytest.approx(4.0)
    assert rows["far"]["p"] == pytest.approx(0.0213116, rel=1e-4)
    assert rows["far"]["verdict"] == "differs"
    # near: seed means 1.5, 2.5, 3.5 vs 1, 2, 3 -> t = 0.612, p = 0.57
    assert rows["near"]["p"] == pytest.approx(0.5734, abs=1e-3)
    assert rows["near"]["verdict"] == "no significant difference"
    # pretraining: mean ± std over pretraining seeds, verdict on the same test
    val = report["pretraining"]["val_mlm_accuracy"]
    assert val["lamb"]["mean"] == pytest.approx(0.31)
    assert val["lamb"]["std"] == pytest.approx(0.01)
    assert val["far"]["mean"] == pytest.approx(0.2) and val["far"]["std"] == pytest.approx(0.1)
    assert val["near"]["verdict"] == "no significant difference"
    text = (tmp_path / "report" / "report.md").read_text()
    assert "**differs** (p = 0.02)" in text
    assert "| sst2 | accuracy (main) | 2.0000 ± 1.0488 |" in text
    with pytest.raises(ValueError, match="mixes optimizers"):
        write_report([*lamb, lamb[0].replace("lamb=", "far=", 1), *far], tmp_path / "r2")


def test_random_init_keeps_the_architecture_and_drops_the_weights(setup):
    from transformers import AutoModelForSequenceClassification

    from finetune.run import load_model

    checkpoint, _ = setup
    pretrained = load_model(AutoModelForSequenceClassification, str(checkpoint), False)
    import torch

    torch.manual_seed(3)
    first = load_model(AutoModelForSequenceClassification, str(checkpoint), True)
    torch.manual_seed(3)
    second = load_model(AutoModelForSequenceClassification, str(checkpoint), True)
    embeddings = "bert.embeddings.word_embeddings.weight"
    weights = {
        name: dict(m.named_parameters())[embeddings]
        for name, m in (("pretrained", pretrained), ("first", first), ("second", second))
    }
    assert weights["first"].shape == weights["pretrained"].shape
    assert not torch.equal(weights["first"], weights["pretrained"])
    assert torch.equal(weights["first"], weights["second"])  # seeded by the caller
    assert first.config.num_hidden_layers == pretrained.config.num_hidden_layers


def test_random_init_fine_tunes_end_to_end(setup, tmp_path):
    checkpoint, data = setup
    cfg = finetune_config(
        checkpoint, data, tmp_path / "out", tasks=["sst2"], seeds=[1], init="random"
    )
    results = run(cfg)
    assert 0.0 <= results["sst2"]["accuracy"] <= 1.0
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["init"] == "random"


def test_a_dev_only_glue_task_splits_its_dev_file(setup, tmp_path):
    """QNLI ships without train.tsv in the shared folder: glue_eval_fraction splits dev
    (disjoint, seeded); without it the missing file is named."""
    from finetune.run import make_runner

    checkpoint, _ = setup
    folder = tmp_path / "data" / "QNLI"
    folder.mkdir(parents=True)
    rng = random.Random(1)
    rows = ["index\tquestion\tsentence\tlabel"] + [
        f"{i}\twhere is it {i}?\t{sentence(rng)}\t{'entailment' if i % 2 else 'not_entailment'}"
        for i in range(50)
    ]
    (folder / "dev.tsv").write_text("\n".join(rows) + "\n")
    cfg = finetune_config(checkpoint, tmp_path / "data", tmp_path / "out", tasks=["qnli"])
    with pytest.raises(FileNotFoundError, match="train.tsv"):
        make_runner("qnli", cfg).load()
    cfg = finetune_config(
        checkpoint, tmp_path / "data", tmp_path / "out", tasks=["qnli"], glue_eval_fraction=0.2
    )
    runner = make_runner("qnli", cfg)
    runner.load()
    (evals,) = runner.evals.values()
    assert len(evals) == 10 and len(runner.train) == 40
    assert not {e.guid for e in evals} & {e.guid for e in runner.train}
    again = make_runner("qnli", cfg)
    again.load()
    assert [e.guid for e in again.train] == [e.guid for e in runner.train]


def test_mean_pooling_head_fine_tunes_and_ignores_padding(setup, tmp_path):
    import torch

    from finetune.heads import MeanPoolingClassifier
    from finetune.run import make_runner

    checkpoint, data = setup
    cfg = finetune_config(checkpoint, data, tmp_path / "out", tasks=["sst2", "stsb"],
                          seeds=[1], pooling="mean")  # fmt: skip
    results = run(cfg)
    assert 0.0 <= results["sst2"]["accuracy"] <= 1.0 and "pearson" in results["stsb"]
    model = make_runner("stsb", cfg).build_model(str(checkpoint))
    assert isinstance(model, MeanPoolingClassifier) and model.num_labels == 1
    model.eval()
    ids = torch.tensor([[2, 5, 6, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    padded = model(input_ids=ids, attention_mask=mask).logits
    trimmed = model(input_ids=ids[:, :4], attention_mask=mask[:, :4]).logits
    torch.testing.assert_close(padded, trimmed, rtol=1e-5, atol=1e-5)
    out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([2.5]))
    assert out.loss.item() == pytest.approx((out.logits.item() - 2.5) ** 2, rel=1e-5)


def test_saved_models_and_predictions_in_the_formats_users_expect(setup, tmp_path):
    """save_model and predictions: GLUE dev predictions in the submission format that
    reproduce the reported score, SQuAD answers by question id, and models that load back
    (HF format; a mean-pooling classifier as its encoder plus classifier.pt)."""
    import torch
    from transformers import AutoModel, AutoModelForQuestionAnswering

    from finetune.glue_tasks import get_task
    from finetune.heads import MeanPoolingClassifier

    checkpoint, data = setup
    cfg = finetune_config(
        checkpoint,
        data,
        tmp_path / "out",
        tasks=["sst2", "squad"],
        seeds=[1],
        pooling="mean",
        save_model=True,
        predictions=True,
        max_train_samples=32,
    )
    results = run(cfg)
    out = Path(cfg.output)

    def artifacts(task: str, kind: str) -> Path:
        return out / task / kind / f"lr{results[task]['lr']:g}_ep1_seed1"

    # SST-2: the labels as SST-2's files spell them, and the reported accuracy from them
    lines = (artifacts("sst2", "predictions") / "validation.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction"
    dev = get_task("sst2").load("validation", str(data))
    rows = [line.split("\t") for line in lines[1:]]
    assert [int(i) for i, _ in rows] == list(range(len(dev)))
    assert {p for _, p in rows} <= {"0", "1"}
    accuracy = sum(int(p) == ex.label for (_, p), ex in zip(rows, dev, strict=True)) / len(dev)
    assert accuracy == pytest.approx(results["sst2"]["accuracy"])
    # SQuAD: {question id: answer text}
    answers = json.loads((artifacts("squad", "predictions") / "validation.json").read_text())
    assert answers and all(isinstance(a, str) for a in answers.values())
    # the models load back
    saved = artifacts("sst2", "models")
    head = torch.load(saved / "classifier.pt", weights_only=True)
    model = MeanPoolingClassifier(AutoModel.from_pretrained(saved), head["num_labels"])
    model.classifier.load_state_dict(head["classifier"])
    assert (saved / "tokenizer.json").is_file() or (saved / "vocab.txt").is_file()
    AutoModelForQuestionAnswering.from_pretrained(artifacts("squad", "models"))
    assert not list(out.rglob("*.tmp"))


def test_glue_predictions_spell_labels_as_the_task_files_do(tmp_path):
    from finetune.glue_tasks import Example
    from finetune.run import GlueRunner

    cfg = FinetuneConfig(checkpoint="unused", tasks=["stsb", "rte"])
    examples = [Example("validation-0", "a", "b", 0.0), Example("validation-1", "c", "d", 0.0)]
    GlueRunner("stsb", cfg).write_predictions(tmp_path / "stsb.tsv", examples, [3.14159, 0.5])
    GlueRunner("rte", cfg).write_predictions(tmp_path / "rte.tsv", examples, [0, 1])
    assert (tmp_path / "stsb.tsv").read_text() == "index\tprediction\n0\t3.142\n1\t0.500\n"
    assert (tmp_path / "rte.tsv").read_text() == (
        "index\tprediction\n0\tentailment\n1\tnot_entailment\n"
    )
