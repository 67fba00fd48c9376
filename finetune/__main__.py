"""Fine-tuning and the parity report.

python -m finetune run --config CONFIG [section.field=value ...]
python -m finetune run checkpoint=DIR 'tasks=[sst2, mrpc]' data_root=DIR output=DIR
python -m finetune report --run lamb=PRETRAIN_DIR:FINETUNE_DIR --run onebit=... --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="fine-tune a checkpoint on GLUE / SQuAD tasks")
    run_p.add_argument("--config", help="YAML config (optional; overrides also work alone)")
    run_p.add_argument("overrides", nargs="*", help="field=value overrides")
    rep_p = sub.add_parser("report", help="the LAMB vs 1-bit LAMB parity report")
    rep_p.add_argument(
        "--run",
        action="append",
        required=True,
        help="NAME=PRETRAIN_RUN_DIR:FINETUNE_OUTPUT_DIR (two or more)",
    )
    rep_p.add_argument("--out", required=True, help="report directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "run":
            from finetune.config import FinetuneConfig
            from finetune.run import run

            cfg = load_config(FinetuneConfig, args.config, args.overrides)
            results = run(cfg)
            print(
                json.dumps(
                    {
                        task: {k: v for k, v in r.items() if isinstance(v, int | float)}
                        for task, r in results.items()
                    }
                )
            )
        else:
            from finetune.report import write_report

            write_report(args.run, args.out)
            print(f"report: {args.out}/report.md")
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
