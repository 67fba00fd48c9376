"""GLUE task readers: the original TSV layouts, errors, name spellings, the hub path offline.

The fixtures are invented sentences written in each task's exact GLUE layout. The tests at the end
check the real files when the shared data folder exists (``$SHARED_DATA/glue``, by default
``<checkout>/../shared/data/glue``) and skip otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
from collections import Counter
from pathlib import Path

import pytest

from finetune.glue_tasks import TASKS, Example, GlueTask, get_task
from tests.helpers.paths import SHARED_DATA

# ----------------------------------------------------------------------------- fixtures

_MNLI_TRAIN_HEADER = (
    "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
    "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label"
)
_MNLI_DEV_HEADER = _MNLI_TRAIN_HEADER.replace(
    "label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label"
)
_STSB_HEADER = (
    "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
)


def _mnli_row(index: int, genre: str, a: str, b: str, label: str, votes: int) -> str:
    """An MNLI row with ``votes`` annotator labels (1 in train, 5 in dev) and the gold label."""
    parses = ["( x )", "( y )", "(ROOT x)", "(ROOT y)"]
    labels = [label] * (votes + 1)
    return "\t".join([str(index), "31", f"31{index}e", genre, *parses, a, b, *labels])


# Task folder -> file -> exact file content (lines joined by "\n").
FILES: dict[str, dict[str, list[str]]] = {
    "CoLA": {  # no header; source, label, original marker, sentence
        "train.tsv": [
            "src_a\t1\t\tThe kettle whistled on the stove.",
            'src_a\t0\t*\tWhistled kettle the "on stove.',
            "src_b\t0\t?*\tShe seems sleeping the piano.",
        ],
        "dev.tsv": ["src_c\t1\t\tMost ferries leave before noon."],
    },
    "SST-2": {
        "train.tsv": [
            "sentence\tlabel",
            'a "quietly stunning piece of work \t1',  # an unbalanced quote, as in GLUE
            "it drags , and then it drags some more\t0",
        ],
        "dev.tsv": ["sentence\tlabel", "clumsy , loud and forgettable\t0"],
    },
    "MRPC": {
        "train.tsv": [
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            "1\t501\t502\tThe council passed the budget on Monday.\tOn Monday the budget passed.",
            "0\t503\t504\tShares rose 3 percent.\tThe bakery opened a second shop.",
        ],
        "dev.tsv": [
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            "1\t505\t506\tHe left early.\tHe departed ahead of time.",
        ],
    },
    "STS-B": {
        "train.tsv": [
            _STSB_HEADER,
            "0\tmain-captions\tMSRvid\t2012\t0001\tnone\tnone\tDogs run.\tA dog runs fast.\t4.750",
            "1\tmain-news\theadlines\t2015\t0002\tnone\tnone\tMarkets fell.\tA cat slept.\t0.000",
        ],
        "dev.tsv": [
            _STSB_HEADER,
            "0\tmain-forums\tdeft\t2014\t0003\tnone\tnone\tI like tea.\tTea is nice.\t5",
        ],
    },
    "QQP": {
        "train.tsv": [
            "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            "7\t11\t12\tHow do I bake bread?\tWhat is the way to bake bread?\t1",
            "8\t13\t14\tWhy is the sky blue?\tHow tall is a giraffe?\t0",
        ],
        "dev.tsv": [
            "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
            '9\t15\t16\tWhat does "ok" mean?\tWhere is the "ok" sign from?\t0',
        ],
    },
    "MNLI": {
        "train.tsv": [
            _MNLI_TRAIN_HEADER,
            _mnli_row(
                0, "fiction", "The door was open.", "The door was not shut.", "entailment", 1
            ),
            _mnli_row(1, "travel", "The bus is late.", "It rained.", "neutral", 1),
            _mnli_row(2, "slate", "Nobody came.", "Everyone came.", "contradiction", 1),
        ],
        "dev_matched.tsv": [
            _MNLI_DEV_HEADER,
            _mnli_row(0, "slate", "The shop sells maps.", "Maps are sold there.", "entailment", 5),
        ],
        "dev_mismatched.tsv": [
            _MNLI_DEV_HEADER,
            _mnli_row(0, "letters", "We thank you.", "We are ungrateful.", "contradiction", 5),
            _mnli_row(1, "oup", "The report is long.", "It has charts.", "neutral", 5),
        ],
    },
    "QNLI": {
        "train.tsv": [
            "index\tquestion\tsentence\tlabel",
            "0\tWhat colour is the barn?\tThe barn is painted red.\tentailment",
            "1\tWho built the bridge?\tThe river is wide.\tnot_entailment",
        ],
        "dev.tsv": [
            "index\tquestion\tsentence\tlabel",
            "0\tWhen does it open?\tIt opens at nine.\tentailment",
        ],
    },
    "RTE": {
        "train.tsv": [
            "index\tsentence1\tsentence2\tlabel",
            "0\tThe orchard grows pears and plums.\tThe orchard grows fruit.\tentailment",
            "1\tThe museum closed in May.\tThe museum is open.\tnot_entailment",
        ],
        "dev.tsv": [
            "index\tsentence1\tsentence2\tlabel",
            "0\tA boy kicked a ball.\tA ball was kicked.\tentailment",
        ],
    },
    "WNLI": {
        "train.tsv": [
            "index\tsentence1\tsentence2\tlabel",
            "0\tThe jar did not fit the box because it was big.\tThe jar was big.\t1",
            "1\tThe jar did not fit the box because it was big.\tThe box was big.\t0",
        ],
        "dev.tsv": [
            "index\tsentence1\tsentence2\tlabel",
            "0\tAnna thanked Mia because she had helped.\tMia had helped.\t1",
        ],
    },
}
NO_FINAL_NEWLINE = {("CoLA", "dev.tsv")}  # like the real CoLA/dev.tsv

# Task name -> split -> expected examples.
EXPECTED: dict[str, dict[str, list[Example]]] = {
    "cola": {
        "train": [
            Example("train-0", "The kettle whistled on the stove.", None, 1),
            Example("train-1", 'Whistled kettle the "on stove.', None, 0),
            Example("train-2", "She seems sleeping the piano.", None, 0),
        ],
        "validation": [Example("validation-0", "Most ferries leave before noon.", None, 1)],
    },
    "sst2": {
        "train": [
            Example("train-0", 'a "quietly stunning piece of work ', None, 1),
            Example("train-1", "it drags , and then it drags some more", None, 0),
        ],
        "validation": [Example("validation-0", "clumsy , loud and forgettable", None, 0)],
    },
    "mrpc": {
        "train": [
            Example(
                "train-0",
                "The council passed the budget on Monday.",
                "On Monday the budget passed.",
                1,
            ),
            Example("train-1", "Shares rose 3 percent.", "The bakery opened a second shop.", 0),
        ],
        "validation": [Example("validation-0", "He left early.", "He departed ahead of time.", 1)],
    },
    "stsb": {
        "train": [
            Example("train-0", "Dogs run.", "A dog runs fast.", 4.75),
            Example("train-1", "Markets fell.", "A cat slept.", 0.0),
        ],
        "validation": [Example("validation-0", "I like tea.", "Tea is nice.", 5.0)],
    },
    "qqp": {
        "train": [
            Example("train-0", "How do I bake bread?", "What is the way to bake bread?", 1),
            Example("train-1", "Why is the sky blue?", "How tall is a giraffe?", 0),
        ],
        "validation": [
            Example("validation-0", 'What does "ok" mean?', 'Where is the "ok" sign from?', 0)
        ],
    },
    "mnli": {
        "train": [
            Example("train-0", "The door was open.", "The door was not shut.", 0),
            Example("train-1", "The bus is late.", "It rained.", 1),
            Example("train-2", "Nobody came.", "Everyone came.", 2),
        ],
        "validation_matched": [
            Example("validation_matched-0", "The shop sells maps.", "Maps are sold there.", 0)
        ],
        "validation_mismatched": [
            Example("validation_mismatched-0", "We thank you.", "We are ungrateful.", 2),
            Example("validation_mismatched-1", "The report is long.", "It has charts.", 1),
        ],
    },
    "qnli": {
        "train": [
            Example("train-0", "What colour is the barn?", "The barn is painted red.", 0),
            Example("train-1", "Who built the bridge?", "The river is wide.", 1),
        ],
        "validation": [Example("validation-0", "When does it open?", "It opens at nine.", 0)],
    },
    "rte": {
        "train": [
            Example("train-0", "The orchard grows pears and plums.", "The orchard grows fruit.", 0),
            Example("train-1", "The museum closed in May.", "The museum is open.", 1),
        ],
        "validation": [Example("validation-0", "A boy kicked a ball.", "A ball was kicked.", 0)],
    },
    "wnli": {
        "train": [
            Example(
                "train-0", "The jar did not fit the box because it was big.", "The jar was big.", 1
            ),
            Example(
                "train-1", "The jar did not fit the box because it was big.", "The box was big.", 0
            ),
        ],
        "validation": [
            Example(
                "validation-0", "Anna thanked Mia because she had helped.", "Mia had helped.", 1
            )
        ],
    },
}

# name -> (folder, labels, metric names)
ATTRIBUTES = {
    "cola": ("CoLA", ("unacceptable", "acceptable"), ("matthews_correlation",)),
    "sst2": ("SST-2", ("negative", "positive"), ("accuracy",)),
    "mrpc": ("MRPC", ("not_equivalent", "equivalent"), ("accuracy", "f1")),
    "stsb": ("STS-B", None, ("pearson", "spearmanr")),
    "qqp": ("QQP", ("not_duplicate", "duplicate"), ("accuracy", "f1")),
    "mnli": ("MNLI", ("entailment", "neutral", "contradiction"), ("accuracy",)),
    "qnli": ("QNLI", ("entailment", "not_entailment"), ("accuracy",)),
    "rte": ("RTE", ("entailment", "not_entailment"), ("accuracy",)),
    "wnli": ("WNLI", ("not_entailment", "entailment"), ("accuracy",)),
}


def _write(path: Path, lines: list[str], final_newline: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + ("\n" if final_newline else "")).encode("utf-8"))
    return path


@pytest.fixture
def glue_root(tmp_path: Path) -> Path:
    """All nine tasks in the layout of download_glue_data.py."""
    root = tmp_path / "glue"
    for folder, files in FILES.items():
        for file, lines in files.items():
            _write(root / folder / file, lines, (folder, file) not in NO_FINAL_NEWLINE)
    return root


# ----------------------------------------------------------------------------- the tasks


def test_registry_attributes():
    assert list(TASKS) == list(ATTRIBUTES)
    for name, (folder, labels, metrics) in ATTRIBUTES.items():
        task = TASKS[name]
        assert isinstance(task, GlueTask)
        assert (task.name, task.folder, task.hub_config) == (name, folder, name)
        assert task.labels == labels
        assert task.metric_names == metrics
        assert task.is_regression is (labels is None)
        assert task.num_labels == (1 if labels is None else len(labels))
        expected_splits = (
            {"validation_matched": "dev_matched.tsv", "validation_mismatched": "dev_mismatched.tsv"}
            if name == "mnli"
            else {"validation": "dev.tsv"}
        )
        assert task.eval_splits == expected_splits


@pytest.mark.parametrize("name", list(EXPECTED))
def test_load_local_layouts(glue_root: Path, name: str):
    task = TASKS[name]
    assert set(EXPECTED[name]) == {"train", *task.eval_splits}
    for split, expected in EXPECTED[name].items():
        examples = task.load(split, glue_root)
        assert examples == expected, (name, split)
        for ex in examples:
            assert type(ex.label) is (float if task.is_regression else int)
    # str data_root works too
    assert task.load("train", str(glue_root)) == EXPECTED[name]["train"]


def test_crlf_line_endings(tmp_path: Path):
    path = tmp_path / "SST-2" / "dev.tsv"
    path.parent.mkdir()
    path.write_bytes(b"sentence\tlabel\r\nfine work\t1\r\nweak\t0\r\n")
    assert get_task("sst2").load("validation", tmp_path) == [
        Example("validation-0", "fine work", None, 1),
        Example("validation-1", "weak", None, 0),
    ]


# ----------------------------------------------------------------------------- errors


def test_missing_task_folder_names_folder_and_file(tmp_path: Path):
    (tmp_path / "CoLA").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        get_task("sst2").load("train", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "SST-2") in message
    assert "train.tsv" in message
    assert "download_glue_data.py" in message
    assert "data_root=None" in message


def test_missing_data_root_is_said(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_task("rte").load("validation", tmp_path / "nowhere")


def test_missing_split_file_in_existing_folder(glue_root: Path):
    (glue_root / "MNLI" / "dev_mismatched.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="dev_mismatched.tsv"):
        get_task("mnli").load("validation_mismatched", glue_root)


def test_unknown_split(glue_root: Path):
    with pytest.raises(ValueError, match="validation_matched"):
        get_task("mnli").load("validation", glue_root)
    with pytest.raises(ValueError, match="no split 'test'"):
        get_task("rte").load("test", glue_root)


@pytest.mark.parametrize(
    ("folder", "lines", "bad_line", "expected"),
    [
        ("SST-2", ["sentence\tlabel", "good\t1", "no label column here"], 3, "2 tab-separated"),
        ("CoLA", ["s\t1\t\tFine.", "s\t1\tToo few."], 2, "4 tab-separated"),
        ("RTE", ["index\tsentence1\tsentence2\tlabel", "0\tA.\tB.\tentailment\textra"], 2, "4"),
        ("SST-2", ["sentence\tlabel", "", "good\t1"], 2, "2 tab-separated"),  # blank line
        ("QNLI", ["index\tquestion\tsentence\tlabel", "0\tQ?\tS.\tentailed"], 2, "unknown label"),
        ("MRPC", ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "2\t1\t2\tA.\tB."], 2, "'0'"),
        ("CoLA", ["s\tyes\t\tFine."], 1, "unknown label 'yes'"),
        ("STS-B", [_STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\thigh"], 2, "not a number"),
        ("STS-B", [_STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\t7.5"], 2, "outside"),
        ("STS-B", [_STSB_HEADER, "0\tg\tf\ty\t1\tn\tn\tA.\tB.\tnan"], 2, "outside"),
    ],
)
def test_malformed_row_names_file_and_line(
    tmp_path: Path, folder: str, lines: list[str], bad_line: int, expected: str
):
    path = _write(tmp_path / folder / "dev.tsv", lines)
    task = get_task(folder)
    with pytest.raises(ValueError) as err:
        task.load("validation", tmp_path)
    message = str(err.value)
    assert str(path) in message
    assert f"line {bad_line}" in message
    assert expected in message


def test_unknown_mnli_label(glue_root: Path):
    path = glue_root / "MNLI" / "train.tsv"
    lines = FILES["MNLI"]["train.tsv"] + [_mnli_row(3, "slate", "A.", "B.", "-", 1)]
    _write(path, lines)
    with pytest.raises(ValueError, match=r"line 5, column 'gold_label': unknown label '-'"):
        get_task("mnli").load("train", glue_root)


@pytest.mark.parametrize(
    "content", [b"", b"\n", b"sentence\tlabel\n", b"\xef\xbb\xbfsentence\tlabel"]
)
def test_empty_or_header_only_file(tmp_path: Path, content: bytes):
    path = tmp_path / "SST-2" / "train.tsv"
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        get_task("sst2").load("train", tmp_path)
    assert str(path) in str(err.value)


def test_header_of_another_layout(tmp_path: Path):
    path = _write(tmp_path / "QQP" / "train.tsv", ["question\tlabel", "Why?\t1"])
    with pytest.raises(ValueError, match="line 1.*question1"):
        get_task("qqp").read_tsv(path, "train")


def test_not_utf8(tmp_path: Path):
    path = tmp_path / "SST-2" / "dev.tsv"
    path.parent.mkdir()
    path.write_bytes(b"sentence\tlabel\ncaf\xe9\t1\n")
    with pytest.raises(ValueError, match="UTF-8"):
        get_task("sst2").load("validation", tmp_path)


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("sst2", "sst2"),
        ("SST-2", "sst2"),
        ("sst-2", "sst2"),
        ("Sst_2", "sst2"),
        ("sts-b", "stsb"),
        ("STS-B", "stsb"),
        ("stsb", "stsb"),
        ("CoLA", "cola"),
        ("MNLI", "mnli"),
        (" qnli ", "qnli"),
        ("WNLI", "wnli"),
    ],
)
def test_get_task_spellings(spelling: str, name: str):
    assert get_task(spelling) is TASKS[name]


def test_get_task_unknown_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_task("squad")
    for name in TASKS:
        assert name in str(err.value)


# ----------------------------------------------------------------------------- hub


def test_hub_offline_gives_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    # Import first, so that the offline environment below does not stay baked into the
    # modules' import-time constants for later tests; then patch those constants (undone after).
    hub_modules = []
    for module in ("huggingface_hub.constants", "datasets.config"):
        with contextlib.suppress(ImportError):  # without datasets, load() must fail clearly too
            hub_modules.append(importlib.import_module(module))
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    caches = {"HF_HUB_CACHE": tmp_path / "hub", "HF_DATASETS_CACHE": tmp_path / "datasets"}
    for var, cache in caches.items():  # an empty cache: no copy of GLUE from earlier runs
        monkeypatch.setenv(var, str(cache))
    for module in hub_modules:
        for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            monkeypatch.setattr(module, flag, True, raising=False)
        for var, cache in caches.items():
            if hasattr(module, var):
                kind = type(getattr(module, var))
                monkeypatch.setattr(module, var, kind(cache))
    with pytest.raises(RuntimeError) as err:
        get_task("sst2").load("validation", None)
    message = str(err.value)
    assert "nyu-mll/glue" in message
    assert "data_root" in message
    assert "SST-2/dev.tsv" in message


# Hub feature names of (text_a, text_b), as nyu-mll/glue spells them.
HUB_FIELDS = {
    "cola": ("sentence", None),
    "sst2": ("sentence", None),
    "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}


@pytest.mark.parametrize("name", list(HUB_FIELDS))
def test_hub_rows_map_to_examples(monkeypatch: pytest.MonkeyPatch, name: str):
    """The hub path's field mapping, with load_dataset replaced by an in-memory dataset."""
    datasets = pytest.importorskip("datasets")
    a_field, b_field = HUB_FIELDS[name]
    split = "validation_mismatched" if name == "mnli" else "validation"
    labels = [0.5, 3.25] if name == "stsb" else [1, 0]
    columns = {a_field: ["First a.", "Second a."], "label": labels, "idx": [0, 1]}
    if b_field is not None:
        columns[b_field] = ["First b.", "Second b."]
    calls = []

    def fake_load_dataset(path, config, split):
        calls.append((path, config, split))
        return datasets.Dataset.from_dict(columns)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = get_task(name).load(split, None)
    assert calls == [("nyu-mll/glue", name, split)]
    b_texts = [None, None] if b_field is None else ["First b.", "Second b."]
    assert examples == [
        Example(f"{split}-0", "First a.", b_texts[0], labels[0]),
        Example(f"{split}-1", "Second a.", b_texts[1], labels[1]),
    ]
    assert all(type(ex.label) is type(labels[0]) for ex in examples)


