"""Tests for finetune/squad.py: reading SQuAD v1.1, windowed features, post-processing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from finetune.squad import (
    SquadExample,
    load_squad,
    postprocess_predictions,
    prepare_eval_features,
    prepare_train_features,
    read_squad_json,
    split_by_article,
)
from tests.helpers.paths import SHARED_DATA

BERT_VOCAB = SHARED_DATA / "bert_vocab" / "uncased" / "vocab.txt"
SQUAD_DEV = SHARED_DATA / "squad" / "dev-v1.1.json"

MAX_LEN, STRIDE = 64, 16  # small windows so a few hundred words need several of them

_VOCABULARY = (
    "the a of and to in is was for on with as by at from that this it river mountain city "
    "house garden winter summer music history school library bridge market village quickly "
    "slowly green old new small large ancient famous built wrote played discovered what who "
    "when where which how many year king queen north south cafe museum tower harbor"
)
_WORDS = _VOCABULARY.split()


def _make_tokenizer(vocab: Path):
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    # transformers 5 ignores BertTokenizerFast(vocab_file=...); build from a tokenizers object.
    wordpiece = BertWordPieceTokenizer(str(vocab), lowercase=True)
    return BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=True)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A BERT tokenizer over a tiny vocabulary written here (no shared data needed)."""
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *".,;:?!'\"()-"]
    vocab += sorted(set(_WORDS)) + list(letters) + [f"##{c}" for c in letters]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(dict.fromkeys(vocab)) + "\n", encoding="utf-8")
    return _make_tokenizer(path)


def _crafted_examples() -> list[SquadExample]:
    """A ~400-word context (several 64-token windows) with answers spread across it."""
    rng = random.Random(7)
    filler = [w for w in _WORDS if w not in {"what", "who", "when", "where", "which", "how"}]
    words = [rng.choice(filler) for _ in range(400)]
    # Distinctive answers: capitals, an accented word the tokenizer normalises (offsets still
    # point at the original text), an out-of-vocabulary word ([UNK]), punctuation, numbers.
    words[5:7] = ["Old", "Bridge"]
    words[60:63] = ["Café", "Museum,", "1887"]
    words[130:132] = ["Ωmega", "Tower"]
    words[200:204] = ["(North", "Harbor)", "in", "1920"]
    words[330:332] = ["King", "Harold"]
    words[397:400] = ["the", "Green", "Market."]
    context = " ".join(words)

    def ex(i: int, question: str, answer: str, occurrence: int = 0) -> SquadExample:
        start = -1
        for _ in range(occurrence + 1):
            start = context.index(answer, start + 1)
        return SquadExample(
            id=f"q{i}",
            title="Crafted",
            context=context,
            question=question,
            answers={"text": [answer, answer.lower()], "answer_start": [start, start]},
        )

    answers = ["Old Bridge", "Café Museum, 1887", "Ωmega Tower", "(North Harbor) in 1920"]
    answers += ["King Harold", "Green Market."]
    examples = [ex(i, f"what is answer {i}?", a) for i, a in enumerate(answers)]
    # Plain filler words at many positions, so some answers sit in the overlap of two windows.
    for k, pos in enumerate(range(20, 400, 23)):
        word = words[pos]
        start = len(" ".join(words[:pos])) + (1 if pos else 0)
        assert context[start : start + len(word)] == word
        examples.append(
            SquadExample(
                id=f"f{k}",
                title="Crafted",
                context=context,
                question=f"which word is at {pos}?",
                answers={"text": [word], "answer_start": [start]},
            )
        )
    return examples


def _window_context_range(offsets) -> tuple[int, int]:
    spans = [o for o in offsets if o is not None]
    return spans[0][0], spans[-1][1]


