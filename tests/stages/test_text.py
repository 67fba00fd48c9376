"""Paragraph cleaning and rule-based sentence splitting (data_prep.text)."""

from __future__ import annotations

import gzip
import random
import re
from pathlib import Path

import pytest

from data_prep.text import document_sentences, split_paragraphs, split_sentences
from tests.helpers.paths import SHARED_DATA


def _no_loss(paragraph: str, sentences: list[str]) -> bool:
    return " ".join(sentences) == " ".join(paragraph.split())


# ---------------------------------------------------------------------------------------------
# Sentence boundaries


@pytest.mark.parametrize(
    "text,expected",
    [
        ("It rained. We stayed in.", ["It rained.", "We stayed in."]),
        ("Did it rain? Yes! We stayed in.", ["Did it rain?", "Yes!", "We stayed in."]),
        ("Really?! Yes.", ["Really?!", "Yes."]),
        ("It happened in 1990. 1991 was quiet.", ["It happened in 1990.", "1991 was quiet."]),
        ('He left. "Why?" she asked.', ["He left.", '"Why?" she asked.']),
        ("He left. (Nobody knew why.) Then", ["He left.", "(Nobody knew why.)", "Then"]),
        ("He left. [Citation needed] Then", ["He left.", "[Citation needed] Then"]),
        ("He left. ‘Why?’ she asked.", ["He left.", "‘Why?’ she asked."]),
        ("Éclairs. Österreich is big.", ["Éclairs.", "Österreich is big."]),
        ("No space.Here stays one.", ["No space.Here stays one."]),
        ("Trailing punctuation...", ["Trailing punctuation..."]),
    ],
)
def test_basic_boundaries(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ('"Stop!" She ran.', ['"Stop!"', "She ran."]),
        ('He said, "Go home." Then he left.', ['He said, "Go home."', "Then he left."]),
        ("He said “no.” Then left.", ["He said “no.”", "Then left."]),
        ("It was 'odd.' Then it stopped.", ["It was 'odd.'", "Then it stopped."]),
        ("(See the note.) Next one.", ["(See the note.)", "Next one."]),
        ('"Stop!" "Why?" "Because."', ['"Stop!"', '"Why?"', '"Because."']),
        # A closing quote followed by a lowercase word continues the sentence.
        ('"Why?" he asked. "Because!" she said.', ['"Why?" he asked.', '"Because!" she said.']),
    ],
)
def test_closing_quotes_and_brackets_stay_with_their_sentence(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "This is the end. and so it goes on.",
        "Who knows? maybe not.",
        "Stop! said the man.",
        "Use the API. iPhone sales rose.",  # lowercase first letter: no split, by design
        "It rained. — Then it stopped.",  # a dash is not a sentence opener
    ],
)
def test_no_split_before_lowercase_or_other_characters(text):
    assert split_sentences(text) == [text]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("Wait... Then it came.", ["Wait...", "Then it came."]),
        ("Well… Maybe.", ["Well…", "Maybe."]),
        ("Wait... and then it came.", ["Wait... and then it came."]),
        ("It cost... 5 dollars.", ["It cost... 5 dollars."]),
        ('He said... "nothing".', ['He said... "nothing".']),
        ("The end . . . And after.", ["The end . . .", "And after."]),
    ],
)
def test_ellipsis_ends_a_sentence_only_before_a_capital(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize(
    "abbrev,after",
    [
        ("Mr.", "Smith"),
        ("Mrs.", "Smith"),
        ("Ms.", "Smith"),
        ("Dr.", "Jones"),
        ("Prof.", "Jones"),
        ("Sr.", "Jones"),
        ("Jr.", "He"),
        ("St.", "Louis"),
        ("Mt.", "Everest"),
        ("Ft.", "Worth"),
        ("Gen.", "Lee"),
        ("Col.", "Mustard"),
        ("Lt.", "Dan"),
        ("Sgt.", "Pepper"),
        ("Capt.", "Cook"),
        ("Rev.", "Green"),
        ("Gov.", "Brown"),
        ("Sen.", "Warren"),
        ("Rep.", "Lewis"),
        ("vs.", "Brazil"),
        ("etc.", "The"),
        ("cf.", "Smith"),
        ("et al.", "The"),
        ("Apple Inc.", "The"),
        ("Acme Ltd.", "The"),
        ("Acme Co.", "The"),
        ("Acme Corp.", "The"),
        ("Jan.", "5"),
        ("Feb.", "5"),
        ("Mar.", "5"),
        ("Apr.", "5"),
        ("Jun.", "5"),
        ("Jul.", "5"),
        ("Aug.", "5"),
        ("Sep.", "5"),
        ("Sept.", "11"),
        ("Oct.", "5"),
        ("Nov.", "5"),
        ("Dec.", "5"),
        ("No.", "5"),
        ("Nos.", "5"),
        ("Vol.", "3"),
        ("Fig.", "2"),
        ("pp.", "12"),
        ("ca.", "1500"),
        ("approx.", "40"),
        ("dept.", "Head"),
        ("est.", "1990"),
        ("MR.", "SMITH"),  # case-insensitive for the unambiguous ones
        ("(Dr.", "Who)"),
        ("the U.S.", "Army"),
        ("the U.K.", "Government"),
        ("the U.S.A.", "Today"),
        ("e.g.", "Paris"),
        ("i.e.", "London"),
        ("a Ph.D.", "Thesis"),
        ("anti-U.S.", "Protests"),
    ],
)
def test_no_split_after_abbreviations(abbrev, after):
    text = f"We met {abbrev} {after} later on. Next sentence."
    assert split_sentences(text) == [f"We met {abbrev} {after} later on.", "Next sentence."]


@pytest.mark.parametrize("word", ["no", "fig", "mar", "gen", "rep", "sen"])
def test_lowercase_words_that_look_like_cased_abbreviations_do_split(word):
    assert split_sentences(f"I said {word}. Then I left.") == [f"I said {word}.", "Then I left."]


@pytest.mark.parametrize(
    "text",
    [
        "J. R. R. Tolkien wrote it.",
        "George W. Bush spoke.",
        "Roe v. Wade was decided.",
        "She was born (b. 1950) in Ohio.",
        "It was built c. 1500 in Rome.",
        "I. M. Pei designed it.",
        "Plan B. Smith proposed it.",  # an initial is indistinguishable from a letter name
    ],
)
def test_no_split_after_initials(text):
    assert split_sentences(text) == [text]


def test_roman_numeral_one_is_not_an_initial():
    assert split_sentences("He fought in World War I. The war ended.") == [
        "He fought in World War I.",
        "The war ended.",
    ]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("It rose 3.5 percent. Then it fell.", ["It rose 3.5 percent.", "Then it fell."]),
        ("Version v1.2 shipped. It broke.", ["Version v1.2 shipped.", "It broke."]),
        ("Pi is 3.14159 roughly.", ["Pi is 3.14159 roughly."]),
        ("See www.example.com. It is new.", ["See www.example.com.", "It is new."]),
        ("1. Introduction to the topic.", ["1. Introduction to the topic."]),
        ("See section 2. The rest follows.", ["See section 2.", "The rest follows."]),
    ],
)
def test_numbers_and_decimals(text, expected):
    assert split_sentences(text) == expected


def test_split_sentences_normalises_whitespace_and_strips():
    text = "  First one.\n\tSecond\xa0one!   Third  "
    assert split_sentences(text) == ["First one.", "Second one!", "Third"]


@pytest.mark.parametrize("text", ["", " ", "\n\t \xa0"])
def test_empty_input(text):
    assert split_sentences(text) == []
    assert split_paragraphs(text) == []
    assert document_sentences(text) == []


def test_no_loss_on_random_text():
    pieces = list("aAzZ0 .!?…\"'”’“‘()[]\t\n\xa0") + [" Mr", " U.S.", " e.g.", " J.", "..."]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(40)))
        sentences = split_sentences(text)
        assert _no_loss(text, sentences), repr(text)
        assert all(s and s == s.strip() for s in sentences), repr(text)
        for para in split_paragraphs(text):
            assert " ".join(split_sentences(para)) == para


# ---------------------------------------------------------------------------------------------
# Paragraphs and cleaning


def test_blank_lines_separate_paragraphs():
    text = "One.\n\nTwo.\n \t \n\n\nThree.\r\n\r\nFour."
    assert split_paragraphs(text) == ["One.", "Two.", "Three.", "Four."]


def test_gutenberg_wrapped_paragraphs_are_joined():
    text = (
        "CHAPTER I\n\n\n"
        "The ferry left the harbour at dawn, and the gulls followed it past\n"
        "the lighthouse.  Mrs. Hale, wrapped in a grey shawl, watched the\n"
        "town grow small behind them.\n"
        "\n"
        "Nobody on deck said a word until noon.\n"
    )
    assert split_paragraphs(text) == [
        "CHAPTER I",
        "The ferry left the harbour at dawn, and the gulls followed it past the lighthouse. "
        "Mrs. Hale, wrapped in a grey shawl, watched the town grow small behind them.",
        "Nobody on deck said a word until noon.",
    ]
    assert document_sentences(text) == [
        "CHAPTER I",
        "The ferry left the harbour at dawn, and the gulls followed it past the lighthouse.",
        "Mrs. Hale, wrapped in a grey shawl, watched the town grow small behind them.",
        "Nobody on deck said a word until noon.",
    ]


