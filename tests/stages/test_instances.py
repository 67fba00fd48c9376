"""Sequence construction rules (Google BERT's NSP pairs, RoBERTa-style packing)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_prep.instances import (
    full_sentence_chunks,
    nsp_pairs,
    rows_from_chunks,
    rows_from_pairs,
    truncate_pair,
)
from onebit_bert.shards import rows_to_features

CLS, SEP = 2, 3


def _docs(n_docs: int, seed: int = 0, max_sentences: int = 12) -> list[list[list[int]]]:
    """Token ids that say where they come from: doc d, position p -> 1000 * (d + 1) + p."""
    rng = random.Random(seed)
    docs = []
    for d in range(n_docs):
        pos, doc = 0, []
        for _ in range(rng.randint(1, max_sentences)):
            length = rng.randint(1, 30)
            doc.append([1000 * (d + 1) + pos + i for i in range(length)])
            pos += length
        docs.append(doc)
    return docs


def _where(token: int) -> tuple[int, int]:
    return token // 1000 - 1, token % 1000


def _contiguous(segment: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(segment, segment[1:], strict=False))


@pytest.mark.parametrize("seq_length", [32, 128])
def test_nsp_pair_rules(seq_length):
    docs = _docs(300)
    pairs = nsp_pairs(docs, seq_length, 0.1, 0.5, random.Random(1))
    assert pairs
    for a, b, is_random in pairs:
        assert a and b and len(a) + len(b) <= seq_length - 3
        assert _contiguous(a) and _contiguous(b)
        (doc_a, end_a), (doc_b, start_b) = _where(a[-1]), _where(b[0])
        if is_random:
            assert doc_b != doc_a, "a random next segment must come from another document"
        else:
            assert doc_b == doc_a and start_b > end_a, "B must continue A in its document"


def test_nsp_label_balance_and_coverage():
    docs = _docs(2000, max_sentences=20)
    pairs = nsp_pairs(docs, 128, 0.1, 0.5, random.Random(7))
    random_share = sum(p[2] for p in pairs) / len(pairs)
    # 50 % by the coin, plus one-sentence chunks, which can only take a random B.
    assert 0.48 < random_share < 0.62
    # Every document contributes; continuation pairs never reuse a token of A in B.
    assert {_where(a[0])[0] for a, _, _ in pairs} == set(range(len(docs)))


def test_short_sequences_appear_at_the_configured_rate():
    docs = _docs(3000, max_sentences=40)
    long_only = nsp_pairs(docs, 128, 0.0, 0.5, random.Random(3))
    some_short = nsp_pairs(docs, 128, 0.5, 0.5, random.Random(3))
    mean = lambda ps: np.mean([len(a) + len(b) for a, b, _ in ps])  # noqa: E731
    assert mean(some_short) < 0.8 * mean(long_only)


def test_truncation_trims_the_longer_segment_from_either_end():
    rng = random.Random(0)
    fronts = backs = 0
    for _ in range(200):
        a, b = list(range(100, 160)), list(range(500, 510))
        truncate_pair(a, b, 40, rng)
        assert len(a) + len(b) == 40 and b == list(range(500, 510))
        assert _contiguous(a)
        fronts += a[0] > 100
        backs += a[-1] < 159
    assert fronts > 150 and backs > 150  # both ends are trimmed (Binomial split)
    a, b = [1, 2, 3], [4, 5, 6]
    truncate_pair(a, b, 4, rng)
    assert len(a) == len(b) == 2  # the longer side shrinks first; ties trim B


def test_rows_round_trip_to_features():
    pairs = [([10, 11], [20, 21, 22], 0), ([30], [40], 1)]
    rows = rows_from_pairs(pairs, 12, CLS, SEP)
    assert rows["input_ids"][0].tolist() == [CLS, 10, 11, SEP, 20, 21, 22, SEP, 0, 0, 0, 0]
    assert rows["length"].tolist() == [8, 5] and rows["sep"].tolist() == [3, 2]
    features = rows_to_features(rows)
    assert features["token_type_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert features["attention_mask"][1].tolist() == [1] * 5 + [0] * 7
    assert features["next_sentence_label"].tolist() == [0, 1]


def test_full_sentence_packing():
    docs = _docs(50)
    chunks = full_sentence_chunks(docs, 64, SEP)
    assert all(0 < len(c) <= 62 for c in chunks)
    assert all(c[0] != SEP and c[-1] != SEP for c in chunks)
    tokens = [t for c in chunks for t in c if t != SEP]
    assert tokens == [t for d in docs for s in d for t in s], "packing loses or reorders tokens"
    rows = rows_from_chunks(chunks, 64, CLS, SEP)
    features = rows_to_features(rows)
    assert np.all(features["token_type_ids"] == 0)
    assert np.all(features["next_sentence_label"] == -100)
    assert np.all(rows["input_ids"][np.arange(len(rows)), rows["length"] - 1] == SEP)


def test_long_sentences_are_cut_to_fit():
    chunks = full_sentence_chunks([[list(range(100, 250))]], 64, SEP)
    assert [len(c) for c in chunks] == [62, 62, 26]


class _Recording(list):
    """A list that records slicing and deletion (to check the work done on it)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.slices = 0
        self.deletions = 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            self.slices += 1
        return super().__getitem__(key)

    def __delitem__(self, key):
        self.deletions += 1
        super().__delitem__(key)


def _truncate_reference(a, b, max_tokens, rng):
    """The former implementation: cuts the lists on every round."""
    while len(a) + len(b) > max_tokens:
        longer, shorter = (a, b) if len(a) > len(b) else (b, a)
        k = min(len(a) + len(b) - max_tokens, max(1, len(longer) - len(shorter)))
        front = rng.getrandbits(k).bit_count()
        del longer[:front]
        if k > front:
            del longer[len(longer) - (k - front) :]


def test_truncation_cuts_each_list_at_most_twice_and_matches_the_reference():
    rng = random.Random(3)
    for _ in range(300):
        la, lb, limit = rng.randint(0, 400), rng.randint(0, 400), rng.randint(1, 300)
        a, b = list(range(la)), list(range(1000, 1000 + lb))
        ra, rb = list(a), list(b)
        seed = rng.random()
        truncate_pair(a, b, limit, random.Random(seed))
        _truncate_reference(ra, rb, limit, random.Random(seed))
        assert (a, b) == (ra, rb)
    # Two equally long segments are trimmed one token per round: the former implementation
    # deleted from a list on each of the 20,000 rounds (quadratic), now each is cut once.
    a, b = _Recording(range(10_000)), _Recording(range(10_000))
    truncate_pair(a, b, 125, random.Random(0))
    assert len(a) + len(b) == 125
    assert a.deletions <= 2 and b.deletions <= 2


def test_random_next_segments_do_not_copy_the_other_document():
    # One long document of many sentences: drawing a random segment from it must not copy
    # its remaining sentences (document[start:]) for every pair.
    big = _Recording([[10_000 + 10 * s + i for i in range(10)] for s in range(5000)])
    docs = [_docs(1)[0], big]
    pairs = nsp_pairs(docs, 64, 0.0, 1.0, random.Random(0))
    assert pairs
    assert big.slices == 0
    for a, b, _ in pairs:
        assert len(a) + len(b) <= 61