def test_hub_unlabelled_rows_are_rejected(monkeypatch: pytest.MonkeyPatch):
    datasets = pytest.importorskip("datasets")
    rows = {"sentence1": ["A."], "sentence2": ["B."], "label": [-1]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_dict(rows))
    with pytest.raises(ValueError, match="row 0: label -1"):
        get_task("rte").load("train", None)


# ----------------------------------------------------------------------------- real files


def _shared_glue() -> Path:
    return SHARED_DATA / "glue"


@pytest.fixture
def real_glue() -> Path:
    root = _shared_glue()
    if not root.is_dir():
        pytest.skip(f"no shared GLUE data at {root}")
    return root


def _load_real(root: Path, name: str, split: str) -> list[Example]:
    task = get_task(name)
    if not (root / task.folder / task.split_files[split]).is_file():
        pytest.skip(f"{task.folder}/{task.split_files[split]} not in {root}")
    return task.load(split, root)


def test_real_sst2(real_glue: Path):
    train = _load_real(real_glue, "sst2", "train")
    assert len(train) == 67_349
    assert Counter(ex.label for ex in train) == {0: 29_780, 1: 37_569}
    assert all(ex.text_b is None and ex.text_a for ex in train)
    assert len(_load_real(real_glue, "sst2", "validation")) == 872


