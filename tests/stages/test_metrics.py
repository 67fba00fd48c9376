"""Tests for the project's GLUE and SQuAD metrics (finetune/metrics), loaded through `evaluate`.

Expected values are worked out by hand in the comments.
"""

from __future__ import annotations

import inspect
import json
import math
import socket

import numpy as np
import pytest

from finetune.metrics import (
    METRICS_DIR,
    available_metrics,
    compute_glue,
    compute_squad,
    load_metric,
)
from tests.helpers.paths import SHARED_DATA

GLUE_KEYS = {
    "cola": {"matthews_correlation"},
    "sst2": {"accuracy"},
    "mnli": {"accuracy"},
    "mnli_matched": {"accuracy"},
    "mnli_mismatched": {"accuracy"},
    "qnli": {"accuracy"},
    "rte": {"accuracy"},
    "wnli": {"accuracy"},
    "mrpc": {"accuracy", "f1"},
    "qqp": {"accuracy", "f1"},
    "stsb": {"pearson", "spearmanr"},
}


@pytest.fixture(scope="module")
def glue():
    """One loaded GLUE metric per task, reused across tests (compute() resets its state)."""
    cache = {}

    def get(task):
        if task not in cache:
            cache[task] = load_metric("glue", task, keep_in_memory=True)
        return cache[task]

    return get


@pytest.fixture(scope="module")
def squad():
    return load_metric("squad", keep_in_memory=True)


@pytest.fixture(scope="module")
def squad_module(squad):
    """The loaded squad.py module (the copy evaluate imported), for its helper functions."""
    return inspect.getmodule(type(squad))


def _squad_refs(answers_by_id):
    return [
        {"id": qid, "answers": {"text": list(texts), "answer_start": [0] * len(texts)}}
        for qid, texts in answers_by_id.items()
    ]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def test_available_metrics():
    assert available_metrics() == ["glue", "squad"]
    assert (METRICS_DIR / "glue" / "glue.py").is_file()


def test_unknown_metric_name_lists_available():
    with pytest.raises(ValueError, match="glue, squad"):
        load_metric("bleu")


@pytest.mark.parametrize("bad", ["sst-2", "CoLA", None])
def test_unknown_glue_config_lists_valid_names(bad):
    with pytest.raises(KeyError, match="cola, mnli, .*wnli"):
        load_metric("glue", bad)
    with pytest.raises(ValueError, match="stsb"):  # the same error is a ValueError too
        load_metric("glue", bad)


def test_loading_never_opens_a_socket(monkeypatch):
    import evaluate.config

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    before = evaluate.config.HF_EVALUATE_OFFLINE
    assert compute_glue("rte", [1, 0], [1, 1]) == {"accuracy": 0.5}
    assert load_metric("squad") is not None
    after = evaluate.config.HF_EVALUATE_OFFLINE
    assert after == before  # the offline switch is restored after each load


@pytest.mark.parametrize("task", sorted(GLUE_KEYS))
def test_every_glue_config_returns_its_keys(glue, task):
    if task == "stsb":
        result = glue(task).compute(predictions=[0.5, 1.0, 2.5], references=[1.0, 2.0, 3.0])
    else:
        result = glue(task).compute(predictions=[0, 1, 1], references=[0, 1, 0])
    assert set(result) == GLUE_KEYS[task]
    assert all(isinstance(value, float) for value in result.values())


# --------------------------------------------------------------------------------------------
# GLUE values
# --------------------------------------------------------------------------------------------


def test_accuracy(glue):
    # preds 1 0 1 1 0 vs refs 1 1 1 0 0: equal at positions 0, 2, 4 -> 3/5
    result = glue("sst2").compute(predictions=[1, 0, 1, 1, 0], references=[1, 1, 1, 0, 0])
    assert result == {"accuracy": pytest.approx(0.6)}
    # three MNLI classes: preds 0 1 2 2 vs refs 0 2 2 1 -> equal at 0, 2 -> 2/4
    mnli = glue("mnli").compute(predictions=[0, 1, 2, 2], references=[0, 2, 2, 1])
    assert mnli == {"accuracy": pytest.approx(0.5)}


