"""Text cleaning and sentence segmentation for BERT pretraining data.

Google's BERT input format is documents made of sentences, so raw text is cut into paragraphs and
then sentences, with rules rather than a model:

- Paragraphs are separated by blank lines; wrapped lines inside one are joined. Control characters
  (tab, newline and the other whitespace controls become spaces), U+FFFD and zero-width characters
  are dropped, and every run of whitespace becomes a single space.
- A sentence ends at `.`, `!` or `?` (or a run such as `?!`), plus any closing quotes or brackets,
  when a space follows and then an uppercase letter, a digit or an opening quote/bracket. An
  ellipsis (`...` or `…`) ends a sentence only before an uppercase letter.
- A lone `.` does not end a sentence after a known abbreviation (Mr, Dr, etc, Jan, No, ...), a
  single-letter initial (J. R. R. Tolkien, Roe v. Wade), or a dotted acronym (U.S., e.g., Ph.D.).
- A "sentence" longer than `MAX_SENTENCE_CHARS` (a line without sentence punctuation, a table, a
  dump) is cut at the last space before the limit, or at the limit when a piece has no space, so
  that later steps handle pieces of bounded size.
- Nothing is lost: " ".join(split_sentences(p)) == " ".join(p.split()) (except that a piece cut
  at the limit inside a word becomes two words).
"""

# Throughput of document_sentences: ~30 MB/s of UTF-8 text per core (20-35 MB/s over a dozen runs on
# a busy 2-core VM, Python 3.11.7) on the 66 MB English Wikipedia WikiExtractor sample, with one
# paragraph per line and the <doc> lines dropped. Measured with (drop the "# " and paste):
# .venv/bin/python -c "import gzip, time; from data_prep.text import document_sentences;
# f = '/work/shared/data/enwiki_wikiextractor_sample/enwiki_wikiextractor_AA_00-63.txt.gz';
# t = '\n\n'.join(x for x in gzip.open(f, 'rt').read().split('\n') if not x.startswith('<'));
# s = time.perf_counter(); document_sentences(t); s = time.perf_counter() - s;
# print(round(len(t.encode()) / 1e6 / s, 1), 'MB/s')"

from __future__ import annotations

import re

__all__ = ["MAX_SENTENCE_CHARS", "document_sentences", "split_paragraphs", "split_sentences"]

MAX_SENTENCE_CHARS = 10_000
"""Longest sentence kept whole (about 2,000 words, far beyond a 512-token sequence); longer
ones are cut into pieces of at most this many characters."""

# Controls that str.split() already treats as whitespace (\t \n \v \f \r \x1c-\x1f \x85) are
# kept here so that they separate words instead of gluing them together.
_JUNK_CHARS = r"\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\u200b-\u200d\ufeff\ufffd"
_JUNK = re.compile(f"[{_JUNK_CHARS}]")
# Junk counts as blank so that it can be dropped per paragraph, and only where there is any.
_BLANK_LINE = re.compile(rf"\n[\s{_JUNK_CHARS}]*\n")

_OPENERS = "\"'“‘(["
# The lookahead keeps the Python-side check to plausible boundaries only: text is normalised to
# single spaces, and a lowercase ASCII letter after the space never starts a sentence.
# (Starting with a single character class, rather than a group or `+`, lets the regex engine
# skip ahead with its fast prefix scan: 2x faster on Wikipedia.)
_CANDIDATE = re.compile(r"[.!?…][.!?…]*[\"'”’)\]]* (?=[^a-z])")
_CLOSERS = " \"'”’)]"
# The word a period ends, without any leading quote, bracket, dash or slash: "(Mr", "non-U.S".
_WORD = re.compile(r"[\w.'’]*\Z")
# Dotted acronyms such as U.S, U.S.A, e.g, i.e, Ph.D, a.m (the final period is the candidate).
_DOTTED = re.compile(r"(?:[^\W\d_]{1,2}\.)+[^\W\d_]{1,2}")
_INITIAL = re.compile(r"[A-Z]\. ")

