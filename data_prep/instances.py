"""Training sequences from tokenized documents, with Google BERT's semantics.

A document is a list of sentences, each a list of token ids (no special tokens).

``nsp`` mode (``create_pretraining_data.py``): sentences are gathered until a target
length (``seq_length - 3``, or with probability ``short_seq_prob`` a random shorter one);
(drawn once per document, as Google does); the chunk is cut at a random sentence into A
and B; with probability ``random_next_prob``
(always, for a one-sentence chunk) B is replaced by text from another document, label 1,
and the unused sentences are put back; the longer segment is truncated, one token at a
time from a random end, until the pair fits. A sentence longer than a whole pair is first
cut into half-pair pieces (Google's code would keep about one pair's worth of it).

``full_sentences`` mode (RoBERTa's): consecutive sentences are packed up to
``seq_length - 2`` tokens, across documents (a ``[SEP]`` marks each document boundary);
longer sentences are cut; no next-sentence label.
"""

from __future__ import annotations

import random
from itertools import chain

import numpy as np

from onebit_bert.shards import row_dtype

Document = list[list[int]]


def nsp_pairs(
    docs: list[Document],
    seq_length: int,
    short_seq_prob: float,
    random_next_prob: float,
    rng: random.Random,
) -> list[tuple[list[int], list[int], int]]:
    """(A, B, is_random_next) pairs from every document, in document order. Sentences
    longer than a pair can hold are cut first (:func:`cut_long_sentences`)."""
    docs = cut_long_sentences(docs, seq_length - 3)
    pairs = []
    for index in range(len(docs)):
        pairs.extend(
            _document_pairs(docs, index, seq_length, short_seq_prob, random_next_prob, rng)
        )
    return pairs


