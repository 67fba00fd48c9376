"""SQuAD v1.1 data handling for BERT extractive question answering.

The pipeline follows the usual BERT recipe (Hugging Face's ``run_qa.py`` is the behavioural
reference):

* :func:`read_squad_json` / :func:`load_squad` turn the official SQuAD v1.1 JSON (or the hub
  dataset ``rajpurkar/squad``) into :class:`SquadExample` records.
* :func:`prepare_train_features` tokenizes ``[CLS] question [SEP] context [SEP]`` and splits
  long contexts into overlapping windows (``doc_stride`` tokens of overlap). Each window is
  labelled with the token span of the first answer, or with the ``[CLS]`` index when the answer
  is not entirely inside that window.
* :func:`prepare_eval_features` produces the same windows plus what post-processing needs: the
  example id of each window and character offsets for its context tokens only.
* :func:`postprocess_predictions` maps start/end logits back to answer text in the context.

:func:`split_by_article` exists only for local runs without SQuAD's train file; see its
docstring.

Any Hugging Face *fast* tokenizer works (offset mappings are required). Questions longer than
``max_query_length`` tokens are cut at a token boundary, as in the original BERT code, so a
pathological question cannot make the tokenizer fail.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "HUB_DATASET",
    "LOCAL_FILES",
    "SquadExample",
    "load_squad",
    "postprocess_predictions",
    "prepare_eval_features",
    "prepare_train_features",
    "read_squad_json",
    "split_by_article",
]

HUB_DATASET = "rajpurkar/squad"
# Split name -> file name under <data_root>/squad/ (the official SQuAD v1.1 file names).
LOCAL_FILES = {"train": "train-v1.1.json", "validation": "dev-v1.1.json"}
_SPLIT_ALIASES = {"train": "train", "validation": "validation", "dev": "validation"}


@dataclass(frozen=True)
class SquadExample:
    """One SQuAD question. ``answers`` uses the Hugging Face ``squad`` layout:
    ``{"text": [str, ...], "answer_start": [int, ...]}`` (character offsets into ``context``)."""

    id: str
    title: str
    context: str
    question: str
    answers: dict


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> Any:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: {where} should be a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ValueError(f"{path}: {where} is missing the key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ValueError(f"{path}: {where}[{key!r}] should be {names}, got {type(value).__name__}")
    return value


def read_squad_json(path: str | Path) -> list[SquadExample]:
    """Read an official SQuAD v1.1 JSON file (``data`` -> articles -> ``paragraphs`` -> ``qas``).

    Every answer is checked: ``context[answer_start : answer_start + len(text)]`` must equal the
    answer text. Malformed input (not JSON, a missing or mistyped key, a wrong ``answer_start``,
    a duplicate question id) raises ``ValueError`` naming the file and the offending entry.
    """
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as f:
            root = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from exc

    articles = _field(root, "data", list, "the top level", path)
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(articles):
        where = f"data[{a}]"
        title = _field(article, "title", str, where, path)
        paragraphs = _field(article, "paragraphs", list, where, path)
        for p, paragraph in enumerate(paragraphs):
            where_p = f"{where}.paragraphs[{p}]"
            context = _field(paragraph, "context", str, where_p, path)
            qas = _field(paragraph, "qas", list, where_p, path)
            for q, qa in enumerate(qas):
                where_q = f"{where_p}.qas[{q}]"
                qid = _field(qa, "id", str, where_q, path)
                question = _field(qa, "question", str, where_q, path)
                answers = _field(qa, "answers", list, where_q, path)
                if qid in seen:
                    raise ValueError(f"{path}: {where_q} repeats the question id {qid!r}")
                seen.add(qid)
                texts: list[str] = []
                starts: list[int] = []
                for n, answer in enumerate(answers):
                    where_n = f"{where_q}.answers[{n}] (question id {qid!r})"
                    text = _field(answer, "text", str, where_n, path)
                    start = _field(answer, "answer_start", int, where_n, path)
                    if start < 0 or context[start : start + len(text)] != text:
                        found = context[max(start, 0) : max(start, 0) + len(text)]
                        raise ValueError(
                            f"{path}: {where_n} answer_start={start} does not point at the answer "
                            f"text {text!r} in the context (found {found!r})"
                        )
                    texts.append(text)
                    starts.append(start)
                examples.append(
                    SquadExample(
                        id=qid,
                        title=title,
                        context=context,
                        question=question,
                        answers={"text": texts, "answer_start": starts},
                    )
                )
    return examples


def load_squad(
    split: str, data_root: str | Path | None, path: str | None = None
) -> list[SquadExample]:
    """Load a SQuAD v1.1 split (``"train"`` or ``"validation"``; ``"dev"`` is an alias).

    * ``path`` given: read that JSON file.
    * else ``data_root`` given: read ``<data_root>/squad/train-v1.1.json`` or ``dev-v1.1.json``.
    * else: download ``rajpurkar/squad`` from the Hugging Face hub via ``datasets``.

    A missing local file raises ``FileNotFoundError`` (which file, and what to do); any hub
    failure (offline, no network, missing package) raises one ``RuntimeError`` saying so.
    """
    if split not in _SPLIT_ALIASES:
        raise ValueError(f"unknown SQuAD split {split!r}; expected 'train' or 'validation'")
    split = _SPLIT_ALIASES[split]

    if path is not None or data_root is not None:
        file = Path(path) if path is not None else Path(data_root) / "squad" / LOCAL_FILES[split]
        if not file.is_file():
            hint = (
                f"Download the official SQuAD v1.1 {split} file ({LOCAL_FILES[split]}) to that "
                "path, pass another file with path=..., or pass data_root=None to load "
                f"{HUB_DATASET} from the Hugging Face hub."
            )
            if split == "train":
                hint += (
                    " For a local run with only the dev file, split it by article with "
                    "split_by_article() (results are then not comparable to SQuAD dev scores)."
                )
            raise FileNotFoundError(f"SQuAD v1.1 {split} file not found: {file}. {hint}")
        return read_squad_json(file)

    try:
        import datasets

        rows = datasets.load_dataset(HUB_DATASET, split=split)
        return [
            SquadExample(
                id=str(row["id"]),
                title=str(row["title"]),
                context=row["context"],
                question=row["question"],
                answers={
                    "text": list(row["answers"]["text"]),
                    "answer_start": [int(s) for s in row["answers"]["answer_start"]],
                },
            )
            for row in rows
        ]
    except Exception as exc:
        raise RuntimeError(
            f"could not load SQuAD {split} from the Hugging Face hub ({HUB_DATASET}): "
            f"{type(exc).__name__}: {exc}. Without hub access, pass data_root (expects "
            f"<data_root>/squad/{LOCAL_FILES[split]}) or path to a local SQuAD v1.1 JSON file."
        ) from exc


# ---------------------------------------------------------------------------------------------
# Local train/eval split
# ---------------------------------------------------------------------------------------------


def split_by_article(
    examples: Sequence[SquadExample], eval_fraction: float = 0.2, seed: int = 0
) -> tuple[list[SquadExample], list[SquadExample]]:
    """Split examples into (train, eval) by whole article (``title``).

    FOR LOCAL RUNS ONLY, when SQuAD's train file is unavailable and all that exists is the dev
    file. The official protocol trains on ``train-v1.1.json`` and reports on ``dev-v1.1.json``;
    scores from this split are NOT comparable to published SQuAD dev numbers.

    Whole articles go to one side, so no paragraph or question of an eval article is seen in
    training (SQuAD questions on the same paragraph share context and often answers). Articles
    are ordered by a hash of ``(seed, title)``, which is deterministic across runs, platforms
    and Python versions, and assigned to eval until eval holds at least ``eval_fraction`` of the
    questions (so the question fraction is roughly ``eval_fraction``, off by at most one
    article). With two or more articles, each side gets at least one. Examples keep their
    original order within each side.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    counts: dict[str, int] = {}
    for ex in examples:
        counts[ex.title] = counts.get(ex.title, 0) + 1
    if len(counts) < 2:
        raise ValueError(f"need at least two articles (titles) to split, got {len(counts)}")

    def key(title: str) -> str:
        return hashlib.sha256(f"{seed}\0{title}".encode()).hexdigest()

    order = sorted(counts, key=lambda t: (key(t), t))
    target = eval_fraction * len(examples)
    eval_titles: set[str] = set()
    n_eval = 0
    for title in order[:-1]:  # the last article always stays in train
        if n_eval >= target:
            break
        eval_titles.add(title)
        n_eval += counts[title]
    train = [ex for ex in examples if ex.title not in eval_titles]
    evaluation = [ex for ex in examples if ex.title in eval_titles]
    return train, evaluation


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


