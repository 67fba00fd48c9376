"""SQuAD v1.1 metric (exact match and token F1) as an `evaluate` module.

It follows the definition of the official SQuAD v1.1 evaluation script:

* Answers are normalised by lower-casing, deleting every character of ``string.punctuation``,
  replacing the whole words ``a``, ``an`` and ``the`` by a space, and collapsing runs of
  whitespace to single spaces (with none at the ends), in that order.
* Exact match of a prediction against one gold answer is 1 when the normalised strings are
  equal, else 0.
* Token F1 splits both normalised strings on whitespace, counts the tokens they share with
  multiset (``collections.Counter``) intersection, and is 2PR / (P + R) with precision
  P = shared / prediction tokens and recall R = shared / gold tokens; it is 0 when they share
  no token. A quirk kept from the official script: if the prediction and the gold answer both
  normalise to the empty string, exact match is 1 but F1 is 0.
* For each question, each score is the maximum over its gold answers; the scores are then
  averaged over the questions and reported in percent (0 to 100).

Input format (the same as HF's ``squad`` metric)::

    predictions = [{"id": "q1", "prediction_text": "Denver Broncos"}, ...]
    references = [{"id": "q1", "answers": {"text": ["Denver Broncos"], "answer_start": [177]}}, ...]

Returns ``{"exact_match": float, "f1": float}``. Predictions and references must cover exactly
the same question ids: an id present on one side only, a repeated id, a question without gold
answers, or no question at all raises ``ValueError``.
"""

import re
import string
from collections import Counter

# evaluate copies this script into its module cache and imports it from there, so it must be
# self-contained (no imports of project code), and evaluate takes the first EvaluationModule
# subclass in the module's namespace as the metric: import the `evaluate` module, never
# `from evaluate import Metric`, or that imported base class would be picked instead.
import datasets
import evaluate

_DESCRIPTION = """\
SQuAD v1.1 exact match and token-level F1 (Rajpurkar et al., 2016), as defined by the official
v1.1 evaluation script: max over the gold answers of each question, mean over questions, in
percent.
"""

_CITATION = """\
@inproceedings{rajpurkar-etal-2016-squad,
  title={{SQ}u{AD}: 100,000+ Questions for Machine Comprehension of Text},
  author={Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy},
  booktitle={Proceedings of the 2016 Conference on Empirical Methods in Natural Language
             Processing},
  year={2016},
  pages={2383--2392}
}
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions: list of {"id": str, "prediction_text": str}, one per question.
    references: list of {"id": str, "answers": {"text": list[str], "answer_start": list[int]}}.
Returns:
    exact_match: percentage (0-100) of questions whose normalised prediction equals a normalised
        gold answer.
    f1: mean over questions of the best token F1 against the gold answers, in percent (0-100).
"""

_PUNCTUATION_TABLE = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = text.translate(_PUNCTUATION_TABLE)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, ground_truth: str) -> float:
    """1.0 when the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-level F1 of the normalised strings; 0.0 when no token is shared."""
    prediction_tokens = normalize_answer(prediction).split()
    truth_tokens = normalize_answer(ground_truth).split()
    shared = sum((Counter(prediction_tokens) & Counter(truth_tokens)).values())
    if shared == 0:
        return 0.0
    precision = shared / len(prediction_tokens)
    recall = shared / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def _best_over_answers(metric, prediction: str, ground_truths: list[str]) -> float:
    return max(metric(prediction, truth) for truth in ground_truths)


def _index_by_id(rows, what: str) -> dict:
    index = {}
    for row in rows:
        qid = row["id"]
        if qid in index:
            raise ValueError(f"SQuAD metric: question id {qid!r} appears twice in the {what}")
        index[qid] = row
    return index


def _check_ids_match(predicted: dict, gold: dict) -> None:
    for qid in predicted:
        if qid not in gold:
            raise ValueError(f"SQuAD metric: prediction for id {qid!r} has no reference")
    for qid in gold:
        if qid not in predicted:
            raise ValueError(f"SQuAD metric: reference id {qid!r} has no prediction")


def squad_scores(predictions, references) -> dict[str, float]:
    """Exact match and F1 in percent for HF-format predictions and references."""
    predicted = _index_by_id(predictions, "predictions")
    gold = _index_by_id(references, "references")
    _check_ids_match(predicted, gold)
    if not gold:
        raise ValueError("SQuAD metric needs at least one question; got none")

    exact_match = 0.0
    f1 = 0.0
    for qid, reference in gold.items():
        ground_truths = list(reference["answers"]["text"])
        if not ground_truths:
            raise ValueError(f"SQuAD metric: reference id {qid!r} has no gold answer")
        prediction = predicted[qid]["prediction_text"]
        exact_match += _best_over_answers(exact_match_score, prediction, ground_truths)
        f1 += _best_over_answers(f1_score, prediction, ground_truths)
    total = len(gold)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


class Squad(evaluate.Metric):
    """SQuAD v1.1 exact match and F1, in percent (see the module docstring)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": {
                        "id": datasets.Value("string"),
                        "prediction_text": datasets.Value("string"),
                    },
                    "references": {
                        "id": datasets.Value("string"),
                        "answers": {
                            "text": datasets.List(datasets.Value("string")),
                            "answer_start": datasets.List(datasets.Value("int32")),
                        },
                    },
                }
            ),
            codebase_urls=[],
            reference_urls=["https://rajpurkar.github.io/SQuAD-explorer/"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch of predictions and references (see ``evaluate.Metric.add_batch``).

        evaluate rejects a batch whose lengths differ with a generic message; this names the
        offending id instead (a repeated id, or an id on one side only).
        """
        # evaluate appends the inputs description to this docstring, so it must have one.
        if (
            predictions is not None
            and references is not None
            and len(predictions) != len(references)
        ):
            _check_ids_match(
                _index_by_id(predictions, "predictions"), _index_by_id(references, "references")
            )
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions, references):
        return squad_scores(predictions, references)
