"""The project's own evaluation metrics, loaded through the `evaluate` API from this folder.

Each metric lives in ``METRICS_DIR/<name>/<name>.py`` (a directory holding a script of the same
name is what ``evaluate.load(<local directory>)`` looks for), so loading never goes to the
Hugging Face Hub: an absolute directory path is resolved to the local script before any of
evaluate's Hub code is reached. As a second guard, evaluate's offline switch
(``evaluate.config.HF_EVALUATE_OFFLINE``) is turned on for the duration of each load and then
restored, so nothing in this process is left in offline mode by it.

Public API::

    load_metric(name, config_name=None, **kwargs) -> evaluate.EvaluationModule
    compute_glue(task, predictions, references) -> dict[str, float]
    compute_squad(predictions: {id: text}, references: [{"id", "answers"}]) -> dict[str, float]

``compute_glue`` returns fractions (0-1), keyed as in ``finetune/metrics/glue/glue.py``
(``accuracy``, ``f1``, ``matthews_correlation``, ``pearson``, ``spearmanr``);
``compute_squad`` returns ``{"exact_match", "f1"}`` in percent (0-100).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import evaluate

METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    """Names of the metrics in METRICS_DIR (directories holding a script of the same name)."""
    return sorted(
        path.name
        for path in METRICS_DIR.iterdir()
        if path.is_dir() and (path / f"{path.name}.py").is_file()
    )


@contextlib.contextmanager
def _evaluate_offline() -> Iterator[None]:
    """Turn on evaluate's offline mode for the enclosed block, then restore it.

    evaluate reads ``HF_EVALUATE_OFFLINE`` from the environment once, at import, into
    ``evaluate.config``; its download helpers consult that attribute on every call, so setting
    the attribute (not the environment variable) is what takes effect after import.
    """
    import evaluate.config

    previous = evaluate.config.HF_EVALUATE_OFFLINE
    evaluate.config.HF_EVALUATE_OFFLINE = True
    try:
        yield
    finally:
        evaluate.config.HF_EVALUATE_OFFLINE = previous


def load_metric(
    name: str, config_name: str | None = None, **kwargs: Any
) -> evaluate.EvaluationModule:
    """``evaluate.load(str(METRICS_DIR / name), config_name, **kwargs)``, offline.

    ``kwargs`` go to ``evaluate.load`` (e.g. ``keep_in_memory=True``, ``cache_dir``,
    ``num_process``/``process_id`` for distributed evaluation). Raises ``ValueError`` for an
    unknown metric name; the metric module itself rejects an unknown config name (GLUE raises an
    error that is both a ``KeyError`` and a ``ValueError``).
    """
    names = available_metrics()
    if name not in names:
        raise ValueError(f"Unknown metric {name!r}; available metrics: {', '.join(names)}")
    import evaluate

    with _evaluate_offline():
        return evaluate.load(str(METRICS_DIR / name), config_name, **kwargs)


def _as_1d(values: Any) -> Any:
    """A (n, 1) array (a regression head's output) becomes (n,); anything else is left alone."""
    array = np.asarray(values)
    if array.ndim == 2 and array.shape[1] == 1:
        return array.reshape(-1)
    return values


def compute_glue(task: str, predictions: Any, references: Any) -> dict[str, float]:
    """GLUE metric(s) of ``task`` (e.g. ``"mrpc"`` -> ``{"accuracy", "f1"}``), as fractions."""
    metric = load_metric("glue", task, keep_in_memory=True)
    return metric.compute(predictions=_as_1d(predictions), references=_as_1d(references))


def compute_squad(
    predictions: Mapping[str, str], references: Sequence[Mapping[str, Any]]
) -> dict[str, float]:
    """SQuAD v1.1 ``{"exact_match", "f1"}`` in percent.

    ``predictions`` maps question id to predicted answer text. ``references`` are rows with
    ``"id"`` and ``"answers"`` (``{"text": [...], "answer_start": [...]}``), e.g. the rows of an
    HF ``squad`` split; any other keys (context, question, title) are ignored.
    """
    metric = load_metric("squad", keep_in_memory=True)
    return metric.compute(
        predictions=[{"id": qid, "prediction_text": text} for qid, text in predictions.items()],
        references=[
            {
                "id": row["id"],
                "answers": {
                    "text": list(row["answers"]["text"]),
                    "answer_start": list(row["answers"]["answer_start"]),
                },
            }
            for row in references
        ],
    )
