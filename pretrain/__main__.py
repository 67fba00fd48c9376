"""``python -m pretrain --config CONFIG [section.field=value ...]``; launch with torchrun or
srun for several processes. ``python -m pretrain export RUN_DIR [--step N] [--out DIR]``
writes one checkpoint in HF format (:mod:`pretrain.export`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys

from onebit_bert.checkpoint import NoUsableCheckpoint
from onebit_bert.config import ConfigError, config_help, load_config
from onebit_bert.distributed.env import destroy_distributed, init_distributed
from onebit_bert.run_lock import RunLocked
from pretrain.config import PretrainConfig
from pretrain.train import TrainingDiverged, train


def export_main(argv: list[str]) -> int:
    from pretrain.export import export_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m pretrain export",
        description="Write one training checkpoint of a pretraining run in HF format, with "
        "its tokenizer (default: the newest, to RUN_DIR/exports/step_<N>)",
    )
    parser.add_argument("run_dir", help="the pretraining run directory (its run_dir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--out", default=None, help="output directory")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.run_dir, args.step, args.out)
    except (ValueError, FileNotFoundError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m pretrain",
        description="BERT pretraining with any optimizer and strategy of the harness (and "
        "`python -m pretrain export "
        "RUN_DIR --step N` for a checkpoint in HF format)",
        epilog=config_help(PretrainConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="YAML config (see configs/pretrain/)")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    backend = None if cfg.backend == "auto" else cfg.backend
    ctx = init_distributed(backend=backend, timeout_s=cfg.collective_timeout_s)
    is_main = ctx.is_main
    try:
        summary = train(cfg, ctx)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except RunLocked as err:
        print(f"error: {err}", file=sys.stderr)
        return 4
    except (ValueError, FileNotFoundError, NoUsableCheckpoint) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        ctx = None  # the process group goes with the last reference to it
        destroy_distributed()
    if is_main:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    # An abort in native code (a collective library's thread) then prints every thread's
    # Python stack instead of one line.
    faulthandler.enable()
    sys.exit(main())