def test_accuracy_and_f1(glue):
    # preds 1 1 1 0 0 0 vs refs 1 1 0 1 0 0: tp = 2 (pos 0, 1), fp = 1 (pos 2), fn = 1 (pos 3),
    # tn = 2 -> F1 = 2tp / (2tp + fp + fn) = 4/6 = 2/3; accuracy = (tp + tn)/6 = 4/6 = 2/3
    result = glue("mrpc").compute(predictions=[1, 1, 1, 0, 0, 0], references=[1, 1, 0, 1, 0, 0])
    assert result["f1"] == pytest.approx(2 / 3)
    assert result["accuracy"] == pytest.approx(2 / 3)
    # tp = 1, fp = 0, fn = 2: P = 1, R = 1/3 -> F1 = 2 * 1/3 / (4/3) = 1/2; accuracy 2/4
    result = glue("qqp").compute(predictions=[1, 0, 0, 0], references=[1, 1, 1, 0])
    assert result == {"accuracy": pytest.approx(0.5), "f1": pytest.approx(0.5)}


def test_f1_without_any_positive_is_zero(glue):
    # no positive prediction and no positive reference: 0/0, taken as 0.0 (scikit-learn's default)
    result = glue("mrpc").compute(predictions=[0, 0, 0], references=[0, 0, 0])
    assert result == {"accuracy": 1.0, "f1": 0.0}
    # positives only in the references: tp = 0 -> 0.0
    assert glue("mrpc").compute(predictions=[0, 0], references=[1, 0])["f1"] == 0.0


def test_matthews_correlation(glue):
    # refs  1 1 1 1 0 0 0
    # preds 1 1 1 0 0 0 1   -> tp = 3, fn = 1, tn = 2, fp = 1
    # MCC = (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn))
    #     = (6 - 1) / sqrt(4 * 4 * 3 * 3) = 5/12
    result = glue("cola").compute(
        predictions=[1, 1, 1, 0, 0, 0, 1], references=[1, 1, 1, 1, 0, 0, 0]
    )
    assert result == {"matthews_correlation": pytest.approx(5 / 12)}
    # tp = 2, fn = 1, fp = 1, tn = 0 -> (0 - 1) / sqrt(3 * 3 * 1 * 1) = -1/3
    result = glue("cola").compute(predictions=[1, 0, 1, 1], references=[1, 1, 0, 1])
    assert result["matthews_correlation"] == pytest.approx(-1 / 3)
    # perfect and perfectly inverted predictions
    assert glue("cola").compute(predictions=[0, 1, 1], references=[0, 1, 1]) == {
        "matthews_correlation": pytest.approx(1.0)
    }
    assert glue("cola").compute(predictions=[1, 0, 0], references=[0, 1, 1]) == {
        "matthews_correlation": pytest.approx(-1.0)
    }


def test_classification_rejects_scores(glue):
    # probabilities instead of class ids would otherwise be truncated to 0 by the int64 cast
    with pytest.raises(ValueError, match="class ids"):
        glue("sst2").compute(predictions=[0.9, 0.2], references=[1, 0])
    # integral floats are fine
    assert glue("sst2").compute(predictions=[1.0, 0.0], references=[1, 1]) == {"accuracy": 0.5}


def test_matthews_zero_denominator_is_zero(glue):
    # all predictions one class: tp + fp = 0 -> denominator 0 -> 0.0
    result = glue("cola").compute(predictions=[0, 0, 0, 0], references=[1, 0, 1, 0])
    assert result == {"matthews_correlation": 0.0}


def test_pearson_and_spearman(glue):
    # x = 1 2 3 4 (mean 2.5, dx = -1.5 -0.5 0.5 1.5, sum dx^2 = 5)
    # y = 2 4 5 9 (mean 5, dy = -3 -1 0 4, sum dy^2 = 26), sum dx*dy = 4.5 + 0.5 + 0 + 6 = 11
    # pearson = 11 / sqrt(5 * 26) = 11 / sqrt(130); y is increasing in x, so spearman = 1
    result = glue("stsb").compute(predictions=[1.0, 2.0, 3.0, 4.0], references=[2.0, 4.0, 5.0, 9.0])
    # tight tolerance: the scores must reach the computation as float64, not float32
    assert result["pearson"] == pytest.approx(11 / math.sqrt(130), rel=1e-12)
    assert result["spearmanr"] == pytest.approx(1.0)
    # float32 rounding of 0.1-steps would move the result by ~1e-8
    result = glue("stsb").compute(predictions=[0.1, 0.2, 0.4], references=[0.3, 0.1, 0.2])
    # dx = -0.1333.. -0.0333.. 0.1666.., dy = 0.1 -0.1 0 -> sum dx*dy = -0.01, sum dx^2 = 0.04666..,
    # sum dy^2 = 0.02 -> pearson = -0.01 / sqrt(0.04666.. * 0.02) = -sqrt(3/28)
    assert result["pearson"] == pytest.approx(-math.sqrt(3 / 28), rel=1e-12)