def _check_train_labels(examples, train, evalf, max_length=MAX_LEN, normalise=lambda s: s):
    """Every window: labelled tokens are the smallest span covering the first answer (equal to
    it when the answer is token-aligned), or CLS when the answer is not fully in the window.
    Returns (labelled windows per example id, number of labelled windows that are not exact)."""
    by_id = {ex.id: ex for ex in examples}
    assert train["input_ids"] == evalf["input_ids"]  # the same windows
    labelled: dict[str, int] = {}
    inexact = 0
    for i, (s, e) in enumerate(zip(train["start_positions"], train["end_positions"], strict=True)):
        ex = by_id[evalf["example_id"][i]]
        offsets = evalf["offset_mapping"][i]
        assert len(train["input_ids"][i]) == len(offsets) == max_length
        start_char = ex.answers["answer_start"][0]
        end_char = start_char + len(ex.answers["text"][0])
        lo, hi = _window_context_range(offsets)
        if not (lo <= start_char and end_char <= hi):
            assert s == e == 0, (ex.id, i)
            continue
        labelled[ex.id] = labelled.get(ex.id, 0) + 1
        assert 0 < s <= e
        assert offsets[s] is not None and offsets[e] is not None
        assert offsets[s][0] <= start_char < offsets[s][1]
        assert offsets[e][0] < end_char <= offsets[e][1]
        decoded = ex.context[offsets[s][0] : offsets[e][1]]
        answer = ex.answers["text"][0]
        if normalise(decoded) != normalise(answer):
            inexact += 1
            assert answer in decoded  # only possible when the answer is not token-aligned
            token_starts = {o[0] for o in offsets if o is not None}
            token_ends = {o[1] for o in offsets if o is not None}
            assert start_char not in token_starts or end_char not in token_ends
    return labelled, inexact


def _perfect_logits(train, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (len(train["input_ids"]), len(train["input_ids"][0]))
    start, end = rng.normal(size=shape), rng.normal(size=shape)
    for i, (s, e) in enumerate(zip(train["start_positions"], train["end_positions"], strict=True)):
        if s:  # a window that holds the answer
            start[i, s] = end[i, e] = 20.0
    return start, end


# ---------------------------------------------------------------------------------------------
# Features and post-processing on crafted examples
# ---------------------------------------------------------------------------------------------


def test_train_features_label_answers_in_every_window(small_tokenizer):
    examples = _crafted_examples()
    train = prepare_train_features(examples, small_tokenizer, MAX_LEN, STRIDE)
    evalf = prepare_eval_features(examples, small_tokenizer, MAX_LEN, STRIDE)
    assert set(train) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "start_positions",
        "end_positions",
    }
    assert set(evalf) == {
        "input_ids",
        "token_type_ids",
        "attention_mask",
        "example_id",
        "offset_mapping",
    }
    n_windows = len(train["input_ids"])
    assert all(len(col) == n_windows for col in [*train.values(), *evalf.values()])
    assert all(len(row) == MAX_LEN for row in train["input_ids"])
    per_example = n_windows // len(examples)
    assert per_example >= 5  # the context really needs several windows

    labelled, inexact = _check_train_labels(examples, train, evalf)
    assert inexact == 0  # every crafted answer is token-aligned
    assert set(labelled) == {ex.id for ex in examples}  # each answer is in some window
    assert max(labelled.values()) >= 2  # and at least one is in two overlapping windows

    # Windows are [CLS] question [SEP] context [SEP] [PAD]...; offsets only on context tokens.
    cls, sep = small_tokenizer.cls_token_id, small_tokenizer.sep_token_id
    for ids, types, mask, offsets in zip(
        train["input_ids"],
        train["token_type_ids"],
        train["attention_mask"],
        evalf["offset_mapping"],
        strict=True,
    ):
        assert ids[0] == cls
        n_real = sum(mask)
        assert ids[n_real - 1] == sep and all(t == 0 for t in ids[n_real:])
        context_tokens = [j for j, o in enumerate(offsets) if o is not None]
        assert context_tokens == list(range(context_tokens[0], n_real - 1))
        assert ids[context_tokens[0] - 1] == sep
        assert all(types[j] == 1 for j in context_tokens)
        assert all(types[j] == 0 for j in range(context_tokens[0]))


