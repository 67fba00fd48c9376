"""What every report prints: summaries of per-seed values and their markdown cells."""

from __future__ import annotations

import math

from pipeline.reports.stats import mean_std


def summary(values: list[float | None]) -> dict:
    """Mean, std, count and the values themselves, ``None`` values left out."""
    clean = [v for v in values if v is not None]
    if not clean:
        return {"mean": None, "std": None, "n": 0, "values": []}
    mean, std = mean_std(clean)
    return {"mean": mean, "std": std, "n": len(clean), "values": clean}


def fmt(value, digits: int = 4) -> str:
    """A number for a table cell; an en dash for a missing or NaN value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def mean_std_cell(mean, std, n: int) -> str:
    """``mean ± std``, or the value alone for one seed."""
    return fmt(mean) if n <= 1 else f"{fmt(mean)} ± {fmt(std)}"


def table_header(columns: list[str], right: int, left: int) -> list[str]:
    """A markdown table's header row and alignment row: ``columns`` beyond the first
    ``len(columns) - right - left`` (left-aligned) are ``right`` right-aligned ones, then
    ``left`` left-aligned ones."""
    plain = len(columns) - right - left
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * plain + "---:|" * right + ":---|" * left,
    ]
