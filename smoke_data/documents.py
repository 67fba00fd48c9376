"""The smoke corpus: CPython's language-reference topics and standard-library docstrings,
cleaned into English paragraphs (see the package docstring for what is kept and why)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from onebit_bert.io import atomic_write_bytes, atomic_write_json

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
    "from smoke_data.documents import _candidate_documents\n"
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
