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

Run ``python -m smoke_data --out DIR`` to write ``DIR/corpus.jsonl`` (+
``corpus.json``), ``DIR/{SST-2,MRPC,STS-B}/{train,dev}.tsv`` and ``DIR/squad/dev-v1.1.json``;
it prints a one-line JSON summary.
"""

from smoke_data.documents import (
    SOURCE_DOCSTRINGS,
    SOURCE_TOPICS,
    STDLIB_MODULES,
    Document,
    clean_text,
    documents,
    smoke_documents,
    write_corpus,
)
from smoke_data.tasks import SQUAD_ARTICLES, SQUAD_PARAGRAPHS, TASK_SIZES, write_tasks

__all__ = [
    "SOURCE_DOCSTRINGS",
    "SOURCE_TOPICS",
    "SQUAD_ARTICLES",
    "SQUAD_PARAGRAPHS",
    "STDLIB_MODULES",
    "TASK_SIZES",
    "Document",
    "clean_text",
    "documents",
    "smoke_documents",
    "write_corpus",
    "write_tasks",
]
