"""The offline smoke data: corpus from CPython's own docs, generated GLUE/SQuAD-like tasks."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import smoke_data
from finetune.glue_tasks import get_task
from finetune.squad import read_squad_json, split_by_article
from smoke_data import (
    TASK_SIZES,
    clean_text,
    smoke_documents,
    write_corpus,
    write_tasks,
)
from smoke_data.__main__ import main
from tests.helpers.paths import REPO

HEADER_COLUMNS = {"SST-2": 2, "MRPC": 5, "STS-B": 10}
LINE_BREAKS = re.compile("[\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")


def _files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header and rows of a TSV, split on tabs by hand (no quoting), as GLUE's readers do."""
    text = path.read_text(encoding="utf-8-sig")
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    return lines[0].split("\t"), [line.split("\t") for line in lines[1:]]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("smoke_data")
    write_corpus(directory)
    assert write_tasks(directory, seed=0) == directory
    return directory


# ----------------------------------------------------------------------------- determinism


def test_two_calls_write_identical_files(out, tmp_path):
    write_corpus(tmp_path)
    write_tasks(tmp_path, seed=0)
    assert _files(tmp_path) == _files(out)
    assert sorted(_files(out)) == [
        "MRPC/dev.tsv",
        "MRPC/train.tsv",
        "SST-2/dev.tsv",
        "SST-2/train.tsv",
        "STS-B/dev.tsv",
        "STS-B/train.tsv",
        "corpus.json",
        "corpus.jsonl",
        "squad/dev-v1.1.json",
    ]
    assert not [p for p in tmp_path.rglob("*.tmp")]  # atomic writes leave no temporaries


