"""The nine GLUE tasks: where their data lives and how a row becomes an :class:`Example`.

Each task is one :class:`GlueTask` entry of :data:`TASKS` that only declares what differs
(folder, labels, columns, hub fields, metrics); reading and validation are the class's. Data comes
either from the original GLUE layout written by GLUE's ``download_glue_data.py``::

    <data_root>/CoLA/{train,dev}.tsv      <data_root>/MNLI/{train,dev_matched,dev_mismatched}.tsv
    <data_root>/SST-2/{train,dev}.tsv     ...

or, with ``data_root=None``, from the Hugging Face hub (``nyu-mll/glue``).

GLUE TSVs contain unbalanced quotes inside sentences, so lines are split on tabs by hand (no
quoting, like ``csv.QUOTE_NONE``); a row whose column count differs from the header's (a tab or a
line break inside a sentence, a truncated line) is an error rather than silently misread text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

HUB_DATASET = "nyu-mll/glue"
"""Hub id of GLUE (the configs are the task names: ``cola``, ``sst2``, ...)."""


@dataclass(frozen=True)
class Example:
    """One labelled GLUE example."""

    guid: str
    """``<split>-<row number>``, the row number counting data rows from 0 (the hub's ``idx``)."""
    text_a: str
    text_b: str | None
    """Second sentence of pair tasks; ``None`` for single-sentence tasks (CoLA, SST-2)."""
    label: int | float
    """Class id (index into :attr:`GlueTask.labels`), or the similarity score for STS-B."""


@dataclass(frozen=True, eq=False)
class GlueTask:
    """One GLUE task: where its files are, how its columns and labels read, what it scores."""

    folder: str
    """Folder of the task under ``data_root`` (GLUE's spelling, e.g. ``SST-2``)."""
    labels: tuple[str, ...] | None
    """Class names in id order (the hub's order); ``None`` for regression."""
    columns: tuple[str, str | None, str]
    """Header names of the (text_a, text_b, label) columns; text_b ``None`` for single sentences."""
    hub_fields: tuple[str, str | None]
    """Hub feature names of (text_a, text_b)."""
    file_labels: tuple[str, ...] | None = None
    """Label cells as written in the TSV, in id order; ``None``: the same as :attr:`labels`."""
    metric_names: tuple[str, ...] = ("accuracy",)
    eval_splits: dict[str, str] = field(default_factory=lambda: {"validation": "dev.tsv"})
    """Evaluation split name (as on the hub) -> file in the task folder."""
    headerless_columns: tuple[str, ...] | None = None
    """Column names of files that have no header line (CoLA); ``None``: the first line is one."""
    score_range: tuple[float, float] = (0.0, 5.0)
    """Regression only: the valid range of the score."""

    @property
    def name(self) -> str:
        """Lower-case task name without hyphens (``sst2`` for ``SST-2``): the hub config."""
        return self.folder.lower().replace("-", "")

    @property
    def hub_config(self) -> str:
        return self.name

    @cached_property
    def _label_ids(self) -> dict[str, int]:
        return {raw: i for i, raw in enumerate(self.file_labels or self.labels or ())}

    def __repr__(self) -> str:
        return f"GlueTask(name={self.name!r})"

    @property
    def num_labels(self) -> int:
        """Number of classes; 1 for regression (one output)."""
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def split_files(self) -> dict[str, str]:
        """Every loadable split -> its file: ``train`` and the evaluation splits."""
        return {"train": "train.tsv", **self.eval_splits}

    # ------------------------------------------------------------------------- labels

    def parse_label(self, raw: str) -> int | float:
        """Label cell -> class id or score; ``ValueError`` saying what was expected."""
        cell = raw.strip()
        if self.labels is not None:
            if cell not in self._label_ids:
                expected = ", ".join(repr(v) for v in self._label_ids)
                raise ValueError(f"unknown label {raw!r}, expected one of {expected}")
            return self._label_ids[cell]
        low, high = self.score_range
        try:
            score = float(cell)
        except ValueError:
            raise ValueError(
                f"label {raw!r} is not a number, expected a score in [{low}, {high}]"
            ) from None
        if not low <= score <= high:  # also rejects nan
            raise ValueError(f"score {raw!r} is outside [{low}, {high}]")
        return score

    # ------------------------------------------------------------------------- local TSV

    def read_tsv(self, path: Path, split: str) -> list[Example]:
        """Read one GLUE TSV of this task; every row is validated before anything is returned.

        A malformed row (wrong column count, unknown or unparseable label) raises ``ValueError``
        naming the file, its 1-based line number and what was expected; so does a file with no
        data rows or a header lacking this task's columns.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8-sig")  # -sig: MRPC's files start with a BOM
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from None
        lines = text.split("\n")  # not splitlines(): it also breaks on \x0b, \x1c, \u2028, ...
        if lines[-1] == "":
            lines.pop()  # the final newline (CoLA's dev.tsv has none)
        lines = [line.removesuffix("\r") for line in lines]

        if self.headerless_columns is not None:
            header, first = list(self.headerless_columns), 0
        elif not lines:
            raise ValueError(f"{path}: empty file, expected a header line and data rows")
        else:
            header, first = lines[0].split("\t"), 1
            missing = [c for c in self.columns if c is not None and c not in header]
            if missing:
                raise ValueError(
                    f"{path}, line 1: header {lines[0]!r} lacks column(s) {missing}; expected "
                    f"the original GLUE {self.folder} layout with columns {list(self.columns)}"
                )
        if len(lines) <= first:
            raise ValueError(f"{path}: no data rows" + (" after the header" if first else ""))

        a_name, b_name, label_name = self.columns
        a_col, label_col = header.index(a_name), header.index(label_name)
        b_col = None if b_name is None else header.index(b_name)
        examples = []
        for row, line in enumerate(lines[first:]):
            line_no = first + row + 1
            cells = line.split("\t")
            if len(cells) != len(header):
                raise ValueError(
                    f"{path}, line {line_no}: expected {len(header)} tab-separated columns "
                    f"({', '.join(header)}), found {len(cells)}"
                )
            try:
                label = self.parse_label(cells[label_col])
            except ValueError as err:
                raise ValueError(f"{path}, line {line_no}, column {label_name!r}: {err}") from None
            text_b = None if b_col is None else cells[b_col]
            examples.append(Example(f"{split}-{row}", cells[a_col], text_b, label))
        return examples

    # ------------------------------------------------------------------------- loading

    def load(self, split: str, data_root: str | Path | None = None) -> list[Example]:
        """Examples of ``split`` (``train`` or a key of :attr:`eval_splits`).

        With ``data_root``: ``<data_root>/<folder>/<file>`` (``FileNotFoundError`` saying how to
        fix it when absent). With ``data_root=None``: the hub dataset ``nyu-mll/glue``
        (``RuntimeError`` when it cannot be loaded, e.g. offline).
        """
        files = self.split_files
        if split not in files:
            raise ValueError(
                f"GLUE task {self.name!r} has no split {split!r}; expected one of {list(files)}"
            )
        if data_root is None:
            return self._load_hub(split)
        folder = Path(data_root) / self.folder
        path = folder / files[split]
        if not folder.is_dir():
            script_name = self.folder.split("-")[0]  # the script's --tasks says SST, STS
            where = "" if Path(data_root).is_dir() else f" (data_root {data_root} does not exist)"
            raise FileNotFoundError(
                f"GLUE task {self.name!r}: folder {folder} not found{where}; expected {path} "
                f"in the layout of GLUE's download_glue_data.py (<data_root>/{self.folder}/"
                f"{files[split]}). Download the task there (download_glue_data.py --data_dir "
                f"<data_root> --tasks {script_name}), point data_root at the folder that holds "
                f"{self.folder}/, or pass data_root=None to load {HUB_DATASET} from the hub"
            )
        if not path.is_file():
            present = sorted(p.name for p in folder.iterdir())
            raise FileNotFoundError(
                f"GLUE task {self.name!r}: {path} not found ({folder} holds {present}); the "
                f"{split!r} split is read from {self.folder}/{files[split]}"
            )
        return self.read_tsv(path, split)

    def _load_hub(self, split: str) -> list[Example]:
        try:
            import datasets

            dataset = datasets.load_dataset(HUB_DATASET, self.hub_config, split=split)
        except Exception as err:
            raise RuntimeError(
                f"GLUE task {self.name!r}: cannot load split {split!r} of hub dataset "
                f"{HUB_DATASET!r} (config {self.hub_config!r}): {type(err).__name__}: {err}. "
                f"Without access to the Hugging Face hub, pass data_root pointing at a copy of "
                f"GLUE in the layout of download_glue_data.py (<data_root>/{self.folder}/"
                f"{self.split_files[split]})"
            ) from None
        a_field, b_field = self.hub_fields
        fields = [f for f in (a_field, b_field, "label") if f is not None]
        missing = [f for f in fields if f not in dataset.column_names]
        if missing:
            raise RuntimeError(
                f"hub dataset {HUB_DATASET!r} ({self.hub_config}, {split}) lacks field(s) "
                f"{missing} (has {dataset.column_names})"
            )
        values = {f: list(dataset[f]) for f in fields}
        examples = []
        for row, raw_label in enumerate(values["label"]):
            label: int | float
            if self.labels is None:
                label = float(raw_label)
            else:
                label = int(raw_label)
                if not 0 <= label < self.num_labels:  # -1: unlabelled (test) rows
                    raise ValueError(
                        f"hub dataset {HUB_DATASET!r} ({self.hub_config}, {split}) row {row}: "
                        f"label {raw_label!r} outside 0..{self.num_labels - 1}"
                    )
            text_b = None if b_field is None else values[b_field][row]
            examples.append(Example(f"{split}-{row}", values[a_field][row], text_b, label))
        return examples


# ----------------------------------------------------------------------------- the tasks

_BINARY = ("0", "1")  # how CoLA, SST-2, MRPC, QQP and WNLI write their labels
_PAIR = ("sentence1", "sentence2")
_SINGLE = ("sentence", None)
_ACCURACY_F1 = ("accuracy", "f1")

TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask(  # acceptability of one sentence; files without a header
            "CoLA",
            labels=("unacceptable", "acceptable"),
            columns=(*_SINGLE, "label"),
            hub_fields=_SINGLE,
            file_labels=_BINARY,
            metric_names=("matthews_correlation",),
            headerless_columns=("source", "label", "original_label_marker", "sentence"),
        ),
        GlueTask(  # sentiment of one sentence
            "SST-2",
            labels=("negative", "positive"),
            columns=(*_SINGLE, "label"),
            hub_fields=_SINGLE,
            file_labels=_BINARY,
        ),
        GlueTask(  # are two sentences paraphrases
            "MRPC",
            labels=("not_equivalent", "equivalent"),
            columns=("#1 String", "#2 String", "Quality"),
            hub_fields=_PAIR,
            file_labels=_BINARY,
            metric_names=_ACCURACY_F1,
        ),
        GlueTask(  # similarity score of a pair: regression
            "STS-B",
            labels=None,
            columns=(*_PAIR, "score"),
            hub_fields=_PAIR,
            metric_names=("pearson", "spearmanr"),
        ),
        GlueTask(  # are two questions duplicates
            "QQP",
            labels=("not_duplicate", "duplicate"),
            columns=("question1", "question2", "is_duplicate"),
            hub_fields=("question1", "question2"),
            file_labels=_BINARY,
            metric_names=_ACCURACY_F1,
        ),
        GlueTask(  # premise and hypothesis; matched and mismatched validation sets
            "MNLI",
            labels=("entailment", "neutral", "contradiction"),
            columns=(*_PAIR, "gold_label"),  # gold_label: the last column
            hub_fields=("premise", "hypothesis"),
            eval_splits={
                "validation_matched": "dev_matched.tsv",
                "validation_mismatched": "dev_mismatched.tsv",
            },
        ),
        GlueTask(  # does a sentence contain the answer to a question
            "QNLI",
            labels=("entailment", "not_entailment"),
            columns=("question", "sentence", "label"),
            hub_fields=("question", "sentence"),
        ),
        GlueTask(  # does the first sentence entail the second
            "RTE",
            labels=("entailment", "not_entailment"),
            columns=(*_PAIR, "label"),
            hub_fields=_PAIR,
        ),
        GlueTask(  # entailment of pairs built from Winograd schemas
            "WNLI",
            labels=("not_entailment", "entailment"),
            columns=(*_PAIR, "label"),
            hub_fields=_PAIR,
            file_labels=_BINARY,
        ),
    )
}
"""Task name -> task, in GLUE's order."""


def get_task(name: str) -> GlueTask:
    """The task called ``name``: case-insensitive, ``-``/``_`` ignored (``SST-2``, ``sts-b``)."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; valid names: {', '.join(TASKS)}")
    return TASKS[key]