def test_real_mrpc(real_glue: Path):
    assert len(_load_real(real_glue, "mrpc", "train")) == 3_668
    dev = _load_real(real_glue, "mrpc", "validation")
    assert len(dev) == 408
    assert Counter(ex.label for ex in dev) == {0: 129, 1: 279}
    assert not any(ex.text_a.startswith("\ufeff") for ex in dev)
    assert all(ex.text_a and ex.text_b for ex in dev)


def test_real_cola(real_glue: Path):
    assert len(_load_real(real_glue, "cola", "train")) == 8_551
    dev = _load_real(real_glue, "cola", "validation")
    assert len(dev) == 1_043
    assert {ex.label for ex in dev} == {0, 1}


def test_real_stsb(real_glue: Path):
    dev = _load_real(real_glue, "stsb", "validation")
    assert len(dev) == 1_500
    assert all(isinstance(ex.label, float) and 0.0 <= ex.label <= 5.0 for ex in dev)
    assert min(ex.label for ex in dev) == 0.0
    assert max(ex.label for ex in dev) == 5.0


def test_real_qnli(real_glue: Path):
    dev = _load_real(real_glue, "qnli", "validation")
    assert len(dev) == 5_463
    assert Counter(ex.label for ex in dev) == {0: 2_702, 1: 5_463 - 2_702}


def test_download_fetches_every_split_of_every_task_from_the_hub(monkeypatch):
    """``python -m finetune download`` (the login-node step of an offline cluster) loads
    each split the config's tasks use from the hub, through the loaders a run uses."""
    datasets = pytest.importorskip("datasets")
    from finetune.__main__ import download, main
    from finetune.config import FinetuneConfig

    calls = []

    def fake_load_dataset(path, config=None, split=None):
        calls.append((path, config, split))
        if path == "rajpurkar/squad":
            answers = {"text": ["a"], "answer_start": [0]}
            return [{"id": 1, "title": "t", "context": "a b", "question": "q", "answers": answers}]
        return datasets.Dataset.from_dict({"sentence1": ["A."], "sentence2": ["B."], "label": [1]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = FinetuneConfig(checkpoint="unused", tasks=["mrpc", "squad"])
    result = download(cfg)
    assert result["downloaded"] == {
        "mrpc/train": 1,
        "mrpc/validation": 1,
        "squad/train": 1,
        "squad/validation": 1,
    }
    assert calls == [
        ("nyu-mll/glue", "mrpc", "train"),
        ("nyu-mll/glue", "mrpc", "validation"),
        ("rajpurkar/squad", None, "train"),
        ("rajpurkar/squad", None, "validation"),
    ]
    # local files: nothing to fetch
    assert download(FinetuneConfig(checkpoint="unused", data_root="x"))["downloaded"] == {}

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["download", "checkpoint=unused", "tasks=[sst2]"]) == 2
