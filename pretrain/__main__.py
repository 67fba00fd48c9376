"""``python -m pretrain --config CONFIG [section.field=value ...]``; launch with torchrun or
srun for several processes. ``python -m pretrain export RUN_DIR [--step N] [--out DIR]``
writes one checkpoint in HF format (:mod:`pretrain.export`)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback

from onebit_bert.checkpoint import NoUsableCheckpoint
from onebit_bert.cli import add_config_arguments, report_error
from onebit_bert.config import ConfigError, load_config
from onebit_bert.distributed.env import (
    abort_distributed,
    destroy_distributed,
    init_distributed,
    peer_lost,
)
from onebit_bert.io import NoSpaceError
from onebit_bert.run_lock import RunLocked
from pretrain.config import PretrainConfig
from pretrain.train import TrainingDiverged, flush_denormals, train


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
        return report_error(err, 2)
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
    )
    add_config_arguments(parser, PretrainConfig, shipped="configs/pretrain/")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides)
    except ConfigError as err:
        return report_error(err, 2)
    if cfg.flush_denormal:  # before torch starts its threads: the flag is per thread
        try:
            flush_denormals()
        except ValueError as err:
            return report_error(err, 2)
    backend = None if cfg.backend == "auto" else cfg.backend
    ctx = init_distributed(backend=backend, timeout_s=cfg.collective_timeout_s)
    is_main, rank, world_size = ctx.is_main, ctx.rank, ctx.world_size
    code, summary = 0, None
    try:
        summary = train(cfg, ctx)
    except TrainingDiverged as err:
        code = report_error(err, 3)
    except RunLocked as err:
        code = report_error(err, 4)
    except (ValueError, FileNotFoundError, NoUsableCheckpoint, NoSpaceError) as err:
        code = report_error(err, 2 if not isinstance(err, NoSpaceError) else 1)
    except Exception as err:
        if not peer_lost(err):
            traceback.print_exc()
            code = 1
        else:  # another rank left: its own message says why, status.json records it
            code = report_error(
                f"rank {rank} stopped: another rank ended ({' '.join(str(err).split())[:200]})",
                1,
            )
    ctx = None  # the process group goes with the last reference to it
    if code == 0:
        destroy_distributed()
    elif world_size > 1 and not abort_distributed():
        # A rank still waits in a collective: leave now, so that it sees this process's
        # connections close and stops in seconds rather than at collective_timeout_s.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if is_main and summary is not None:
        print(json.dumps(summary))
    return code


if __name__ == "__main__":
    # An abort in native code (a collective library's thread) then prints every thread's
    # Python stack instead of one line.
    faulthandler.enable()
    sys.exit(main())
