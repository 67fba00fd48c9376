"""``python -m data_prep --config CONFIG [section.field=value ...]``: prepare pretraining shards."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare
from onebit_bert.config import ConfigError, config_help, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Turn text corpora into sharded, tokenized BERT pretraining data.",
        epilog=config_help(DataPrepConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML config (see configs/data/)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(DataPrepConfig, args.config, args.overrides)
        manifests = prepare(cfg)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    summary = {
        f"seq{n}": {
            "train_sequences": m["splits"]["train"]["sequences"],
            "train_shards": len(m["splits"]["train"]["shards"]),
            "validation_sequences": m["splits"]["validation"]["sequences"],
            "corpus_tokens": m["corpus_tokens"],
        }
        for n, m in manifests.items()
    }
    print(json.dumps({"output": cfg.output, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