def test_sub_token_answer_gets_covering_span(small_tokenizer):
    context = "the river museum was built in 1887 by the old king"
    start = context.index("useu")  # inside the single token "museum"
    example = SquadExample("s", "t", context, "what?", {"text": ["useu"], "answer_start": [start]})
    train = prepare_train_features([example], small_tokenizer, MAX_LEN, STRIDE)
    evalf = prepare_eval_features([example], small_tokenizer, MAX_LEN, STRIDE)
    _, inexact = _check_train_labels([example], train, evalf)
    assert inexact == 1
    offsets = evalf["offset_mapping"][0]
    s, e = train["start_positions"][0], train["end_positions"][0]
    assert context[offsets[s][0] : offsets[e][1]] == "museum"


def test_a_tokenizers_release_that_drops_overflowing_windows_is_refused(
    small_tokenizer, monkeypatch
):
    import finetune.squad as squad

    for version in squad.BROKEN_TOKENIZERS:
        monkeypatch.setattr(squad, "_tokenizers_version", lambda v=version: v)
        with pytest.raises(RuntimeError, match=r"tokenizers#2091.*tokenizers>=0.23.3"):
            prepare_train_features(_crafted_examples(), small_tokenizer, MAX_LEN, STRIDE)
        with pytest.raises(RuntimeError, match="drops the overflowing windows"):
            prepare_eval_features(_crafted_examples(), small_tokenizer, MAX_LEN, STRIDE)
    monkeypatch.setattr(squad, "_tokenizers_version", lambda: "0.23.3")
    assert prepare_train_features(_crafted_examples(), small_tokenizer, MAX_LEN, STRIDE)


def test_perfect_logits_recover_every_answer(small_tokenizer):
    examples = _crafted_examples()
    train = prepare_train_features(examples, small_tokenizer, MAX_LEN, STRIDE)
    evalf = prepare_eval_features(examples, small_tokenizer, MAX_LEN, STRIDE)
    start, end = _perfect_logits(train)
    predictions = postprocess_predictions(examples, evalf, start, end)
    assert predictions == {ex.id: ex.answers["text"][0] for ex in examples}

    # Works the same from a datasets.Dataset and from lists of logits.
    from datasets import Dataset

    dataset = Dataset.from_dict(evalf)
    assert postprocess_predictions(examples, dataset, start.tolist(), end.tolist()) == predictions


def _single_window(small_tokenizer):
    context = "the old bridge was built in 1887 by the king of the north harbor city"
    example = SquadExample(
        "x", "t", context, "who built the bridge?", {"text": [], "answer_start": []}
    )
    evalf = prepare_eval_features([example], small_tokenizer, MAX_LEN, STRIDE)
    assert len(evalf["input_ids"]) == 1
    offsets = evalf["offset_mapping"][0]
    ctx = [j for j, o in enumerate(offsets) if o is not None]
    return example, evalf, offsets, ctx


def test_postprocess_never_picks_non_context_tokens(small_tokenizer):
    example, evalf, offsets, ctx = _single_window(small_tokenizer)
    start = np.zeros((1, MAX_LEN))
    end = np.zeros((1, MAX_LEN))
    non_context = [j for j in range(MAX_LEN) if offsets[j] is None]  # CLS, question, SEP, pad
    start[0, non_context] = end[0, non_context] = 100.0
    s, e = ctx[2], ctx[4]
    start[0, s], end[0, e] = 5.0, 5.0
    pred = postprocess_predictions([example], evalf, start, end)["x"]
    assert pred == example.context[offsets[s][0] : offsets[e][1]]

    # Only context tokens carry candidates even when n_best_size is 1.
    start2 = np.full((1, MAX_LEN), 100.0)
    end2 = np.full((1, MAX_LEN), 100.0)
    start2[0, ctx] = end2[0, ctx] = 0.0
    start2[0, ctx[3]] = end2[0, ctx[3]] = 1.0
    pred = postprocess_predictions([example], evalf, start2, end2, n_best_size=1)["x"]
    assert pred == example.context[offsets[ctx[3]][0] : offsets[ctx[3]][1]]