def test_spearman_uses_average_ranks_for_ties(glue):
    # x = 0.5 2.0 2.0 3.0 -> ranks 1 2.5 2.5 4 (the tie shares ranks 2 and 3)
    # y = 1.0 0.0 4.0 3.0 -> ranks 2 1 4 3
    # rank deviations from the mean 2.5: dx = -1.5 0 0 1.5, dy = -0.5 -1.5 1.5 0.5
    # sum dx*dy = 0.75 + 0 + 0 + 0.75 = 1.5, sum dx^2 = 4.5, sum dy^2 = 5
    # spearman = 1.5 / sqrt(22.5) = 0.316227...
    result = glue("stsb").compute(predictions=[0.5, 2.0, 2.0, 3.0], references=[1.0, 0.0, 4.0, 3.0])
    assert result["spearmanr"] == pytest.approx(1.5 / math.sqrt(22.5))
    # pearson of the raw values: x mean 1.875, dx = -1.375 0.125 0.125 1.125 (sum^2 = 3.1875),
    # y mean 2, dy = -1 -2 2 1 (sum^2 = 10), sum dx*dy = 1.375 - 0.25 + 0.25 + 1.125 = 2.5
    assert result["pearson"] == pytest.approx(2.5 / math.sqrt(3.1875 * 10))


def test_correlation_of_constant_vector_is_nan(glue):
    result = glue("stsb").compute(predictions=[2.0, 2.0, 2.0], references=[1.0, 2.0, 3.0])
    assert math.isnan(result["pearson"])
    assert math.isnan(result["spearmanr"])


def test_compute_glue_helper():
    # numpy inputs; a regression head's (n, 1) output is flattened
    preds = np.array([[1.0], [2.0], [3.0], [4.0]])
    result = compute_glue("stsb", preds, np.array([2.0, 4.0, 5.0, 9.0]))
    assert result["pearson"] == pytest.approx(11 / math.sqrt(130))
    assert compute_glue("wnli", np.array([1, 1]), np.array([1, 0])) == {"accuracy": 0.5}


# --------------------------------------------------------------------------------------------
# SQuAD
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Denver Broncos", "denver broncos"),  # case, leading article
        ("a cat and AN owl ate the fish", "cat and owl ate fish"),  # articles anywhere
        ("theater, another anthem", "theater another anthem"),  # only whole-word articles
        ("Hello, World!", "hello world"),  # punctuation deleted
        ("U.S.-based (1990s)", "usbased 1990s"),  # deleted, not replaced by a space
        ("  several \t spaces\n here ", "several spaces here"),  # whitespace collapsed
        ("The", ""),
    ],
)
def test_squad_normalisation(squad_module, text, expected):
    assert squad_module.normalize_answer(text) == expected


def test_squad_normalised_exact_match(squad):
    # every prediction differs from its gold answer only in case/punctuation/articles/spaces
    refs = _squad_refs({"q1": ["Denver Broncos"], "q2": ["the 1990s"], "q3": ["a b c"]})
    preds = [
        {"id": "q1", "prediction_text": "the denver broncos."},
        {"id": "q2", "prediction_text": "1990s"},
        {"id": "q3", "prediction_text": "  B,  C!! "},  # "a" is an article: gold is "b c"
    ]
    assert squad.compute(predictions=preds, references=refs) == {"exact_match": 100.0, "f1": 100.0}


def test_squad_partial_overlap_f1(squad):
    # pred "the big red car" -> big red car (3 tokens); gold "a red car today" -> red car today
    # shared: red, car = 2 -> P = 2/3, R = 2/3 -> F1 = 2/3; no exact match
    refs = _squad_refs({"q": ["a red car today"]})
    result = squad.compute(
        predictions=[{"id": "q", "prediction_text": "the big red car"}], references=refs
    )
    assert result["exact_match"] == 0.0
    assert result["f1"] == pytest.approx(100 * 2 / 3)


