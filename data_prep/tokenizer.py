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
from collections.abc import Iterator
from pathlib import Path

from data_prep.config import DataPrepConfig

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
UINT16_LIMIT = 65536


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
        trainer = BertWordPieceTokenizer(lowercase=tcfg.lowercase)
        trainer.train_from_iterator(
            texts, vocab_size=tcfg.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False
        )
        # Training picks the same tokens every time but numbers them differently from run
        # to run; a canonical order makes the ids (and so the shards) reproducible.
        learned = sorted(t for t in trainer.get_vocab() if t not in SPECIAL_TOKENS)
        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + learned)}
        wordpiece = BertWordPieceTokenizer(vocab, lowercase=tcfg.lowercase)
        tok = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=tcfg.lowercase)
    check_tokenizer(tok)
    return tok


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