def test_whitespace_and_control_characters_are_cleaned():
    text = "\ufeffA\tb\xa0\u2009c\u3000d  e\x00f\x07g\ufffdh\u200bi\u200cj\u200dk\x7fl\x9bm\r\nn"
    assert split_paragraphs(text) == ["A b c d efghijklm n"]


def test_whitespace_controls_separate_words():
    # Form feed, vertical tab, the ASCII separators and NEL are whitespace, not junk.
    assert split_paragraphs("a\fb\vc\x1cd\x1fe\x85f") == ["a b c d e f"]


def test_lines_with_only_junk_count_as_blank():
    assert split_paragraphs("One.\n\u200b\ufeff \x00\nTwo.") == ["One.", "Two."]


def test_document_sentences_flattens_paragraphs():
    text = "Mr. Smith came. He sat.\n\n\n  Dr. Jones left!  Why?\n"
    assert document_sentences(text) == ["Mr. Smith came.", "He sat.", "Dr. Jones left!", "Why?"]


# ---------------------------------------------------------------------------------------------
# Real data (skipped where the shared data folder is absent)

_PROTECTED_ENDINGS = (" Mr.", " Mrs.", " Dr.", " Prof.", " St.", " U.S.", " e.g.", " i.e.")
_JUNK_OR_SPACE = re.compile(r"[\s\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\u200b-\u200d\ufeff\ufffd]")


def _shared_file(relative: str) -> Path:
    path = SHARED_DATA / relative
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path


def _read_head(path: Path, chars: int = 2_000_000) -> str:
    with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read(chars)


def _check_real_text(text: str) -> None:
    paragraphs = split_paragraphs(text)
    sentences = [s for p in paragraphs for s in split_sentences(p)]
    assert sentences == document_sentences(text)
    assert len(sentences) > 1000
    for para in paragraphs:
        assert " ".join(split_sentences(para)) == para
    # Cleaning drops only whitespace and junk characters.
    assert "".join(p.replace(" ", "") for p in paragraphs) == _JUNK_OR_SPACE.sub("", text)

    mean_chars = sum(map(len, sentences)) / len(sentences)
    assert 40 <= mean_chars <= 250
    after_abbrev = sum(s.endswith(_PROTECTED_ENDINGS) for s in sentences)
    assert after_abbrev < 0.01 * len(sentences)
    lowercase_start = sum(s[0].islower() for s in sentences)
    assert lowercase_start < 0.02 * len(sentences)


def test_real_wikipedia_sample():
    path = _shared_file("enwiki_wikiextractor_sample/enwiki_wikiextractor_AA_00-63.txt.gz")
    raw = _read_head(path)
    # WikiExtractor: "<doc ...>", the title, then one paragraph per line, then "</doc>".
    docs = re.findall(r"^<doc [^>]*>\n(.*?)^</doc>$", raw, flags=re.S | re.M)
    assert docs
    text = "\n\n".join("\n\n".join(doc.split("\n")[1:]) for doc in docs)
    _check_real_text(text)


def test_real_gutenberg_book():
    _check_real_text(_read_head(_shared_file("gutenberg_nltk/austen-emma.txt.gz")))


def test_giant_sentences_are_cut_into_bounded_pieces():
    from data_prep.text import MAX_SENTENCE_CHARS

    words = " ".join(f"Word{i % 97}" for i in range(60_000))  # no sentence punctuation
    sentences = document_sentences(f"Start here. {words}. End.")
    assert sentences[0] == "Start here." and sentences[-1] == "End."
    assert max(map(len, sentences)) <= MAX_SENTENCE_CHARS
    assert len(sentences) >= 2 + len(words) // MAX_SENTENCE_CHARS
    assert " ".join(sentences) == f"Start here. {words}. End."  # cut at spaces only
    blob = "x" * (2 * MAX_SENTENCE_CHARS + 5)  # no space at all: cut at the limit
    assert [len(s) for s in split_sentences(blob)] == [MAX_SENTENCE_CHARS] * 2 + [5]