def test_postprocess_respects_max_answer_length(small_tokenizer):
    example, evalf, offsets, ctx = _single_window(small_tokenizer)
    start = np.zeros((1, MAX_LEN))
    end = np.zeros((1, MAX_LEN))
    s = ctx[1]
    start[0, s] = 10.0
    end[0, s + 10] = 10.0  # an 11-token span: the best overall
    end[0, s + 2] = 5.0  # a 3-token span
    long_pred = postprocess_predictions([example], evalf, start, end, max_answer_length=11)
    assert long_pred["x"] == example.context[offsets[s][0] : offsets[s + 10][1]]
    short_pred = postprocess_predictions([example], evalf, start, end, max_answer_length=10)
    assert short_pred["x"] == example.context[offsets[s][0] : offsets[s + 2][1]]
    one = postprocess_predictions([example], evalf, start, end, max_answer_length=1)
    assert len(small_tokenizer.tokenize(one["x"])) == 1


def test_postprocess_without_valid_span_gives_empty(small_tokenizer):
    example, evalf, offsets, ctx = _single_window(small_tokenizer)
    start = np.zeros((1, MAX_LEN))
    end = np.zeros((1, MAX_LEN))
    start[0, ctx[6]] = 10.0
    end[0, ctx[2]] = 10.0  # the only candidates (n_best_size=1) end before they start
    assert postprocess_predictions([example], evalf, start, end, n_best_size=1) == {"x": ""}
    # Span too long for max_answer_length.
    start[0, ctx[0]] = 20.0
    end[0, ctx[-1]] = 20.0
    pred = postprocess_predictions([example], evalf, start, end, n_best_size=1, max_answer_length=3)
    assert pred == {"x": ""}
    # An example with no windows at all.
    other = SquadExample("y", "t", "the city", "what?", {"text": [], "answer_start": []})
    pred = postprocess_predictions([example, other], evalf, start, end)
    assert pred["y"] == "" and pred["x"]
    with pytest.raises(ValueError, match="shape"):
        postprocess_predictions([example], evalf, start[:, :10].T, end)


def test_long_question_is_cut_instead_of_crashing(small_tokenizer):
    context = " ".join(["the old river bridge"] * 40)
    question = " ".join(["which famous mountain village"] * 30) + "?"
    example = SquadExample("l", "t", context, question, {"text": ["old"], "answer_start": [4]})
    train = prepare_train_features([example], small_tokenizer, MAX_LEN, STRIDE)
    assert len(train["input_ids"]) > 1
    for ids, types in zip(train["input_ids"], train["token_type_ids"], strict=True):
        assert len(ids) == MAX_LEN and sum(types) > STRIDE  # room left for context
    question_tokens = train["token_type_ids"][0].index(1) - 2  # minus [CLS], [SEP]
    assert question_tokens <= 64
    with pytest.raises(ValueError, match="doc_stride"):
        prepare_train_features([example], small_tokenizer, max_length=32, doc_stride=30)


# ---------------------------------------------------------------------------------------------
# Reading, loading, splitting
# ---------------------------------------------------------------------------------------------