BROKEN_TOKENIZERS = ("0.23.1", "0.23.2")
"""tokenizers releases whose truncation stops tokenizing at ``max_length``, so a long context
yields one or two windows instead of all of them (huggingface/tokenizers#2091)."""


def _tokenizers_version() -> str:
    return importlib.metadata.version("tokenizers")


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            "SQuAD features need a Hugging Face fast tokenizer (for offset mappings), got "
            f"{type(tokenizer).__name__}"
        )
    version = _tokenizers_version()
    if version in BROKEN_TOKENIZERS:
        raise RuntimeError(
            f"tokenizers {version} drops the overflowing windows of long SQuAD contexts "
            "(huggingface/tokenizers#2091), so most answers would never be seen: install "
            "another release, e.g. pip install 'tokenizers>=0.23.3'"
        )


def _cut_questions(questions: list[str], tokenizer: Any, limit: int) -> list[str]:
    """``questions`` with any longer than ``limit`` tokens shortened at a token start."""
    enc = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    out = list(questions)
    for i, offsets in enumerate(enc["offset_mapping"]):
        if len(offsets) <= limit:
            continue
        # Cutting before token k keeps k tokens, unless the cut splits a word whose remainder
        # re-tokenizes differently; then back off one token at a time.
        for k in range(limit, 0, -1):
            cut = questions[i][: offsets[k][0]].rstrip()
            if len(tokenizer(cut, add_special_tokens=False)["input_ids"]) <= limit:
                out[i] = cut
                break
        else:
            raise ValueError(f"cannot shorten question to {limit} tokens: {questions[i][:80]!r}")
    return out


