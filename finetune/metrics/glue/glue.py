"""GLUE metrics as an `evaluate` module, computed with numpy only.

Load it by path (the directory name matches this file's name, which is how `evaluate.load`
finds a local module)::

    metric = evaluate.load("/abs/path/finetune/metrics/glue", "mrpc")
    metric.compute(predictions=[1, 0, 1], references=[1, 1, 1])

The config name is the GLUE task and decides which values are returned:

============================================================  ==============================
config name                                                   keys returned
============================================================  ==============================
``cola``                                                      ``matthews_correlation``
``sst2``, ``mnli``, ``mnli_matched``, ``mnli_mismatched``,    ``accuracy``
``qnli``, ``rte``, ``wnli``
``mrpc``, ``qqp``                                             ``accuracy``, ``f1``
``stsb``                                                      ``pearson``, ``spearmanr``
============================================================  ==============================

All values are plain Python floats and fractions (0 to 1, or -1 to 1 for the correlations), the
scale HF's ``glue`` metric reports; multiply by 100 for the percentages papers quote.

Edge cases (chosen to agree with scikit-learn / scipy, which HF's metric calls):

* Matthews correlation is 0.0 when its denominator is 0, i.e. when the predictions or the
  references contain only one class.
* F1 is for the positive class 1. When there are no true positives, F1 is 0.0; that includes the
  case with no positive prediction and no positive reference (0/0 is taken as 0.0, as
  scikit-learn's ``f1_score`` does by default).
* Pearson and Spearman are nan when either vector is constant (zero variance; a single example
  is constant too) or contains a non-finite value (nan or inf).
* Empty inputs raise ``ValueError``; so does a length mismatch.
"""

# evaluate copies this script into its module cache and imports it from there, so it must be
# self-contained (no imports of project code), and evaluate takes the first EvaluationModule
# subclass in the module's namespace as the metric: import the `evaluate` module, never
# `from evaluate import Metric`, or that imported base class would be picked instead.
import datasets
import evaluate
import numpy as np

_CLASSIFICATION_ACCURACY = (
    "sst2",
    "mnli",
    "mnli_matched",
    "mnli_mismatched",
    "qnli",
    "rte",
    "wnli",
)
_ACCURACY_AND_F1 = ("mrpc", "qqp")

#: GLUE task -> the keys `compute` returns for it.
TASK_KEYS = {
    "cola": ("matthews_correlation",),
    **{task: ("accuracy",) for task in _CLASSIFICATION_ACCURACY},
    **{task: ("accuracy", "f1") for task in _ACCURACY_AND_F1},
    "stsb": ("pearson", "spearmanr"),
}

_DESCRIPTION = """\
GLUE task metrics (Wang et al., 2019): Matthews correlation for CoLA, accuracy for SST-2, MNLI,
QNLI, RTE and WNLI, accuracy and F1 (positive class 1) for MRPC and QQP, and Pearson and Spearman
correlation for STS-B. Implemented with numpy; no scikit-learn or scipy needed.
"""

_CITATION = """\
@inproceedings{wang2019glue,
  title={{GLUE}: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding},
  author={Wang, Alex and Singh, Amanpreet and Michael, Julian and Hill, Felix and Levy, Omer and
          Bowman, Samuel R.},
  booktitle={International Conference on Learning Representations},
  year={2019}
}
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions: predicted labels (ints), or predicted scores (floats) for ``stsb``.
    references: gold labels (ints), or gold scores (floats) for ``stsb``.
Returns: a dict whose keys depend on the task (see the module docstring):
    accuracy: fraction of predictions equal to the reference, in [0, 1].
    f1: F1 of the positive class 1, in [0, 1].
    matthews_correlation: in [-1, 1].
    pearson, spearmanr: correlations in [-1, 1] (Spearman uses average ranks for ties).
"""