def _squad_dict() -> dict:
    return {
        "version": "1.1",
        "data": [
            {
                "title": "Bridges",
                "paragraphs": [
                    {
                        "context": "The old bridge was built in 1887.",
                        "qas": [
                            {
                                "id": "a1",
                                "question": "When was the old bridge built?",
                                "answers": [
                                    {"text": "1887", "answer_start": 28},
                                    {"text": "in 1887", "answer_start": 25},
                                ],
                            }
                        ],
                    }
                ],
            },
            {
                "title": "Rivers",
                "paragraphs": [
                    {
                        "context": "The river runs north.",
                        "qas": [
                            {
                                "id": "b1",
                                "question": "Where does the river run?",
                                "answers": [{"text": "north", "answer_start": 15}],
                            }
                        ],
                    }
                ],
            },
        ],
    }


def test_read_squad_json_and_load_local(tmp_path):
    path = tmp_path / "squad" / "dev-v1.1.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_squad_dict()), encoding="utf-8")
    examples = read_squad_json(path)
    assert examples[0] == SquadExample(
        id="a1",
        title="Bridges",
        context="The old bridge was built in 1887.",
        question="When was the old bridge built?",
        answers={"text": ["1887", "in 1887"], "answer_start": [28, 25]},
    )
    assert [ex.id for ex in examples] == ["a1", "b1"]
    assert load_squad("validation", tmp_path) == examples
    assert load_squad("dev", tmp_path) == examples
    assert load_squad("train", None, path=str(path)) == examples
    assert load_squad("train", tmp_path / "elsewhere", path=str(path)) == examples


def _broken(mutate) -> dict:
    data = _squad_dict()
    mutate(data)
    return data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"version": "1.1"}), "missing the key 'data'"),
        (json.dumps(_broken(lambda d: d["data"][0].pop("title"))), "missing the key 'title'"),
        (
            json.dumps(_broken(lambda d: d["data"][1]["paragraphs"][0].pop("qas"))),
            r"data\[1\]\.paragraphs\[0\] is missing the key 'qas'",
        ),
        (
            json.dumps(
                _broken(lambda d: d["data"][0]["paragraphs"][0]["qas"][0]["answers"][0].pop("text"))
            ),
            "missing the key 'text'",
        ),
        (
            json.dumps(
                _broken(
                    lambda d: d["data"][0]["paragraphs"][0]["qas"][0]["answers"][1].update(
                        answer_start=26
                    )
                )
            ),
            "answer_start=26 does not point at the answer text 'in 1887'",
        ),
        (
            json.dumps(_broken(lambda d: d["data"][1]["paragraphs"][0]["qas"][0].update(id="a1"))),
            "repeats the question id 'a1'",
        ),
    ],
)
def test_read_squad_json_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "broken-squad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        read_squad_json(path)
    assert str(path) in str(info.value)