def _encode(
    examples: Sequence[SquadExample],
    tokenizer: Any,
    max_length: int,
    doc_stride: int,
    max_query_length: int | None,
) -> Any:
    """Tokenize question/context pairs into padded, overlapping windows."""
    _check_tokenizer(tokenizer)
    if tokenizer.padding_side != "right":
        raise ValueError("expected a tokenizer that pads on the right (question first)")
    # [CLS] q [SEP] c [SEP]: the tokenizer needs more than doc_stride context tokens per window.
    room = max_length - tokenizer.num_special_tokens_to_add(pair=True) - doc_stride - 1
    if doc_stride < 0 or room < 1:
        raise ValueError(
            f"doc_stride={doc_stride} leaves no room for a question with max_length={max_length}"
        )
    limit = room if max_query_length is None else min(max_query_length, room)
    # Some SQuAD questions start with whitespace; strip it (it only wastes tokens).
    questions = _cut_questions([ex.question.lstrip() for ex in examples], tokenizer, limit)
    return tokenizer(
        questions,
        [ex.context for ex in examples],
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        return_token_type_ids=True,
        padding="max_length",
    )


def _context_range(sequence_ids: list[int | None]) -> tuple[int, int]:
    """First and last token index of the context (sequence 1) in one window."""
    first = sequence_ids.index(1)
    last = len(sequence_ids) - 1 - sequence_ids[::-1].index(1)
    return first, last


def prepare_train_features(
    examples: Sequence[SquadExample],
    tokenizer: Any,
    max_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int | None = 64,
) -> dict[str, list]:
    """Training windows with answer-span labels.

    Each example gives one or more windows ``[CLS] question [SEP] context-chunk [SEP]`` padded to
    ``max_length``; consecutive chunks of a long context overlap by ``doc_stride`` tokens.
    ``start_positions``/``end_positions`` are the token indices of the smallest token span that
    covers the first answer, or ``0`` (the ``[CLS]`` index) for both when that answer is not
    entirely inside the window (or the example has no answer).

    Returns ``input_ids``, ``token_type_ids``, ``attention_mask``, ``start_positions`` and
    ``end_positions``, one entry per window. Examples are independent, so callers may process
    a large split in chunks and concatenate the results.
    """
    enc = _encode(examples, tokenizer, max_length, doc_stride, max_query_length)
    starts: list[int] = []
    ends: list[int] = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        ex = examples[enc["overflow_to_sample_mapping"][i]]
        ids = enc["input_ids"][i]
        cls_index = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        start_tok = end_tok = cls_index
        if ex.answers["text"]:
            start_char = ex.answers["answer_start"][0]
            end_char = start_char + len(ex.answers["text"][0])
            first, last = _context_range(enc.sequence_ids(i))
            if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
                # Smallest covering span: first token ending after start_char, last token
                # starting before end_char.
                s = first
                while s < last and offsets[s][1] <= start_char:
                    s += 1
                e = last
                while e > s and offsets[e][0] >= end_char:
                    e -= 1
                start_tok, end_tok = s, e
        starts.append(start_tok)
        ends.append(end_tok)
    return {
        "input_ids": enc["input_ids"],
        "token_type_ids": enc["token_type_ids"],
        "attention_mask": enc["attention_mask"],
        "start_positions": starts,
        "end_positions": ends,
    }