def test_a_fresh_process_with_another_hash_seed_writes_the_same_files(out, tmp_path):
    # The child imports the heavy libraries first: they patch standard-library modules
    # (transformers adds methods to logging.Logger), which must not change the corpus.
    code = (
        "import sys, torch, transformers, datasets\n"
        "from smoke_data.__main__ import main\n"
        "main(['--out', sys.argv[1]])\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path) == _files(out)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["tasks"] == {k: {"train": n, "dev": m} for k, (n, m) in TASK_SIZES.items()}


def test_another_seed_gives_other_tasks_and_the_same_corpus(out, tmp_path):
    write_tasks(tmp_path, seed=1)
    for name in ("SST-2/train.tsv", "MRPC/train.tsv", "STS-B/train.tsv", "squad/dev-v1.1.json"):
        assert (tmp_path / name).read_bytes() != (out / name).read_bytes(), name
    assert smoke_documents() == smoke_documents()


# ----------------------------------------------------------------------------- corpus


def test_corpus_size_and_format(out):
    lines = (out / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) > 50
    assert sum(len(t) for t in texts) > 300_000
    assert all(isinstance(t, str) and t.strip() and "\n\n" not in t for t in texts)
    assert len(set(texts)) == len(texts)
    counts = json.loads((out / "corpus.json").read_text(encoding="utf-8"))
    assert counts["documents"] == len(texts)
    assert counts["characters"] == sum(len(t) for t in texts)
    assert counts["bytes"] == (out / "corpus.jsonl").stat().st_size
    assert counts["documents_by_source"]["pydoc_topics"] > 30
    assert counts["documents_by_source"]["stdlib_docstrings"] > 30
    # the same documents as smoke_documents(), paragraphs separated by one line break
    assert texts == [d.replace("\n\n", "\n") for d in smoke_documents()]


def test_documents_are_clean_prose():
    docs = smoke_documents(min_chars=500)
    assert docs and all(len(d) >= 500 for d in docs)
    assert len(docs) < len(smoke_documents())
    paragraphs = [p for d in smoke_documents() for p in d.split("\n\n")]
    assert len(set(paragraphs)) == len(paragraphs)  # no paragraph repeated across documents
    for p in paragraphs:
        assert not p.startswith((">>>", "...", ".. ")), p
        assert "::=" not in p and ">>>" not in p, p
        assert not re.fullmatch(r"[*=\-~^]{3,}", p), p
        assert len(p.split()) >= 6, p


def test_clean_text_drops_markup_and_code_and_joins_wrapped_lines():
    text = """Assignment statements
*********************

Assignment statements are used to (re)bind names to values and
to modify attributes or items of mutable objects:

   assignment_stmt ::= (target_list "=")+ expression
   target_list     ::= target ("," target)*

.. note:: a directive line

An example follows, and it is code that must not appear:

   x = [1, 2]
   print(x)

>>> y = 3
... more

* A bullet item that is long enough to be a paragraph of its own.
* Another bullet item, which also carries *emphasis* and a footnote. [1]
"""
    assert clean_text(text) == [
        "Assignment statements are used to (re)bind names to values and to modify attributes "
        "or items of mutable objects:",
        "An example follows, and it is code that must not appear:",
        "A bullet item that is long enough to be a paragraph of its own.",
        "Another bullet item, which also carries emphasis and a footnote.",
    ]


# ----------------------------------------------------------------------------- GLUE-like tasks


@pytest.mark.parametrize("task", sorted(TASK_SIZES))
def test_tsv_layout_sizes_and_fields(out, task):
    for split, size in zip(("train", "dev"), TASK_SIZES[task], strict=True):
        path = out / task / f"{split}.tsv"
        raw = path.read_text(encoding="utf-8")
        assert not LINE_BREAKS.search(raw), "a line break other than \\n"
        header, rows = _rows(path)
        assert len(header) == HEADER_COLUMNS[task]
        assert len(rows) == size
        for row in rows:
            assert len(row) == len(header), row
            assert all(cell == cell.strip() and cell for cell in row), row
    assert (out / "MRPC" / "train.tsv").read_bytes().startswith("\ufeffQuality".encode())


@pytest.mark.parametrize("task", sorted(TASK_SIZES))
def test_the_finetuning_readers_accept_the_tsvs(out, task):
    glue_task = get_task(task)
    for split, size in zip(("train", "validation"), TASK_SIZES[task], strict=True):
        examples = glue_task.load(split, data_root=out)
        assert len(examples) == size
        assert all(ex.text_a for ex in examples)
        assert all((ex.text_b is None) == (task == "SST-2") for ex in examples)


def test_sst2_is_balanced_and_learnable(out):
    _, train = _rows(out / "SST-2" / "train.tsv")
    _, dev = _rows(out / "SST-2" / "dev.tsv")
    for rows in (train, dev):
        share = sum(label == "1" for _, label in rows) / len(rows)
        assert 0.35 <= share <= 0.65
    sentences = [s for s, _ in train + dev]
    assert len(set(sentences)) == len(sentences)  # no sentence in both splits, or twice

    # A unigram naive Bayes classifier already beats chance by far: the label is in the text.
    def words(s: str) -> list[str]:
        return re.findall(r"\w+", s.lower())

    counts = {"0": Counter(), "1": Counter()}
    for s, label in train:
        counts[label].update(words(s))
    vocab = len(set(counts["0"]) | set(counts["1"]))
    totals = {k: sum(c.values()) for k, c in counts.items()}

    def predict(s: str) -> str:
        score = {
            k: sum(math.log((counts[k][w] + 1) / (totals[k] + vocab)) for w in words(s))
            for k in counts
        }
        return max(score, key=score.get)

    accuracy = sum(predict(s) == label for s, label in dev) / len(dev)
    assert accuracy > 0.7


def test_mrpc_is_balanced_and_positives_are_near_copies(out):
    for split in ("train", "dev"):
        _, rows = _rows(out / "MRPC" / f"{split}.tsv")
        share = sum(row[0] == "1" for row in rows) / len(rows)
        assert 0.35 <= share <= 0.65
        for label, id1, id2, s1, s2 in rows:
            assert label in ("0", "1") and id1.isdigit() and id2.isdigit()
            w1, w2 = s1.split(), s2.split()
            if label == "0":
                assert s1 != s2
                continue
            if len(w2) == len(w1):  # two adjacent words swapped
                diff = [i for i in range(len(w1)) if w1[i] != w2[i]]
                assert diff == [] or (len(diff) == 2 and diff[1] == diff[0] + 1), (s1, s2)
                assert sorted(w1) == sorted(w2)
            else:  # one or two words dropped
                assert len(w1) - len(w2) in (1, 2), (s1, s2)
                it = iter(w1)
                assert all(w in it for w in w2), (s1, s2)  # a subsequence


def test_stsb_scores_are_word_overlap(out):
    scores = []
    for split in ("train", "dev"):
        header, rows = _rows(out / "STS-B" / f"{split}.tsv")
        assert header[-3:] == ["sentence1", "sentence2", "score"]
        for row in rows:
            s1, s2, score = row[7], row[8], float(row[9])
            assert 0.0 <= score <= 5.0
            a = {t.lower() for t in re.findall(r"\w+", s1)}
            b = {t.lower() for t in re.findall(r"\w+", s2)}
            assert score == round(5 * len(a & b) / len(a | b), 2)
            scores.append(score)
    # spread over the range, not piled at one end
    bins = Counter(min(int(s), 4) for s in scores)
    assert all(bins[b] > len(scores) / 20 for b in range(5)), bins


# ----------------------------------------------------------------------------- SQuAD-like


def test_squad_answers_point_at_their_text(out):
    root = json.loads((out / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
    articles = root["data"]
    assert 35 <= len(articles) <= 45
    assert len({a["title"] for a in articles}) == len(articles)
    questions = 0
    for article in articles:
        assert 3 <= len(article["paragraphs"]) <= 5
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            assert 2 <= len(paragraph["qas"]) <= 3
            for qa in paragraph["qas"]:
                (answer,) = qa["answers"]
                start, text = answer["answer_start"], answer["text"]
                assert context[start : start + len(text)] == text
                assert 1 <= len(text.split()) <= 3
                cue = re.fullmatch(r'What comes after "(.+)"\?', qa["question"]).group(1)
                assert len(cue.split()) == 3
                assert context[start - len(cue) - 1 : start] == cue + " "
                questions += 1
    assert 300 <= questions <= 600

    # the fine-tuning reader validates every answer_start too, and can split by article
    examples = read_squad_json(out / "squad" / "dev-v1.1.json")
    assert len(examples) == questions
    assert len({ex.id for ex in examples}) == questions
    train, evaluation = split_by_article(examples)
    assert train and evaluation
    assert not {ex.title for ex in train} & {ex.title for ex in evaluation}


# ----------------------------------------------------------------------------- CLI


def test_main_prints_a_one_line_summary(out, tmp_path, capsys):
    summary = main(["--out", str(tmp_path)])
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0]) == summary
    assert summary["documents"] == json.loads((out / "corpus.json").read_text())["documents"]
    assert summary["squad"]["articles"] == smoke_data.SQUAD_ARTICLES
    assert _files(tmp_path) == _files(out)