def test_load_squad_missing_file_and_bad_split(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_squad("train", tmp_path)
    message = str(info.value)
    assert str(tmp_path / "squad" / "train-v1.1.json") in message
    assert "data_root=None" in message and "split_by_article" in message
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        load_squad("validation", None, path=str(tmp_path / "nothing.json"))
    with pytest.raises(ValueError, match="unknown SQuAD split"):
        load_squad("test", tmp_path)


def test_load_squad_hub_offline_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    # These are read when the packages are imported, which may already have happened.
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    with pytest.raises(RuntimeError) as info:
        load_squad("validation", None)
    message = str(info.value)
    assert "rajpurkar/squad" in message and "data_root" in message


def _titled_examples(n_titles: int = 30) -> list[SquadExample]:
    rng = random.Random(1)
    examples = []
    for t in range(n_titles):
        for q in range(rng.randint(5, 40)):
            examples.append(
                SquadExample(
                    f"{t}-{q}", f"Article {t}", "ctx", "q?", {"text": [], "answer_start": []}
                )
            )
    rng.shuffle(examples)
    return examples


def test_split_by_article():
    examples = _titled_examples()
    train, evaluation = split_by_article(examples, eval_fraction=0.2, seed=0)
    assert split_by_article(examples, eval_fraction=0.2, seed=0) == (train, evaluation)
    train_titles = {ex.title for ex in train}
    eval_titles = {ex.title for ex in evaluation}
    assert train_titles and eval_titles and not train_titles & eval_titles
    # All examples kept, each once, in their original order.
    assert sorted(ex.id for ex in train + evaluation) == sorted(ex.id for ex in examples)
    order = {ex.id: i for i, ex in enumerate(examples)}
    assert [order[ex.id] for ex in evaluation] == sorted(order[ex.id] for ex in evaluation)
    # Roughly the requested fraction of questions (within one article, at most 40 questions).
    assert 0.2 * len(examples) <= len(evaluation) < 0.2 * len(examples) + 40
    other = split_by_article(examples, eval_fraction=0.2, seed=1)
    assert {ex.title for ex in other[1]} != eval_titles
    half = split_by_article(examples, eval_fraction=0.5, seed=0)[1]
    assert abs(len(half) / len(examples) - 0.5) < 0.1
    with pytest.raises(ValueError):
        split_by_article(examples, eval_fraction=1.0)
    with pytest.raises(ValueError, match="two articles"):
        split_by_article([ex for ex in examples if ex.title == "Article 0"])


# ---------------------------------------------------------------------------------------------
# The real SQuAD v1.1 dev file (shared data; skipped when absent)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def squad_dev():
    if not SQUAD_DEV.is_file() or not BERT_VOCAB.is_file():
        pytest.skip(f"shared SQuAD dev file or BERT vocab not found under {SHARED_DATA}")
    return read_squad_json(SQUAD_DEV), _make_tokenizer(BERT_VOCAB)


def test_real_dev_file_counts(squad_dev):
    examples, _ = squad_dev
    assert len(examples) == 10_570
    assert len({ex.title for ex in examples}) == 48
    assert load_squad("validation", SHARED_DATA)[:5] == examples[:5]
    train, evaluation = split_by_article(examples)
    assert not {ex.title for ex in train} & {ex.title for ex in evaluation}
    assert 0.2 <= len(evaluation) / len(examples) < 0.3


def test_real_dev_labels_and_perfect_logits(squad_dev):
    examples, tokenizer = squad_dev
    examples = examples[:200]

    def normalise(text: str) -> str:
        return " ".join(text.lower().split())

    train = prepare_train_features(examples, tokenizer, max_length=384, doc_stride=128)
    evalf = prepare_eval_features(examples, tokenizer, max_length=384, doc_stride=128)
    labelled, inexact = _check_train_labels(examples, train, evalf, 384, normalise)
    assert set(labelled) == {ex.id for ex in examples}
    # A few dev answers are part of a word piece (e.g. "8" annotated inside "20–18"); those
    # cannot be labelled exactly by any token span, and _check_train_labels has verified that
    # they get the smallest covering span. All other labelled windows decode to the answer.
    assert inexact <= 0.05 * len(examples)

    start, end = _perfect_logits(train)
    predictions = postprocess_predictions(examples, evalf, start, end)
    exact = {ex.id for ex in examples if predictions[ex.id] == ex.answers["text"][0]}
    by_id = {ex.id: ex for ex in examples}
    aligned = set()  # first answer starts and ends on token boundaries in some window
    for eid, offsets in zip(evalf["example_id"], evalf["offset_mapping"], strict=True):
        answer_start = by_id[eid].answers["answer_start"][0]
        answer_end = answer_start + len(by_id[eid].answers["text"][0])
        spans = [o for o in offsets if o is not None]
        if any(o[0] == answer_start for o in spans) and any(o[1] == answer_end for o in spans):
            aligned.add(eid)
    # Every token-aligned first answer is recovered exactly; overall (including the sub-token
    # annotations above) at least 95% on these 200 (measured: 192/200; 99.6% on the full file).
    assert aligned <= exact
    assert len(exact & aligned) >= 0.99 * len(aligned)
    assert len(exact) >= 0.95 * len(examples)
