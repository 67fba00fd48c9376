"""``python -m pipeline.target``: fix the parity gate's target from the reference arm.

    python -m pipeline.target --run lamb=RUN_DIR [--run lamb=RUN_DIR ...] --fraction 0.8 \\
        [--value LOSS] --out target.json

The target is the worst (highest) validation MLM loss among the reference seeds at
``fraction`` of the run's samples (:func:`pipeline.gate.select_target`), so that every
reference seed reaches it before its run ends; ``--value`` fixes it instead (the value the
experiment config records once it is known), and the rule's value is kept beside it. The
file is written once, before any other arm runs (the experiment makes every other arm's
pretraining wait for it), with the time it was fixed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from onebit_bert.io import atomic_write_json
from pipeline.gate import select_target
from pipeline.report import load_run, parse_run

METRIC = "val_mlm_loss"


def fix_target(run_specs: list[str], fraction: float, value: float | None = None) -> dict:
    """The target from the reference runs (one arm: every ``--run`` must share its NAME)."""
    runs = [load_run(parse_run(spec, finetune_optional=True)) for spec in run_specs]
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