class UnknownGlueTaskError(KeyError, ValueError):
    """Raised for a config name that is not a GLUE task; catchable as KeyError or ValueError."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def accuracy(predictions: np.ndarray, references: np.ndarray) -> float:
    """Fraction of positions where the prediction equals the reference."""
    return float(np.mean(predictions == references))


def binary_f1(predictions: np.ndarray, references: np.ndarray, positive: int = 1) -> float:
    """F1 = 2tp / (2tp + fp + fn) for the class ``positive``; 0.0 when there is no true positive."""
    pred_pos = predictions == positive
    ref_pos = references == positive
    tp = int(np.sum(pred_pos & ref_pos))
    fp = int(np.sum(pred_pos & ~ref_pos))
    fn = int(np.sum(~pred_pos & ref_pos))
    if tp == 0:
        return 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


def matthews_correlation(predictions: np.ndarray, references: np.ndarray) -> float:
    """Matthews correlation coefficient (the multiclass R_K form; the usual one for 2 classes).

    With the confusion matrix C (rows: reference, columns: prediction), t = row sums,
    p = column sums, c = trace and s = total::

        MCC = (c*s - t.p) / sqrt((s^2 - p.p) * (s^2 - t.t))

    For two classes this is (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)).
    Returns 0.0 when the denominator is 0.
    """
    both = np.concatenate([references.reshape(-1), predictions.reshape(-1)])
    classes, encoded = np.unique(both, return_inverse=True)
    encoded = encoded.reshape(-1)
    n = len(references)
    ref_idx, pred_idx = encoded[:n], encoded[n:]
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion, (ref_idx, pred_idx), 1.0)
    t = confusion.sum(axis=1)
    p = confusion.sum(axis=0)
    c = np.trace(confusion)
    s = confusion.sum()
    denominator = (s * s - p @ p) * (s * s - t @ t)
    if denominator == 0:
        return 0.0
    return float((c * s - t @ p) / np.sqrt(denominator))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values``; tied values all get the mean of the ranks they span."""
    values = np.asarray(values)
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts_group = np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]])
    group_of = np.cumsum(starts_group) - 1
    starts = np.flatnonzero(starts_group)  # 0-based first position of each group
    ends = np.concatenate([starts[1:], [len(values)]])  # 0-based one-past-last position
    group_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1 .. ends
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = group_rank[group_of]
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; nan for a constant or non-finite vector."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    dx = x - x.mean()
    dy = y - y.mean()
    denominator = np.sqrt((dx @ dx) * (dy @ dy))
    if denominator == 0:
        return float("nan")
    r = (dx @ dy) / denominator
    return float(np.clip(r, -1.0, 1.0))


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson of average ranks); nan as for :func:`pearson`."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return float("nan")
    return pearson(average_ranks(x), average_ranks(y))


def _check_integral(name: str, values) -> None:
    if values is None:
        return
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        return  # let evaluate report inputs numpy cannot take
    if array.dtype.kind == "f" and not np.all(np.mod(array, 1) == 0):
        raise ValueError(
            f"GLUE classification {name} must be class ids (e.g. the argmax of the logits); "
            f"got non-integral values"
        )


class Glue(evaluate.Metric):
    """GLUE metric; the config name picks the task (see the module docstring)."""

    def _info(self):
        if self.config_name not in TASK_KEYS:
            raise UnknownGlueTaskError(
                f"Unknown GLUE config name {self.config_name!r}; "
                f"expected one of: {', '.join(sorted(TASK_KEYS))}"
            )
        dtype = "float64" if self.config_name == "stsb" else "int64"
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value(dtype), "references": datasets.Value(dtype)}
            ),
            codebase_urls=[],
            reference_urls=["https://gluebenchmark.com/"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add a batch of predictions and references (see ``evaluate.Metric.add_batch``).

        For the classification tasks the inputs are cast to int64 on the way in, which would
        silently truncate scores or probabilities; non-integral values are rejected instead.
        """
        # evaluate appends the inputs description to this docstring, so it must have one.
        if self.config_name != "stsb":
            for name, values in (("predictions", predictions), ("references", references)):
                _check_integral(name, values)
        return super().add_batch(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions, references):
        # The inputs arrive as Python lists: MetricInfo(format="numpy") would hand floats over
        # as float32 (datasets' numpy formatter default), costing stsb precision.
        dtype = np.float64 if self.config_name == "stsb" else np.int64
        predictions = np.asarray(predictions, dtype=dtype)
        references = np.asarray(references, dtype=dtype)
        if predictions.shape != references.shape:
            raise ValueError(
                f"predictions and references differ in shape: "
                f"{predictions.shape} vs {references.shape}"
            )
        if predictions.size == 0:
            raise ValueError("GLUE metric needs at least one example; got none")
        task = self.config_name
        if task == "cola":
            return {"matthews_correlation": matthews_correlation(predictions, references)}
        if task == "stsb":
            return {
                "pearson": pearson(predictions, references),
                "spearmanr": spearman(predictions, references),
            }
        result = {"accuracy": accuracy(predictions, references)}
        if task in _ACCURACY_AND_F1:
            result["f1"] = binary_f1(predictions, references)
        return result
