"""Offline smoke-test data: a small English corpus and generated fine-tuning tasks.

``make smoke`` runs the whole chain (data prep, pretraining, fine-tuning, report) on a fresh
machine with no network and no third-party text in the repository, so the text comes from
what every CPython installation carries:

* ``pydoc_data.topics.topics``: the language reference topics shown by ``help()`` (~79
  topics, ~465 KB of English prose), one document per topic, cleaned of reST headings,
  directives, tables and code blocks, with hard-wrapped lines joined into paragraphs;
* the docstrings of :data:`STDLIB_MODULES`, a fixed list of pure-Python standard-library
  modules, one document per module: its docstring followed by the docstrings of its public
  classes (and their public methods) and functions, in sorted-name order, without doctest
  or code-like lines and without very short docstrings.

Everything is deterministic for a given Python version and platform (sorted names, no order
taken from sets or string hashes, :class:`random.Random` seeded from the task seed); another
Python version ships other docs, so the corpus and tasks differ between versions.

From the same documents :func:`write_tasks` builds small tasks whose labels follow simple
rules that a small BERT can learn, in the layouts the fine-tuning stage reads:

* ``SST-2``: is the sentence from a standard-library docstring (1) or a language-reference
  topic (0)? Balanced 50/50, every sentence used once;
* ``MRPC``: is sentence 2 sentence 1 with one or two words dropped or two adjacent words
  swapped (1), or another sentence of a document (0)?
* ``STS-B``: sentence 2 is sentence 1 with a random share of its words replaced by words of
  another sentence (or an unrelated sentence); the score is 5 x the Jaccard overlap of the
  two sentences' lower-cased word sets;
* ``squad/dev-v1.1.json``: articles are documents, contexts their paragraphs; a question
  ``What comes after "w1 w2 w3"?`` is answered by the next one to three words. Only a dev
  file: the fine-tuning stage splits it by article for local runs.

Run ``python -m pipeline.smoke_data --out DIR`` to write ``DIR/corpus.jsonl`` (+
``corpus.json``), ``DIR/{SST-2,MRPC,STS-B}/{train,dev}.tsv`` and ``DIR/squad/dev-v1.1.json``;
it prints a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.io import atomic_write_bytes, atomic_write_json

STDLIB_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "difflib",
    "email.message",
    "email.utils",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html.parser",
    "http.client",
    "http.cookiejar",
    "http.server",
    "imaplib",
    "inspect",
    "io",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "logging.handlers",
    "mailbox",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "poplib",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "selectors",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "traceback",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zipfile",
)
"""Standard-library modules whose docstrings join the corpus (a module that cannot be imported,
e.g. a build without ``_ssl`` or ``_sqlite3``, is skipped; none of these needs one)."""

SOURCE_TOPICS = "pydoc_topics"
SOURCE_DOCSTRINGS = "stdlib_docstrings"

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

MIN_DOCSTRING_CHARS = 60
"""Docstrings (after cleaning) shorter than this are skipped."""


@dataclass(frozen=True)
class Document:
    """One corpus document: a title unique in the corpus, its source and its paragraphs."""

    title: str
    source: str  # SOURCE_TOPICS or SOURCE_DOCSTRINGS
    paragraphs: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n\n".join(self.paragraphs)


# ----------------------------------------------------------------------------- cleaning

_UNDERLINE = re.compile(r"^\s*([*=\-~^\"#+`:.'_])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\. ")
_TABLE = re.compile(r"^\s*(\+[-=+]{3,}|\|.*\||=+( +=+)+\s*$)")
_BULLET = re.compile(r"^(?:[*\-+\u2022]|\d{1,2}[.)]|\([a-z0-9]\))\s+")
_CODE_LINE = re.compile(
    r"""^(>>>|\.\.\.|\$\s|\#|@\w|
        (async\s+)?(def|class)\s+\w+.*:$|
        (import\s+\w[\w.]*(\s+as\s+\w+)?$|from\s+[\w.]+\s+import\s)|
        (else|try|finally|except)\s*:$|
        (if|elif|for|while|with|except)\s.*[()=\[\].].*:$|
        [A-Za-z_][\w.\[\]]*(\s*,\s*[A-Za-z_][\w.\[\]]*)*\s*(=|\+=|-=|\*=|\|=|//=)\s*[^\s=].*$)""",
    re.VERBOSE,
)
_CODE_MARKERS = ("::=", ">>>", "Traceback (most recent")
_QUOTED = re.compile(r"\"[^\"\s][^\"]*\"|'[^'\s][^']*'|`[^`]+`")
_INLINE_COMMENT = re.compile(r"\S\s+#\s")
_WORD = re.compile(r"[A-Za-z][A-Za-z'\u2019\-]*[A-Za-z]|[A-Za-z]")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^*\s][^*]*?)\*{1,2}(?![\w*])")
_BACKQUOTES = re.compile(r"`+([^`]+)`+")
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]+)`")
_FOOTNOTE = re.compile(r"\s*\[(\d{1,2}|#)\](?=\W|$)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _code_like_line(line: str) -> bool:
    """True for a line that reads as code: doctest, definition, import, assignment, comment."""
    s = line.strip()
    if not s:
        return False
    if _CODE_LINE.match(s) or _INLINE_COMMENT.search(s) or any(m in s for m in _CODE_MARKERS):
        return True
    return s.endswith(("{", "(", "[", "\\")) and not _BULLET.match(s)


def _letter_share(text: str) -> float:
    """Share of letters and spaces in ``text``, each quoted literal counted as one letter."""
    text = _QUOTED.sub("x", text)
    return sum(c.isalpha() or c == " " for c in text) / max(len(text), 1)


def _prose_like(text: str) -> bool:
    """A paragraph worth keeping: enough words, mostly plain words, ends like a sentence (or
    is a long run of plain words: a list item)."""
    tokens = text.split()
    if len(tokens) < 6:
        return False
    wordy = sum(bool(_WORD.fullmatch(t.strip(".,;:!?()\"'\u201c\u201d"))) for t in tokens)
    if wordy / len(tokens) < 0.6:
        return False
    share = _letter_share(text)
    if share < 0.8:
        return False
    upper = sum(c.isupper() for c in text)
    if upper * 2 > sum(c.isalpha() for c in text):
        return False  # SHOUTED text (licence disclaimers)
    return text[-1] in ".:;!?)\"\u201d'" or (len(tokens) >= 8 and share >= 0.9)


def _inline(text: str) -> str:
    """Drop inline reST markup: roles, ``literals``, *emphasis*; collapse whitespace."""
    text = _ROLE.sub(r"\1", text)
    text = _BACKQUOTES.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    text = _FOOTNOTE.sub("", text)
    text = " ".join(text.split())
    return text[:-1] if text.endswith("::") else text


def _blocks(lines: Sequence[str]) -> list[list[str]]:
    """Lines grouped into blocks separated by blank lines; a bullet line starts a new block."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in lines:
        if not line.strip():
            if current:
                blocks.append(current)
            current = []
        elif current and _BULLET.match(line.strip()):
            blocks.append(current)
            current = [line]
        else:
            current.append(line)
    if current:
        blocks.append(current)
    return blocks


def clean_text(text: str) -> list[str]:
    """reST-ish text (a pydoc topic, a docstring) -> prose paragraphs, one string each.

    Drops headings (a line underlined by ``****``/``====``/...), directive lines (``.. x::``),
    tables, doctest lines (``>>>``, ``...``), literal blocks (a block indented deeper than the
    paragraph ending in ``:`` before it, unless it reads as prose) and any block that does
    not read as prose; joins hard-wrapped lines and strips bullets and inline markup.
    """
    lines = text.expandtabs(8).replace("\r\n", "\n").split("\n")
    kept: list[str] = []
    for i, line in enumerate(lines):
        if _UNDERLINE.match(line):
            if kept and kept[-1].strip() and kept[-1] == lines[i - 1].rstrip():
                kept.pop()  # the heading text above the underline
            kept.append("")
            continue
        s = line.strip()
        if _DIRECTIVE.match(line) or _TABLE.match(line) or s.startswith((">>>", "...")):
            kept.append("")
            continue
        kept.append(line.rstrip())

    paragraphs: list[str] = []
    intro_indent: int | None = None  # indent of the last paragraph ending with ':'
    for block in _blocks(kept):
        indent = min(_indent(line) for line in block)
        first = block[0].strip()
        literal = intro_indent is not None and indent > intro_indent and not _BULLET.match(first)
        codes = sum(_code_like_line(line) for line in block)
        if literal or codes * 3 >= len(block) or _code_like_line(block[0]):
            continue  # a code block (or mostly code)
        if codes and len(block) <= 2:
            continue
        joined = _inline(" ".join(line.strip() for line in block))
        joined = _BULLET.sub("", joined, count=1)
        if any(m in joined for m in _CODE_MARKERS) or not _prose_like(joined):
            intro_indent = None
            continue
        intro_indent = _indent(block[-1]) if joined.endswith(":") else None
        paragraphs.append(joined)
    return paragraphs


# ----------------------------------------------------------------------------- documents


def _write_utf8(path: Path, text: str) -> None:
    """Atomic write of UTF-8 text, whatever the locale, with ``\\n`` line ends."""
    atomic_write_bytes(path, text.encode("utf-8"))


def _topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        paragraphs = tuple(clean_text(topics[key]))
        if paragraphs:
            docs.append(Document(f"topic: {key}", SOURCE_TOPICS, paragraphs))
    return docs


def _own_doc(obj: object) -> str | None:
    """``obj``'s own docstring (not one inherited from a base class or the metaclass)."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    if inspect.isclass(obj):
        if obj.__dict__.get("__doc__") is not doc:
            return None
        for base in obj.__mro__[1:]:
            if base.__dict__.get("__doc__") == doc:
                return None  # e.g. an Enum subclass's copied docstring
    return doc


def _public_members(module: object, module_name: str) -> list[tuple[str, object]]:
    """Public classes and functions defined in ``module`` (or its submodules), sorted by name."""
    members = []
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = vars(module)[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        defined_in = getattr(obj, "__module__", None) or ""
        if defined_in == module_name or defined_in.startswith(module_name + "."):
            members.append((name, obj))
    return members


def _class_method_docs(cls: type) -> list[str]:
    docs = []
    for name in sorted(cls.__dict__):
        if name.startswith("_"):
            continue
        attr = cls.__dict__[name]
        if isinstance(attr, staticmethod | classmethod):
            attr = attr.__func__
        if inspect.isfunction(attr) or isinstance(attr, property):
            doc = attr.__doc__
            if isinstance(doc, str):
                docs.append(doc)
    return docs


def _docstring_paragraphs(doc: str) -> list[str]:
    paragraphs = clean_text(inspect.cleandoc(doc))
    if sum(len(p) for p in paragraphs) < MIN_DOCSTRING_CHARS:
        return []
    return paragraphs


def _module_document(module_name: str) -> Document | None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    docs: list[str] = []
    if isinstance(module.__doc__, str):
        docs.append(module.__doc__)
    for _, obj in _public_members(module, module_name):
        own = _own_doc(obj)
        if own is not None:
            docs.append(own)
        if inspect.isclass(obj):
            docs.extend(_class_method_docs(obj))
    paragraphs: dict[str, None] = {}  # insertion-ordered de-duplication
    for doc in docs:
        for paragraph in _docstring_paragraphs(doc):
            paragraphs.setdefault(paragraph)
    if not paragraphs:
        return None
    return Document(f"module: {module_name}", SOURCE_DOCSTRINGS, tuple(paragraphs))


def _candidate_documents() -> list[Document]:
    """Topics, then one document per :data:`STDLIB_MODULES` module, as this interpreter sees
    them (see :func:`_fresh_candidate_documents` for why that must be a fresh one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules touched while inspecting
        candidates = _topic_documents()
        for name in STDLIB_MODULES:
            doc = _module_document(name)
            if doc is not None:
                candidates.append(doc)
    return candidates


_CHILD = (
    "import json, sys\n"
    "from pipeline.smoke_data import _candidate_documents\n"
    "json.dump([[d.title, d.source, list(d.paragraphs)] for d in _candidate_documents()],"
    " sys.stdout)\n"
)


def _fresh_candidate_documents() -> list[Document]:
    """:func:`_candidate_documents` computed in a new interpreter that has imported nothing
    else. Libraries patch standard-library modules when imported (transformers adds methods
    to ``logging.Logger``, others wrap ``inspect`` functions), so inspecting the modules in a
    process that has loaded them would make the corpus depend on what ran before."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP", "PYTHONINSPECT")}
    env["PYTHONPATH"] = root  # this checkout's pipeline package and nothing else
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"reading the standard-library docs failed:\n{proc.stderr.strip()}")
    return [Document(t, s, tuple(p)) for t, s, p in json.loads(proc.stdout)]


@functools.lru_cache(maxsize=4)
def documents(min_chars: int = 200) -> tuple[Document, ...]:
    """The corpus documents: topics in sorted order, then modules in :data:`STDLIB_MODULES`
    order. A paragraph seen before (in an earlier document or this one) is dropped: the
    ``compound`` topic repeats ``if``, ``while``, ...; modules share docstrings. Then every
    document shorter than ``min_chars`` characters is dropped."""
    candidates = _fresh_candidate_documents()
    seen: set[str] = set()
    docs = []
    for doc in candidates:
        paragraphs = []
        for paragraph in doc.paragraphs:
            if paragraph not in seen:
                seen.add(paragraph)
                paragraphs.append(paragraph)
        kept = Document(doc.title, doc.source, tuple(paragraphs))
        if paragraphs and len(kept.text) >= min_chars:
            docs.append(kept)
    return tuple(docs)


def smoke_documents(min_chars: int = 200) -> list[str]:
    """The corpus as plain texts, paragraphs separated by blank lines; deterministic for a
    given Python version."""
    return [d.text for d in documents(min_chars)]


def write_corpus(directory: Path) -> Path:
    """Write ``<directory>/corpus.jsonl`` (one ``{"text": ...}`` per document, paragraphs
    separated by ``"\\n"``) and ``corpus.json`` (counts); atomic writes. Returns the JSONL."""
    directory = Path(directory)
    docs = documents()
    lines = [json.dumps({"text": "\n".join(d.paragraphs)}, ensure_ascii=False) for d in docs]
    data = "".join(line + "\n" for line in lines)
    path = directory / "corpus.jsonl"
    _write_utf8(path, data)
    by_source = {
        source: sum(d.source == source for d in docs)
        for source in (SOURCE_TOPICS, SOURCE_DOCSTRINGS)
    }
    atomic_write_json(
        directory / "corpus.json",
        {
            "documents": len(docs),
            "paragraphs": sum(len(d.paragraphs) for d in docs),
            "characters": sum(len("\n".join(d.paragraphs)) for d in docs),
            "bytes": len(data.encode("utf-8")),
            "documents_by_source": by_source,
            "python_version": sys.version.split()[0],
            "sha256": hashlib.sha256(data.encode("utf-8")).hexdigest(),
        },
    )
    return path


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


def _mrpc(pool: list[tuple[str, int]], rng: random.Random) -> tuple[list, list]:
    sizes = TASK_SIZES["MRPC"]
    total = sum(sizes)
    firsts = rng.sample(range(len(pool)), total)
    rows = []
    for n, i in enumerate(firsts):
        s1 = pool[i][0]
        if n % 2 == 0:
            label, s2 = 1, _perturb_equivalent(s1, rng)
        else:
            j = rng.randrange(len(pool) - 1)
            j += j >= i  # any other sentence
            label, s2 = 0, pool[j][0]
        rows.append((label, 100000 + 2 * n, 100001 + 2 * n, s1, s2))
    rng.shuffle(rows)
    return _split(rows, sizes)


def _stsb(pool: list[tuple[str, int]], rng: random.Random) -> tuple[list, list]:
    sizes = TASK_SIZES["STS-B"]
    total = sum(sizes)
    firsts = rng.sample(range(len(pool)), total)
    rows = []
    for n, i in enumerate(firsts):
        s1 = pool[i][0]
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
        score = round(5 * _jaccard(s1, s2), 2)
        rows.append((n, s1, s2, score))
    rng.shuffle(rows)
    return _split(rows, sizes)


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

    rng = random.Random(f"smoke-data/sst2/{seed}")
    train, dev = _sst2(pool, docs, rng)
    for name, rows in (("train", train), ("dev", dev)):
        _write_tsv(directory / "SST-2" / f"{name}.tsv", SST2_HEADER, rows)

    rng = random.Random(f"smoke-data/mrpc/{seed}")
    train, dev = _mrpc(pool, rng)
    for name, rows in (("train", train), ("dev", dev)):
        _write_tsv(directory / "MRPC" / f"{name}.tsv", MRPC_HEADER, rows)

    rng = random.Random(f"smoke-data/stsb/{seed}")
    train, dev = _stsb(pool, rng)
    for name, rows in (("train", train), ("dev", dev)):
        table = [
            (k, "smoke", "generated", "2024", n, "none", "none", s1, s2, f"{score:.2f}")
            for k, (n, s1, s2, score) in enumerate(rows)
        ]
        _write_tsv(directory / "STS-B" / f"{name}.tsv", STSB_HEADER, table)

    rng = random.Random(f"smoke-data/squad/{seed}")
    atomic_write_json(directory / "squad" / "dev-v1.1.json", _squad(docs, rng))
    return directory


# ----------------------------------------------------------------------------- CLI


def _count_rows(path: Path) -> int:
    return path.read_text(encoding="utf-8").count("\n") - 1


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.smoke_data",
        description="Write the offline smoke corpus (corpus.jsonl) and generated fine-tuning "
        "tasks (SST-2, MRPC, STS-B TSVs in GLUE's layout, squad/dev-v1.1.json) into one folder.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    args = parser.parse_args(argv)

    corpus = write_corpus(args.out)
    write_tasks(args.out, seed=args.seed)
    counts = json.loads((args.out / "corpus.json").read_text(encoding="utf-8"))
    squad = json.loads((args.out / "squad" / "dev-v1.1.json").read_text(encoding="utf-8"))
    summary = {
        "out": str(args.out),
        "corpus": str(corpus),
        "documents": counts["documents"],
        "characters": counts["characters"],
        "tasks": {
            task: {
                split: _count_rows(args.out / task / f"{split}.tsv") for split in ("train", "dev")
            }
            for task in TASK_SIZES
        },
        "squad": {
            "articles": len(squad["data"]),
            "paragraphs": sum(len(a["paragraphs"]) for a in squad["data"]),
            "questions": sum(len(p["qas"]) for a in squad["data"] for p in a["paragraphs"]),
        },
        "seed": args.seed,
        "python_version": counts["python_version"],
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
