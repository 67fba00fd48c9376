"""``python -m pipeline.target``: fix the parity gate's target from the reference arm.

    python -m pipeline.target --run lamb=RUN_DIR [--run lamb=RUN_DIR ...] --fraction 0.8 \\
        [--value LOSS] --out target.json

The target is the worst (highest) validation MLM loss among the reference seeds at
``fraction`` of the run's samples (:func:`select_target`), so that every
reference seed reaches it before its run ends; ``--value`` fixes it instead (the value the
experiment config records once it is known), and the rule's value is kept beside it. The
file is written once, before any other arm runs (the experiment makes every other arm's
pretraining wait for it), with the time it was fixed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from onebit_bert.io import atomic_write_json
from pipeline.run_files import by_samples, max_samples, parse_run, read_run

METRIC = "val_mlm_loss"


def parse_utc(text: str, what: str = "time") -> datetime:
    """An ISO 8601 time in UTC ("2026-11-28T21:41:00Z" or with "+00:00") as an aware
    datetime; anything else is one clear error naming ``what``."""
    try:
        when = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.utcoffset() is None or when.utcoffset().total_seconds() != 0:
        raise ValueError(
            f'{what} must be an ISO 8601 time in UTC such as "2026-11-28T21:41:00Z", got {text!r}'
        )
    return when.astimezone(UTC)


def value_at(points: list[tuple[float, float]], x: float) -> float:
    """The curve ``points`` (x ascending) at ``x``, linear between points; an ``x`` outside
    the points is an error (no extrapolation)."""
    if not points:
        raise ValueError("value_at of an empty curve")
    if not points[0][0] <= x <= points[-1][0]:
        raise ValueError(
            f"x = {x} lies outside the curve's range [{points[0][0]}, {points[-1][0]}]"
        )
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def select_target(
    reference_curves: dict[str, list[tuple[float, float]]],
    at: float,
) -> dict:
    """The target: the highest of the reference seeds' validation losses at ``at`` (the
    same x unit as the curves: samples, or steps), so that every reference seed reaches it
    by ``at``. ``reference_curves``: seed label → [(x, validation loss), ...]."""
    if len(reference_curves) < 1:
        raise ValueError("select_target needs at least one reference curve")
    values = {}
    for label, points in reference_curves.items():
        if not points or points[-1][0] < at:
            last = points[-1][0] if points else None
            raise ValueError(
                f"reference run {label!r} ends at {last}, before the target's point {at}: "
                f"let every reference run finish before fixing the target"
            )
        values[label] = value_at(points, at)
    worst = max(values, key=values.get)
    return {"value": values[worst], "at": at, "worst": worst, "values_at": values}


def read_target(path: str | Path) -> dict | None:
    """A target file (:mod:`pipeline.target`); None when it is absent, damaged or has no
    value."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("value"), int | float) else None


def _reference_run(spec: str) -> dict:
    """What the rule reads of one ``NAME=PRETRAIN_DIR`` run: its name, seed, length in
    samples and :data:`METRIC` against samples."""
    inputs = parse_run(spec, finetune_optional=True)
    config, by_step = read_run(inputs)
    return {
        "name": inputs.name,
        "pretrain_dir": str(inputs.pretrain_dir),
        "seed": config.get("seed"),
        "max_samples": max_samples(config, by_step),
        METRIC: by_samples(by_step, config["batch"]["global_batch_size"], METRIC),
    }


def fix_target(run_specs: list[str], fraction: float, value: float | None = None) -> dict:
    """The target from the reference runs (one arm: every ``--run`` must share its NAME)."""
    runs = [_reference_run(spec) for spec in run_specs]
    names = {r["name"] for r in runs}
    if len(names) != 1:
        raise ValueError(f"the target comes from one reference arm; got runs named {sorted(names)}")
    lengths = {r["max_samples"] for r in runs}
    if len(lengths) != 1:
        raise ValueError(f"the reference runs have different lengths (samples {sorted(lengths)})")
    at = fraction * lengths.pop()
    curves = {f"seed {r['seed']}": r[METRIC] for r in runs}
    chosen = select_target(curves, at)
    return {
        "metric": METRIC,
        "value": chosen["value"] if value is None else value,
        "source": "rule" if value is None else "experiment config",
        "rule": f"the worst reference seed's {METRIC} at {fraction:g} of the run",
        "rule_value": chosen["value"],
        "reference": names.pop(),
        "fraction": fraction,
        "at_samples": at,
        "worst": chosen["worst"],
        "values_at": chosen["values_at"],
        "reference_runs": [r["pretrain_dir"] for r in runs],
        "fixed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.target",
        description="Fix the parity gate's target validation loss from the reference runs.",
    )
    parser.add_argument("--run", action="append", required=True, help="NAME=PRETRAIN_RUN_DIR")
    parser.add_argument("--fraction", type=float, default=0.8, help="of the run (default 0.8)")
    parser.add_argument("--value", type=float, help="a fixed target (the rule's value is kept)")
    parser.add_argument("--out", required=True, help="the target JSON to write")
    args = parser.parse_args(argv)
    try:
        target = fix_target(args.run, args.fraction, args.value)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    atomic_write_json(Path(args.out), target)
    print(f"target {target['metric']} {target['value']:.4f} ({target['source']}): {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
