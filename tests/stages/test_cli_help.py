"""The stage CLIs' ``--help`` lists every config field, generated from the dataclasses; the
GPU benchmark's ``--help`` works on a machine without a GPU, where a run says why it cannot."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from data_prep.config import DataPrepConfig
from finetune.config import FinetuneConfig
from onebit_bert.config import config_help, describe_config
from pretrain.config import PretrainConfig, ScheduleConfig
from tests.helpers.paths import REPO


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of every non-dataclass field under ``cls`` (``key[].field`` for the
    fields of a list of dataclasses), walked independently of the generator."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            present = [a for a in typing.get_args(hint) if a is not type(None)]
            hint = present[0] if len(present) == 1 else hint
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            keys += leaf_keys(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
            keys += leaf_keys(args[0], f"{prefix}{f.name}[].")
        else:
            keys.append(prefix + f.name)
    return keys


def flat(text: str) -> str:
    """Whitespace collapsed, so a docstring fragment matches across wrapped lines."""
    return " ".join(text.split())


def help_in_process(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return capsys.readouterr().out


def help_subprocess(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", *argv, "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def assert_lists_every_field(cls: type, text: str) -> None:
    keys = leaf_keys(cls)
    assert len(keys) >= 10
    missing = [k for k in keys if f"\n  {k}: " not in text]
    assert not missing, f"not in --help: {missing}"


def test_pretrain_help_lists_every_field(capsys):
    from pretrain.__main__ import main

    text = help_in_process(main, ["--help"], capsys)
    assert "config fields (set in the YAML file or as section.field=value):" in text
    assert_lists_every_field(PretrainConfig, text)
    max_steps = next(f.default for f in dataclasses.fields(ScheduleConfig) if f.name == "max_steps")
    assert f"  schedule.max_steps: int = {max_steps}\n" in text
    assert "Optimizer steps in this phase" in text
    lr = PretrainConfig().optimizer.lr
    assert f"  optimizer.lr: float = {lr}\n" in text
    assert "Peak learning rate (the schedule scales it)." in flat(text)
    assert "  optimizer: OptimizerConfig (section)\n" in text
    assert "  model.preset: {bert-tiny, bert-mini, bert-small, bert-base, bert-large} = " in text
    assert "  stop_after: int | None = null\n" in text
    assert "  optimizer.betas: tuple[float, float] = [" in text


def test_data_prep_help_lists_every_field():
    text = help_subprocess("data_prep")
    assert_lists_every_field(DataPrepConfig, text)
    assert "  sources[].name: str (required)\n" in text
    assert "  sources[].kind: {wikiextractor, text, jsonl, parquet, hub} (required)\n" in text
    assert "  tokenizer.vocab_size: int = 30522\n" in text
    assert "Size of a trained vocabulary (BERT's is 30,522)" in flat(text)
    assert "  instances.seq_lengths: list[int] = [128, 512]\n" in text
    assert "  instances: InstanceConfig (section)\n" in text
    assert "  seed: int = 12345\n" in text  # no docstring: still listed


def test_finetune_run_help_lists_every_field(capsys):
    from finetune.__main__ import main

    text = help_in_process(main, ["run", "--help"], capsys)
    assert "\n  doc_stride: int = 128\n" in help_subprocess("finetune", "run")
    assert_lists_every_field(FinetuneConfig, text)
    assert "  checkpoint: str (required)\n" in text
    assert "  doc_stride: int = 128\n" in text
    assert "SQuAD: overlap between windows of a long context." in text
    assert "  tasks: list[str] = [sst2, mrpc]\n" in text
    assert "  max_train_samples_per_task: dict[str, int] = {}\n" in text
    assert "  precision: {auto, fp32, bf16, fp16} = auto\n" in text


# ---------------------------------------------------------------------- the GPU benchmark


def test_bench_gpu_help_works_without_a_gpu():
    text = help_subprocess("bench.gpu")
    for option in ("--steps", "--warmup-steps", "--batch-size", "--precisions", "--optimizers"):
        assert option in text
    assert "--compile {off,on,both}" in text and "Needs a CUDA GPU" in flat(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA gets the message")
def test_bench_gpu_without_a_gpu_says_so_before_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--data-root", str(tmp_path / "missing")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    # the CUDA check comes first: the missing data folder is not even looked at
    assert proc.stderr.strip() == (
        "bench-gpu needs a CUDA GPU; none found (torch.cuda.is_available() is False)"
    )


# ---------------------------------------------------------------------- the generator itself


@dataclass
class Inner:
    """Inner section."""

    rate: float = 0.5
    """How fast it goes, a docstring long enough to be wrapped over more than one line of the
    help text when the width is small."""
    tags: list[str] = field(default_factory=lambda: ["a", "b"])


@dataclass
class Item:
    name: str
    """Name of the item."""
    size: int = 3


@dataclass
class Toy:
    """A toy config."""

    path: str
    """Where it lives."""
    mode: Literal["fast", "slow"] = "fast"
    """Pick a speed."""
    count: int | None = None
    undocumented: bool = True
    inner: Inner = field(default_factory=Inner)
    items: list[Item] = field(default_factory=list)
    pair: tuple[int, int] = (1, 2)
    table: dict[str, int] = field(default_factory=lambda: {"x": 1})
    label: str = "1.5"
    """A string that reads as a number in YAML is quoted."""


@dataclass
class Custom:
    inner: Inner = field(default_factory=lambda: Inner(rate=0.25))


def test_describe_config_fields():
    docs = {d.key: d for d in describe_config(Toy)}
    assert list(docs) == [
        "path",
        "mode",
        "count",
        "undocumented",
        "inner",
        "inner.rate",
        "inner.tags",
        "items",
        "items[].name",
        "items[].size",
        "pair",
        "table",
        "label",
    ]
    assert (docs["path"].type, docs["path"].default, docs["path"].doc) == (
        "str",
        "(required)",
        "Where it lives.",
    )
    assert (docs["mode"].type, docs["mode"].default) == ("{fast, slow}", "fast")
    assert docs["mode"].doc == "Pick a speed."
    assert (docs["count"].type, docs["count"].default) == ("int | None", "null")
    assert (docs["undocumented"].default, docs["undocumented"].doc) == ("true", "")
    assert docs["inner"].section and docs["inner"].default == "(section)"
    assert docs["inner"].doc == "Inner section."  # the class docstring stands in
    assert docs["inner.rate"].doc.startswith("How fast it goes")
    assert (docs["inner.tags"].type, docs["inner.tags"].default) == ("list[str]", "[a, b]")
    assert docs["items"].section and docs["items"].default == "[]"
    assert docs["items[].name"].doc == "Name of the item."
    assert docs["items[].name"].default == "(required)"
    assert (docs["pair"].type, docs["pair"].default) == ("tuple[int, int]", "[1, 2]")
    assert (docs["table"].type, docs["table"].default) == ("dict[str, int]", "{x: 1}")
    assert docs["label"].default == '"1.5"'


def test_section_defaults_come_from_the_parent_factory():
    docs = {d.key: d for d in describe_config(Custom)}
    assert docs["inner.rate"].default == "0.25"


def test_config_help_text():
    text = config_help(Toy, heading="fields:", width=60)
    lines = text.splitlines()
    assert lines[0] == "fields:"
    assert "  path: str (required)" in lines
    assert "  mode: {fast, slow} = fast" in lines
    assert "  undocumented: bool = true" in lines
    assert "  inner.rate: float = 0.5" in lines
    doc_lines = lines[lines.index("  inner.rate: float = 0.5") + 1 :][:2]
    assert all(line.startswith("      ") and len(line) <= 60 for line in doc_lines)
    assert "How fast it goes" in doc_lines[0]
    assert "  items[].name: str (required)" in lines
    assert lines[lines.index("  inner: Inner (section)") - 1] == ""


def test_describe_config_rejects_a_non_dataclass():
    with pytest.raises(TypeError):
        describe_config(dict)