def cut_long_sentences(docs: list[Document], max_tokens: int) -> list[Document]:
    """``docs`` with every sentence longer than ``max_tokens`` (the tokens of one pair) cut
    into consecutive pieces of ``ceil(max_tokens / 2)`` tokens; documents without one are
    the same objects, so ordinary text gives the same pairs as before.

    Without the cut, a sentence longer than a whole pair becomes a one-sentence chunk: its
    B is drawn from another document and the pair is truncated to ``max_tokens``, so a
    20 MB line without sentence punctuation (cut into 10,000-character "sentences" of
    about 2,000 tokens by the text step) kept 1.25 % of its tokens, every pair a random
    next. Half-pair pieces make two consecutive pieces one chunk (A and its true B, at
    most one token truncated), so almost every token is used."""
    piece = max(1, -(-max_tokens // 2))
    out: list[Document] = []
    for document in docs:
        if all(len(sentence) <= max_tokens for sentence in document):
            out.append(document)
            continue
        cut: Document = []
        for sentence in document:
            if len(sentence) <= max_tokens:
                cut.append(sentence)
            else:
                cut.extend(sentence[i : i + piece] for i in range(0, len(sentence), piece))
        out.append(cut)
    return out


def _document_pairs(docs, index, seq_length, short_seq_prob, random_next_prob, rng):
    document = docs[index]
    max_tokens = seq_length - 3  # [CLS] A [SEP] B [SEP]
    target = max_tokens
    if rng.random() < short_seq_prob:
        target = rng.randint(2, max_tokens)
    pairs = []
    chunk: list[list[int]] = []
    chunk_len = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_len += len(document[i])
        if i == len(document) - 1 or chunk_len >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a = list(chain.from_iterable(chunk[:a_end]))
            if len(chunk) == 1 or rng.random() < random_next_prob:
                is_random = 1
                b = _random_segment(docs, index, target - len(a), rng)
                i -= len(chunk) - a_end  # those sentences start the next chunk
            else:
                is_random = 0
                b = list(chain.from_iterable(chunk[a_end:]))
            truncate_pair(a, b, max_tokens, rng)
            if a and b:
                pairs.append((a, b, is_random))
            chunk, chunk_len = [], 0
        i += 1
    return pairs


def _random_segment(docs, index, target, rng) -> list[int]:
    if len(docs) > 1:
        other = rng.randrange(len(docs) - 1)
        other += other >= index
    else:  # a unit of one document: nothing else to draw from
        other = index
    document = docs[other]
    segment: list[int] = []
    # Indices rather than ``document[start:]``: a slice would copy the rest of the document
    # for every random pair (quadratic in the document's sentence count).
    for j in range(rng.randrange(len(document)), len(document)):
        segment.extend(document[j])
        if len(segment) >= target:
            break
    return segment


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer of ``a``/``b`` until ``len(a) + len(b) <= max_tokens``, each token
    from the front or the back at random (as Google's one-at-a-time loop, in batches).

    The loop only counts the tokens to drop from each end; the lists are cut once at the
    end, so the cost is linear in the excess whatever the segment lengths."""
    len_a, len_b = len(a), len(b)
    cut = [0, 0, 0, 0]  # a front, a back, b front, b back
    while len_a + len_b > max_tokens:
        a_longer = len_a > len_b
        longer, shorter = (len_a, len_b) if a_longer else (len_b, len_a)
        k = min(len_a + len_b - max_tokens, max(1, longer - shorter))
        front = rng.getrandbits(k).bit_count()  # Binomial(k, 1/2) front removals
        side = 0 if a_longer else 2
        cut[side] += front
        cut[side + 1] += k - front
        if a_longer:
            len_a -= k
        else:
            len_b -= k
    for segment, front, back in ((a, cut[0], cut[1]), (b, cut[2], cut[3])):
        if back:
            del segment[len(segment) - back :]
        if front:
            del segment[:front]


def full_sentence_chunks(docs: list[Document], seq_length: int, sep_id: int) -> list[list[int]]:
    """Token runs of at most ``seq_length - 2`` from consecutive sentences across documents."""
    budget = seq_length - 2
    chunks: list[list[int]] = []
    current: list[int] = []
    for document in docs:
        boundary = bool(current)  # a [SEP] goes before this document if it shares a row
        for sentence in document:
            for start in range(0, len(sentence), budget):
                piece = sentence[start : start + budget]
                if current and len(current) + boundary + len(piece) > budget:
                    chunks.append(current)
                    current, boundary = [], False
                if boundary:
                    current.append(sep_id)
                    boundary = False
                current.extend(piece)
    if current:
        chunks.append(current)
    return chunks


def rows_from_pairs(
    pairs: list[tuple[list[int], list[int], int]], seq_length: int, cls_id: int, sep_id: int
) -> np.ndarray:
    """Shard rows ``[CLS] A [SEP] B [SEP]`` (see :mod:`onebit_bert.shards`)."""
    sequences = [[cls_id, *a, sep_id, *b, sep_id] for a, b, _ in pairs]  # C-level copies
    rows = _rows(sequences, seq_length)
    rows["sep"] = [len(a) + 1 for a, _, _ in pairs]
    rows["nsp"] = [label for _, _, label in pairs]
    return rows


def rows_from_chunks(chunks: list[list[int]], seq_length: int, cls_id: int, sep_id: int):
    """Shard rows ``[CLS] chunk [SEP]`` with no next-sentence label."""
    rows = _rows([[cls_id, *c, sep_id] for c in chunks], seq_length)
    rows["sep"] = rows["length"] - 1
    rows["nsp"] = -1
    return rows


def _rows(sequences: list[list[int]], seq_length: int) -> np.ndarray:
    rows = np.zeros(len(sequences), dtype=row_dtype(seq_length))
    if not sequences:
        return rows
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    if lengths.max() > seq_length:
        raise AssertionError("a sequence exceeds seq_length")  # a bug, not user input
    flat = np.fromiter(chain.from_iterable(sequences), dtype=np.uint16, count=lengths.sum())
    row_index = np.repeat(np.arange(len(sequences)), lengths)
    col_index = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows["input_ids"][row_index, col_index] = flat
    rows["length"] = lengths
    return rows