def test_squad_f1_counts_repeated_tokens_once_per_match(squad):
    # pred red red car (3), gold red car (2): Counter overlap = min(2, 1) + min(1, 1) = 2
    # P = 2/3, R = 2/2 -> F1 = 2 * (2/3) / (5/3) = 0.8
    refs = _squad_refs({"q": ["red car"]})
    result = squad.compute(
        predictions=[{"id": "q", "prediction_text": "red red car"}], references=refs
    )
    assert result["f1"] == pytest.approx(80.0)


def test_squad_no_common_token_is_zero(squad):
    refs = _squad_refs({"q": ["Denver"]})
    result = squad.compute(
        predictions=[{"id": "q", "prediction_text": "Carolina"}], references=refs
    )
    assert result == {"exact_match": 0.0, "f1": 0.0}


def test_squad_max_over_ground_truths_then_mean(squad):
    # q1: golds "Broncos" (F1 2*1*0.5/1.5 = 2/3), "denver broncos!" (exact), "Carolina" (0)
    #     -> EM 1, F1 1
    # q2: pred "big red car" vs "red car": P = 2/3, R = 1 -> F1 0.8; vs "red": P = 1/3, R = 1
    #     -> F1 0.5; max 0.8, EM 0
    # mean in percent: EM (100 + 0)/2 = 50, F1 (100 + 80)/2 = 90
    refs = _squad_refs({"q1": ["Broncos", "denver broncos!", "Carolina"], "q2": ["red car", "red"]})
    preds = [
        {"id": "q2", "prediction_text": "big red car"},  # order of predictions does not matter
        {"id": "q1", "prediction_text": "Denver Broncos"},
    ]
    result = squad.compute(predictions=preds, references=refs)
    assert result == {"exact_match": pytest.approx(50.0), "f1": pytest.approx(90.0)}


def test_squad_first_gold_answer_scores_100():
    refs = _squad_refs({"a": ["first", "second answer"], "b": ["x y z", "x"], "c": ["only"]})
    preds = {row["id"]: row["answers"]["text"][0] for row in refs}
    assert compute_squad(preds, refs) == {"exact_match": 100.0, "f1": 100.0}


def test_compute_squad_ignores_extra_reference_keys():
    refs = _squad_refs({"q": ["Denver Broncos"]})
    refs[0].update(title="t", context="c", question="which team?")
    assert compute_squad({"q": "Broncos"}, refs)["f1"] == pytest.approx(100 * 2 / 3)


def test_squad_prediction_without_reference_names_the_id(squad):
    refs = _squad_refs({"q1": ["x"]})
    preds = [
        {"id": "q1", "prediction_text": "x"},
        {"id": "stray-id", "prediction_text": "y"},
    ]
    with pytest.raises(ValueError, match="stray-id"):
        squad.compute(predictions=preds, references=refs)


def test_squad_reference_without_prediction_names_the_id():
    refs = _squad_refs({"q1": ["x"], "unanswered-id": ["y"]})
    with pytest.raises(ValueError, match="unanswered-id"):
        compute_squad({"q1": "x"}, refs)


def test_squad_duplicate_id_is_an_error(squad):
    refs = _squad_refs({"q1": ["x"]})
    preds = [{"id": "q1", "prediction_text": "x"}, {"id": "q1", "prediction_text": "y"}]
    with pytest.raises(ValueError, match="q1"):
        squad.compute(predictions=preds, references=refs)


# --------------------------------------------------------------------------------------------
# Shared data (skipped when the shared data folder is absent)
# --------------------------------------------------------------------------------------------


def test_squad_dev_first_gold_answer_is_100():
    path = SHARED_DATA / "squad" / "dev-v1.1.json"
    if not path.is_file():
        pytest.skip(f"SQuAD v1.1 dev set not found at {path}")
    with path.open(encoding="utf-8") as f:
        articles = json.load(f)["data"]
    references = [
        {
            "id": qa["id"],
            "answers": {
                "text": [answer["text"] for answer in qa["answers"]],
                "answer_start": [answer["answer_start"] for answer in qa["answers"]],
            },
        }
        for article in articles
        for paragraph in article["paragraphs"]
        for qa in paragraph["qas"]
    ]
    assert len(references) == 10570
    predictions = {row["id"]: row["answers"]["text"][0] for row in references}
    assert compute_squad(predictions, references) == {"exact_match": 100.0, "f1": 100.0}
