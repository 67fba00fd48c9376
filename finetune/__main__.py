"""Fine-tuning a pretrained checkpoint on GLUE and SQuAD.

python -m finetune run --config CONFIG [section.field=value ...]
python -m finetune run checkpoint=DIR 'tasks=[sst2, mrpc]' data_root=DIR output=DIR
python -m finetune download --config CONFIG   (on a machine with internet: fill the HF cache)

(The comparison report of several runs is the orchestrator's: python -m pipeline.reports.parity.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from finetune.config import FinetuneConfig
from onebit_bert.cli import add_config_arguments, report_error
from onebit_bert.config import ConfigError, load_config
from onebit_bert.run_lock import RunLocked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser(
        "run",
        help="fine-tune a checkpoint on GLUE / SQuAD tasks",
        description="Fine-tune a checkpoint on GLUE / SQuAD tasks, several seeds each.",
    )
    add_config_arguments(
        run_p,
        FinetuneConfig,
        overrides="field=value",
        heading="config fields (set in the YAML file or as field=value):",
    )
    get_p = sub.add_parser(
        "download",
        help="fetch the config's tasks from the Hugging Face hub into its cache",
        description="Load every split the config's tasks use from the Hugging Face hub, "
        "so that they are in the cache (HF_HOME / HF_DATASETS_CACHE) for jobs that run with "
        "HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 on compute nodes without internet. Run "
        "it on a login node with the same cache variables. Nothing to do with data_root set "
        "(the tasks are read from its files).",
    )
    add_config_arguments(get_p, FinetuneConfig, overrides="field=value", heading=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "download":
        try:
            cfg = load_config(FinetuneConfig, args.config, args.overrides)
            print(json.dumps(download(cfg)))
        except (ConfigError, ValueError, RuntimeError) as err:
            return report_error(err, 2)
        return 0
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
    except (ConfigError, ValueError, FileNotFoundError, RunLocked) as err:
        return report_error(err, 2)
    return 0


def download(cfg: FinetuneConfig) -> dict:
    """Load every split of ``cfg.tasks`` from the hub (filling the cache); the rows per
    split, or ``{"data_root": ...}`` when the tasks are read from local files."""
    if cfg.data_root is not None:
        return {"data_root": str(cfg.data_root), "downloaded": {}}
    from finetune import squad
    from finetune.glue_tasks import get_task

    rows = {}
    for name in cfg.tasks:
        if name == "squad":
            for split in ("train", "validation"):
                rows[f"squad/{split}"] = len(squad.load_squad(split, None))
            continue
        task = get_task(name)
        for split in ("train", *task.eval_splits):
            rows[f"{name}/{split}"] = len(task.load(split, None))
    return {"data_root": None, "downloaded": rows}


if __name__ == "__main__":
    sys.exit(main())
