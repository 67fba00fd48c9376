"""Fine-tuning tasks generated from the smoke corpus' sentences: SST-2, MRPC and STS-B
in GLUE's TSV layout and a SQuAD v1.1 dev file (rules in the package docstring)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from onebit_bert.io import atomic_write_json
from smoke_data.documents import SOURCE_DOCSTRINGS, Document, _write_utf8, documents

TASK_SIZES: dict[str, tuple[int, int]] = {
    "SST-2": (2000, 400),
    "MRPC": (1500, 300),
    "STS-B": (1500, 300),
}
"""GLUE-like task -> (train rows, dev rows)."""

SQUAD_ARTICLES = 40
SQUAD_PARAGRAPHS = 5
"""SQuAD-like file: articles (documents) and paragraphs (contexts) per article."""

MRPC_HEADER = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"
STSB_HEADER = (
    "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
)
SST2_HEADER = "sentence\tlabel"

# ----------------------------------------------------------------------------- sentences

_SENTENCE_END = re.compile(r"(?<=[.!?])[\"\u201d)]?\s+(?=[\"\u201c(]?[A-Z])")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Mr.", "Dr.", "No.", "approx.")
_TOKEN = re.compile(r"\w+")


def _sentences(paragraph: str) -> list[str]:
    """Split a paragraph at sentence ends (not after common abbreviations)."""
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(paragraph):
        head = paragraph[start : m.start()]
        if head.endswith(_ABBREVIATIONS) or re.search(r"\b[A-Za-z]\.$", head):
            continue
        out.append(paragraph[start : m.end()].strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


_TSV_BREAKERS = re.compile("[\t\n\r\x0b\x0c\x1c-\x1e\x85\u2028\u2029]")
"""Characters that break a TSV row: tabs and whatever ``str.splitlines`` splits on."""


def _tsv_safe(text: str) -> str:
    """One line of text: every whitespace run (tabs and line breaks included) -> one space."""
    return " ".join(_TSV_BREAKERS.sub(" ", text).split())


def _good_sentence(sentence: str) -> bool:
    words = sentence.split()
    return (
        8 <= len(words) <= 40
        and sentence[0].isupper()
        and sentence.endswith((".", "!", "?"))
        and not sentence.endswith(":")
    )


def _sentence_pool(docs: Sequence[Document]) -> list[tuple[str, int]]:
    """Distinct good sentences in corpus order, with the index of their document."""
    seen: dict[str, int] = {}
    for i, doc in enumerate(docs):
        for paragraph in doc.paragraphs:
            for sentence in _sentences(paragraph):
                sentence = _tsv_safe(sentence)
                if _good_sentence(sentence):
                    seen.setdefault(sentence, i)
    return list(seen.items())


def _words(sentence: str) -> list[str]:
    return sentence.split()


def _jaccard(a: str, b: str) -> float:
    wa = dict.fromkeys(t.lower() for t in _TOKEN.findall(a))
    wb = dict.fromkeys(t.lower() for t in _TOKEN.findall(b))
    union = len(wa | wb)
    return len(wa.keys() & wb.keys()) / union if union else 1.0


# ----------------------------------------------------------------------------- GLUE-like tasks


def _split(rows: list, sizes: tuple[int, int]) -> tuple[list, list]:
    train, dev = sizes
    if len(rows) < train + dev:
        raise RuntimeError(f"only {len(rows)} rows for {train} train + {dev} dev")
    return rows[:train], rows[train : train + dev]


def _sst2(pool: list[tuple[str, int]], docs, rng: random.Random) -> tuple[list, list]:
    sizes = TASK_SIZES["SST-2"]
    half = (sizes[0] + sizes[1]) // 2
    by_label: dict[int, list[str]] = {0: [], 1: []}
    for sentence, d in pool:
        by_label[int(docs[d].source == SOURCE_DOCSTRINGS)].append(sentence)
    rows = []
    for label in (0, 1):
        if len(by_label[label]) < half:
            raise RuntimeError(
                f"SST-2: only {len(by_label[label])} sentences with label {label}, need {half}"
            )
        chosen = rng.sample(by_label[label], half)
        rows.extend((s, label) for s in chosen)
    rng.shuffle(rows)
    return _split(rows, sizes)


def _perturb_equivalent(sentence: str, rng: random.Random) -> str:
    """Drop one or two words, or swap two adjacent words."""
    words = _words(sentence)
    if rng.random() < 0.5:
        for _ in range(rng.choice((1, 2))):
            del words[rng.randrange(1, len(words) - 1)]
    else:
        i = rng.randrange(1, len(words) - 2)
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def _pair_rows(
    task: str, pool: list[tuple[str, int]], rng: random.Random, row
) -> tuple[list, list]:
    """A sentence-pair task's (train, dev) rows, shuffled: ``row(n, i, s1)`` for the n-th of
    its distinct first sentences ``s1``, ``pool[i]``."""
    sizes = TASK_SIZES[task]
    firsts = rng.sample(range(len(pool)), sum(sizes))
    rows = [row(n, i, pool[i][0]) for n, i in enumerate(firsts)]
    rng.shuffle(rows)
    return _split(rows, sizes)


def _mrpc(pool: list[tuple[str, int]], rng: random.Random) -> tuple[list, list]:
    def row(n: int, i: int, s1: str) -> tuple:
        if n % 2 == 0:
            label, s2 = 1, _perturb_equivalent(s1, rng)
        else:
            j = rng.randrange(len(pool) - 1)
            j += j >= i  # any other sentence
            label, s2 = 0, pool[j][0]
        return (label, 100000 + 2 * n, 100001 + 2 * n, s1, s2)

    return _pair_rows("MRPC", pool, rng, row)


def _stsb_table(rows: list) -> list:
    """STS-B rows in the columns of :data:`STSB_HEADER`."""
    return [
        (k, "smoke", "generated", "2024", n, "none", "none", s1, s2, f"{score:.2f}")
        for k, (n, s1, s2, score) in enumerate(rows)
    ]


def _stsb(pool: list[tuple[str, int]], rng: random.Random) -> tuple[list, list]:
    def row(n: int, i: int, s1: str) -> tuple:
        other = _words(pool[rng.randrange(len(pool))][0])
        if n % 6 == 0:
            s2 = " ".join(other)  # unrelated (or, rarely, the same) sentence
        else:
            words = _words(s1)
            share = rng.random() ** 1.5  # share of words replaced (skewed low: even scores)
            for k in range(len(words)):
                if rng.random() < share:
                    words[k] = rng.choice(other)
            if rng.random() < 0.3 and len(words) > 4:
                del words[rng.randrange(len(words))]
            s2 = " ".join(words)
        return (n, s1, s2, round(5 * _jaccard(s1, s2), 2))

    train, dev = _pair_rows("STS-B", pool, rng, row)
    return _stsb_table(train), _stsb_table(dev)


def _write_tsv(path: Path, header: str, rows: list[Sequence[object]]) -> None:
    lines = [header]
    for row in rows:
        cells = [str(c) for c in row]
        for cell in cells:
            if _TSV_BREAKERS.search(cell):
                raise ValueError(f"tab or line break in TSV cell {cell!r}")
        lines.append("\t".join(cells))
    _write_utf8(path, "\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- SQuAD-like

_SPAN_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_'\-]*")


def _questions(context: str, rng: random.Random, count: int) -> list[tuple[str, str, int]]:
    """Up to ``count`` (question, answer, answer_start): the 1-3 words after a word trigram
    that occurs once in the context, all separated by single spaces."""
    words = [(m.start(), m.end()) for m in _SPAN_WORD.finditer(context)]
    text = [context[a:b] for a, b in words]
    trigrams: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 2):
        key = tuple(w.lower() for w in text[i : i + 3])
        trigrams[key] = trigrams.get(key, 0) + 1
    starts = [
        i for i in range(len(words) - 3) if trigrams[tuple(w.lower() for w in text[i : i + 3])] == 1
    ]
    chosen: list[tuple[int, int]] = []
    for i in rng.sample(starts, len(starts)):
        last = min(i + 2 + rng.randint(1, 3), len(words) - 1)  # 1-3 answer words
        if any(context[words[k][1] : words[k + 1][0]] != " " for k in range(i, last)):
            continue  # punctuation or a line break inside the cue or the answer
        if all(last < j or i > end for j, end in chosen):  # no overlapping spans
            chosen.append((i, last))
            if len(chosen) == count:
                break
    out = []
    for i, last in sorted(chosen):
        cue = " ".join(text[i : i + 3])
        start, end = words[i + 3][0], words[last][1]
        out.append((f'What comes after "{cue}"?', context[start:end], start))
    return out


def _squad(docs: Sequence[Document], rng: random.Random) -> dict:
    eligible = []
    for doc in docs:
        paragraphs = [p for p in doc.paragraphs if 250 <= len(p) <= 1200]
        if len(paragraphs) >= SQUAD_PARAGRAPHS:
            eligible.append((doc, paragraphs))
    articles = []
    qid = 0
    for doc, paragraphs in rng.sample(eligible, min(SQUAD_ARTICLES, len(eligible))):
        entries = []
        for context in rng.sample(paragraphs, SQUAD_PARAGRAPHS):
            questions = _questions(context, rng, rng.choice((2, 3)))
            if len(questions) < 2:
                continue  # (not seen in practice: paragraphs have many unique trigrams)
            qas = []
            for question, answer, start in questions:
                qas.append(
                    {
                        "id": f"smoke-{qid:05d}",
                        "question": question,
                        "answers": [{"text": answer, "answer_start": start}],
                    }
                )
                qid += 1
            entries.append({"context": context, "qas": qas})
        articles.append({"title": doc.title, "paragraphs": entries})
    return {"version": "1.1", "data": articles}


def write_tasks(directory: Path, seed: int = 0) -> Path:
    """Write the generated fine-tuning tasks under ``directory`` (GLUE layout
    ``SST-2``/``MRPC``/``STS-B`` ``{train,dev}.tsv`` and ``squad/dev-v1.1.json``), atomically;
    deterministic for ``seed``. Returns ``directory``."""
    directory = Path(directory)
    docs = documents()
    pool = _sentence_pool(docs)

    glue = {
        "SST-2": (SST2_HEADER, _sst2(pool, docs, random.Random(f"smoke-data/sst2/{seed}"))),
        "MRPC": (MRPC_HEADER, _mrpc(pool, random.Random(f"smoke-data/mrpc/{seed}"))),
        "STS-B": (STSB_HEADER, _stsb(pool, random.Random(f"smoke-data/stsb/{seed}"))),
    }
    for folder, (header, splits) in glue.items():
        for name, rows in zip(("train", "dev"), splits, strict=True):
            _write_tsv(directory / folder / f"{name}.tsv", header, rows)

    rng = random.Random(f"smoke-data/squad/{seed}")
    atomic_write_json(directory / "squad" / "dev-v1.1.json", _squad(docs, rng))
    return directory