# Compared case-insensitively: none of these is an ordinary lowercase English word. (A word list
# reads better than 60 quoted items, hence the noqa.)
_ABBREV = frozenset(
    """mr mrs ms messrs mme mlle dr fr prof sr jr st mt ft hon esq rd ave blvd bros vs etc cf al viz
    eg ie inc ltd co corp plc llc dept est approx ca lt sgt capt cmdr maj adm gov pres supt
    jan feb apr jun jul aug sep sept oct nov dec vol vols pp ch chap nr""".split()  # noqa: SIM905
)
# Compared as written, because the lowercase form is a common word ("I said no. Then ...").
_ABBREV_CASED = frozenset(
    ("No", "Nos", "Mar", "Fig", "Figs", "Gen", "Col", "Rev", "Rep", "Sen", "ed", "eds")
)


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, cleaned, with whitespace runs collapsed to one space."""
    return [para for block in _BLANK_LINE.split(text) if (para := _clean(block))]


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph; joined by single spaces they give the normalised paragraph."""
    return _split_normalised(" ".join(paragraph.split()))


def document_sentences(text: str) -> list[str]:
    """All sentences of a document, paragraph after paragraph."""
    return [sent for para in split_paragraphs(text) for sent in _split_normalised(para)]


def _clean(text: str) -> str:
    # Most paragraphs are already clean, and checking that is 3x cheaper than rebuilding them:
    # isprintable() is false for controls, zero-width characters and all whitespace but " ".
    clean = text.isprintable() and "\ufffd" not in text and "  " not in text
    if clean and text[:1] != " " and text[-1:] != " ":
        return text
    return " ".join(_JUNK.sub("", text).split())


def _split_normalised(text: str) -> list[str]:
    # `text` has no leading/trailing whitespace and single spaces only, so each boundary is
    # exactly one space and every piece is non-empty and already stripped.
    if not text:
        return []
    sentences: list[str] = []
    start = 0
    for m in _CANDIDATE.finditer(text):
        if _is_boundary(text, m):
            _append_bounded(sentences, text, start, m.end() - 1)
            start = m.end()
    _append_bounded(sentences, text, start, len(text))
    return sentences


def _append_bounded(out: list[str], text: str, start: int, end: int) -> None:
    """Append ``text[start:end]``, cut into pieces of at most ``MAX_SENTENCE_CHARS``."""
    while end - start > MAX_SENTENCE_CHARS:
        limit = start + MAX_SENTENCE_CHARS
        cut = text.rfind(" ", start + 1, limit + 1)
        if cut == -1:
            out.append(text[start:limit])
            start = limit
        else:
            out.append(text[start:cut])
            start = cut + 1
    out.append(text[start:end])


def _is_boundary(text: str, m: re.Match[str]) -> bool:
    nxt = text[m.end()]
    upper = nxt.isupper()
    if not (upper or nxt.isdigit() or nxt in _OPENERS):
        return False
    punct = m.group().rstrip(_CLOSERS)
    if punct != ".":
        # "?!" style runs end a sentence; runs of dots are an ellipsis, which often trails off
        # mid-sentence, so it needs the stronger evidence of a capital.
        return upper or "!" in punct or "?" in punct
    dot = m.start()
    start = text.rfind(" ", 0, dot) + 1
    word = text[start:dot]
    if not word.isalnum():
        word = _WORD.search(word).group().lstrip("'’")
    if not word:
        # A spaced ellipsis (". . . And") or a stray period: treat like "...".
        return upper
    if start == 0 and word.isdigit():
        return False  # "1. Introduction": a list number heading the paragraph
    if len(word) == 1:
        if not word.isalpha():
            return True
        # "I" is far more often the pronoun or a numeral ("World War I.") than an initial, unless
        # more initials follow ("I. M. Pei").
        return word == "I" and _INITIAL.match(text, m.end()) is None
    if word.lower() in _ABBREV or word in _ABBREV_CASED:
        return False
    return "." not in word or _DOTTED.fullmatch(word) is None
