"""The WordPiece tokenizer: from a vocab file, from the hub, or trained on the corpus.

Whatever its origin it is saved once in Hugging Face format under ``<output>/tokenizer``
(``AutoTokenizer.from_pretrained`` loads it), and the workers load the Rust tokenizer from
that directory's ``tokenizer.json``, so pretraining and fine-tuning see exactly the
tokenizer the shards were made with.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from data_prep.config import DataPrepConfig

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
UINT16_LIMIT = 65536
ALPHABET_SIZE = 1000
"""Characters a trained vocabulary keeps as its alphabet (the ``tokenizers`` default)."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be used for the shards; the message says why and the fix."""


def build_tokenizer(cfg: DataPrepConfig, texts: Iterator[str] | None = None):
    """The configured tokenizer as a transformers fast tokenizer (not saved yet).

    ``texts`` feeds vocabulary training when ``tokenizer.train`` is set.
    """
    from tokenizers import BertWordPieceTokenizer
    from transformers import AutoTokenizer, BertTokenizerFast

    tcfg = cfg.tokenizer
    if tcfg.vocab_file:
        path = cfg.resolve(tcfg.vocab_file)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise TokenizerError(f"tokenizer.vocab_file {path} is missing or empty")
        wordpiece = BertWordPieceTokenizer(path, lowercase=tcfg.lowercase)
        tok = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=tcfg.lowercase)
    elif tcfg.hub_name:
        try:
            tok = AutoTokenizer.from_pretrained(tcfg.hub_name)
        except Exception as err:
            raise TokenizerError(
                f"cannot load tokenizer {tcfg.hub_name!r} from the hub ({type(err).__name__}); "
                f"without network access set tokenizer.vocab_file to a local vocab.txt"
            ) from None
    else:
        if texts is None:
            raise TokenizerError("tokenizer.train needs corpus text")
        vocab = train_vocabulary(list(texts), tcfg.vocab_size, tcfg.lowercase)
        wordpiece = BertWordPieceTokenizer(vocab, lowercase=tcfg.lowercase)
        tok = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=tcfg.lowercase)
    check_tokenizer(tok)
    return tok


def train_vocabulary(texts: list[str], vocab_size: int, lowercase: bool) -> dict[str, int]:
    """A WordPiece vocabulary of ``vocab_size`` tokens trained on ``texts``, the same in every
    run: special tokens first, then the learned tokens in code-point order.

    ``tokenizers`` trains by BPE and breaks ties between equally frequent choices by hash-map
    order, which changes from process to process (huggingface/tokenizers#1794): which rare
    characters make the alphabet, and which of two equally frequent merges comes first when
    the continuation pieces (``##x``) they involve were numbered in that order. Two runs on
    the same text then learn different vocabularies. Here the alphabet is chosen beforehand
    (``training_alphabet``), and a first, merge-free pass finds the continuation pieces, which
    the real pass receives up front in a fixed order, so every tie is broken the same way.
    """
    from tokenizers import BertWordPieceTokenizer

    alphabet = training_alphabet(
        BertWordPieceTokenizer(lowercase=lowercase)._tokenizer.normalizer, texts, ALPHABET_SIZE
    )
    common = dict(initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    pieces = BertWordPieceTokenizer(lowercase=lowercase)
    pieces.train_from_iterator(texts, vocab_size=1, special_tokens=SPECIAL_TOKENS, **common)
    continuations = sorted(t for t in pieces.get_vocab() if t.startswith("##"))
    trainer = BertWordPieceTokenizer(lowercase=lowercase)
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + continuations, **common
    )
    learned = sorted(t for t in trainer.get_vocab() if t not in SPECIAL_TOKENS)
    return {t: i for i, t in enumerate(SPECIAL_TOKENS + learned)}


def training_alphabet(normalizer, texts: list[str], limit: int) -> list[str]:
    """The ``limit`` most frequent characters of the normalised ``texts`` (whitespace aside),
    ties broken by code point: the alphabet ``train_vocabulary`` hands the trainer, with no
    room for any other character."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(normalizer.normalize_str(text))
    chars = sorted((c for c in counts if not c.isspace()), key=lambda c: (-counts[c], c))
    return chars[:limit]


def check_tokenizer(tok) -> None:
    """The shards store uint16 ids padded with id 0 and need BERT's special tokens."""
    if len(tok) > UINT16_LIMIT:
        raise TokenizerError(
            f"the vocabulary has {len(tok)} tokens; shards store uint16 ids (at most "
            f"{UINT16_LIMIT}): use a smaller vocabulary"
        )
    for name in ("cls_token_id", "sep_token_id", "mask_token_id", "pad_token_id"):
        if getattr(tok, name) is None:
            raise TokenizerError(f"the tokenizer has no {name.removesuffix('_id')}; BERT needs it")
    if tok.pad_token_id != 0:
        raise TokenizerError(
            f"[PAD] must have id 0 (shards are zero-padded), got {tok.pad_token_id}"
        )


def save_tokenizer(tok, directory: str | Path) -> str:
    """Save in HF format (atomically as a directory) and return its hash."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tok.save_pretrained(tmp)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return tokenizer_hash(directory)


def tokenizer_hash(directory: str | Path) -> str:
    """sha256 of the tokenizer's definition (vocabulary, normaliser, special tokens)."""
    return hashlib.sha256((Path(directory) / "tokenizer.json").read_bytes()).hexdigest()


def load_backend(directory: str | Path):
    """The Rust tokenizer of a saved tokenizer directory, without special-token templates."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok
