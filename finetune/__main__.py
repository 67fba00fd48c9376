"""Fine-tuning a pretrained checkpoint on GLUE and SQuAD.

python -m finetune run --config CONFIG [section.field=value ...]
python -m finetune run checkpoint=DIR 'tasks=[sst2, mrpc]' data_root=DIR output=DIR

(The comparison report of several runs is the orchestrator's: python -m pipeline.report.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from finetune.config import FinetuneConfig
from onebit_bert.config import ConfigError, config_help, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser(
        "run",
        help="fine-tune a checkpoint on GLUE / SQuAD tasks",
        description="Fine-tune a checkpoint on GLUE / SQuAD tasks, several seeds each.",
        epilog=config_help(
            FinetuneConfig, heading="config fields (set in the YAML file or as field=value):"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_p.add_argument("--config", help="YAML config (optional; overrides also work alone)")
    run_p.add_argument("overrides", nargs="*", help="field=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
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
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