def prepare_eval_features(
    examples: Sequence[SquadExample],
    tokenizer: Any,
    max_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int | None = 64,
) -> dict[str, list]:
    """Evaluation windows (the same windows as :func:`prepare_train_features`).

    Returns ``input_ids``, ``token_type_ids``, ``attention_mask``, ``example_id`` (the
    :attr:`SquadExample.id` each window came from) and ``offset_mapping``: per token a
    ``(start_char, end_char)`` pair into the example's context, or ``None`` for tokens that are
    not context (``[CLS]``, question, ``[SEP]``, padding), so post-processing can only pick
    context spans.
    """
    enc = _encode(examples, tokenizer, max_length, doc_stride, max_query_length)
    example_ids: list[str] = []
    offset_mapping: list[list[tuple[int, int] | None]] = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        example_ids.append(examples[enc["overflow_to_sample_mapping"][i]].id)
        seq = enc.sequence_ids(i)
        offset_mapping.append(
            [tuple(o) if s == 1 else None for o, s in zip(offsets, seq, strict=True)]
        )
    return {
        "input_ids": enc["input_ids"],
        "token_type_ids": enc["token_type_ids"],
        "attention_mask": enc["attention_mask"],
        "example_id": example_ids,
        "offset_mapping": offset_mapping,
    }


# ---------------------------------------------------------------------------------------------
# Post-processing
# ---------------------------------------------------------------------------------------------


def postprocess_predictions(
    examples: Sequence[SquadExample],
    features: Mapping[str, Sequence],
    start_logits: Any,
    end_logits: Any,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Answer text per example id from start/end logits of the eval windows.

    ``features`` is the output of :func:`prepare_eval_features` (or a ``datasets.Dataset`` with
    its ``example_id`` and ``offset_mapping`` columns); ``start_logits``/``end_logits`` have shape
    ``[n_features, seq_len]`` in the same order. For every window of an example the
    ``n_best_size`` highest-scoring start and end indices are taken among its context tokens
    (tokens whose offset is not ``None``; restricting first means ``[CLS]`` or question logits
    cannot crowd out context candidates), pairs with ``end >= start`` and
    ``end - start + 1 <= max_answer_length`` are scored by ``start_logit + end_logit``, and the
    best pair over all windows wins. The answer is ``context[offset[start][0]:offset[end][1]]``;
    an example with no valid span gets ``""``.
    """
    if n_best_size < 1 or max_answer_length < 1:
        raise ValueError("n_best_size and max_answer_length must be positive")
    example_ids = list(features["example_id"])
    offset_mapping = features["offset_mapping"]
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    n = len(example_ids)
    if start_logits.ndim != 2 or start_logits.shape != end_logits.shape or len(start_logits) != n:
        raise ValueError(
            f"expected start/end logits of shape [{n}, seq_len], got {start_logits.shape} and "
            f"{end_logits.shape}"
        )

    windows: dict[str, list[int]] = {}
    for i, eid in enumerate(example_ids):
        windows.setdefault(eid, []).append(i)

    predictions: dict[str, str] = {}
    for ex in examples:
        best_score = -np.inf
        best_text = ""
        for i in windows.get(ex.id, []):
            offsets = offset_mapping[i]
            seq_len = min(len(offsets), start_logits.shape[1])
            ctx = np.array([j for j in range(seq_len) if offsets[j] is not None], dtype=np.int64)
            if ctx.size == 0:
                continue
            s_logits = start_logits[i, ctx]
            e_logits = end_logits[i, ctx]
            k = min(n_best_size, ctx.size)
            # Top-k positions (within ctx) by logit, highest first; stable for ties.
            s_top = np.argsort(-s_logits, kind="stable")[:k]
            e_top = np.argsort(-e_logits, kind="stable")[:k]
            s_tok = ctx[s_top][:, None]
            e_tok = ctx[e_top][None, :]
            valid = (e_tok >= s_tok) & (e_tok - s_tok + 1 <= max_answer_length)
            if not valid.any():
                continue
            scores = np.where(valid, s_logits[s_top][:, None] + e_logits[e_top][None, :], -np.inf)
            a, b = np.unravel_index(int(np.argmax(scores)), scores.shape)
            if scores[a, b] > best_score:
                best_score = float(scores[a, b])
                start_char = offsets[int(s_tok[a, 0])][0]
                end_char = offsets[int(e_tok[0, b])][1]
                best_text = ex.context[start_char:end_char]
        predictions[ex.id] = best_text
    return predictions
