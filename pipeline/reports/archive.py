"""A finished pretraining run's record, small enough to keep beside the results page that
reads it, and read by the reports as the run directory itself would be.

    python -m pipeline.reports.archive RUN_DIR DEST [--every 10]

    <DEST>/config.yaml    the run's resolved config (copied)
    <DEST>/status.json    its status (copied): state, steps, start and finish
    <DEST>/metrics.jsonl  one record per step (a resumed run logs some steps twice: the
                          later record wins), kept for every validation row, every
                          ``every``-th step and the last: the curves, samples to a target
                          and the 1-bit switch the reports draw
    <DEST>/totals.json    what the kept rows no longer add up to: bytes in all and per kind
                          of traffic, with their seconds, over every step, and the first
                          record's time (:func:`pipeline.reports.runs.totals`)

The checkpoints and the exported model stay in the run directory. Only a complete run is
archived; the run directory is only read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from onebit_bert.io import atomic_write_json, atomic_write_text, read_json_object
from pipeline.reports import cli
from pipeline.reports.runs import totals
from pipeline.run_files import TOTALS, RunInputs, read_run
from pretrain import outputs as pretrain_outputs

EVERY = 10


def thinned(by_step: dict[int, dict], every: int = EVERY) -> list[dict]:
    """The records kept: every step with a validation value, every ``every``-th step and
    the last, in step order."""
    last = max(by_step, default=None)
    return [
        by_step[s]
        for s in sorted(by_step)
        if s % every == 0 or s == last or any(k.startswith("val_") for k in by_step[s])
    ]


def archive(run_dir: str | Path, dest: str | Path, every: int = EVERY) -> dict:
    """Write ``run_dir``'s record into ``dest`` (see the module); returns ``totals.json``'s
    content with the rows read and kept."""
    run_dir, dest = Path(run_dir), Path(dest)
    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    status = read_json_object(pretrain_outputs.status_path(run_dir), None)
    if status is None or status.get("state") != "complete":
        state = "no status.json" if status is None else f"state {status.get('state')!r}"
        raise ValueError(
            f"{run_dir} is not a complete pretraining run ({state}): archive it when it has "
            "finished"
        )
    _, by_step = read_run(RunInputs(run_dir.name, run_dir, None))
    kept = thinned(by_step, every)
    counted = totals(by_step)
    dest.mkdir(parents=True, exist_ok=True)
    config_text = pretrain_outputs.config_path(run_dir).read_text()
    atomic_write_text(pretrain_outputs.config_path(dest), config_text)
    atomic_write_json(pretrain_outputs.status_path(dest), status)
    atomic_write_text(
        pretrain_outputs.metrics_path(dest), "".join(json.dumps(r) + "\n" for r in kept)
    )
    atomic_write_json(dest / TOTALS, {**counted, "every": every})
    return {**counted, "rows": len(by_step), "kept": len(kept)}


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.archive RUN_DIR DEST [--every N]``."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.reports.archive",
        description="Keep a finished pretraining run's record (config, status, thinned "
        "metrics and their totals) in DEST, where the reports read it as the run itself.",
    )
    parser.add_argument("run_dir", help="the run's directory (…/pretrain/<run>/phase1)")
    parser.add_argument("dest", help="where the record goes (e.g. docs/results/<page>/runs/<run>)")
    parser.add_argument(
        "--every", type=int, default=EVERY, help="keep every N-th step besides the validation rows"
    )

    def write(args) -> str:
        done = archive(args.run_dir, args.dest, args.every)
        return f"{args.dest}: {done['kept']} of {done['rows']} steps kept, totals in {TOTALS}"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
