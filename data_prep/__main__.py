"""``python -m data_prep --config CONFIG [section.field=value ...]``: prepare pretraining shards.

``python -m data_prep verify PATH``: check prepared shards (see :mod:`data_prep.verify`).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare
from onebit_bert.cli import add_config_arguments, report_error
from onebit_bert.config import ConfigError, load_config
from onebit_bert.io import NoSpaceError
from onebit_bert.run_lock import RunLocked


class Stopped(BaseException):
    """SIGTERM arrived: unwinds the run (the worker pool is terminated on the way out, and
    the output's lock released) so that it ends with one line, not a traceback per worker."""


def _stop(signum, _frame) -> None:
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["verify"]:
        from data_prep.verify import main as verify

        return verify(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        usage="%(prog)s [-h] --config CONFIG [overrides ...]\n       %(prog)s verify PATH",
        description="Turn text corpora into sharded, tokenized BERT pretraining data.\n\n"
        "python -m data_prep verify PATH checks prepared shards (a seq<N> directory or the "
        "output directory):\nsizes and sha256 against the manifest, and every token id within "
        "the vocabulary.",
    )
    args = add_config_arguments(parser, DataPrepConfig, shipped="configs/data/").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        cfg = load_config(DataPrepConfig, args.config, args.overrides)
        manifests = prepare(cfg)
    except Stopped:
        print(
            "data_prep: stopped by SIGTERM; run the same command again to resume (finished "
            "units are kept)",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    except (ConfigError, ValueError) as err:
        return report_error(err, 2)
    except NoSpaceError as err:
        return report_error(err, 1)
    except RunLocked as err:
        return report_error(err, 4)
    finally:
        signal.signal(signal.SIGTERM, previous)
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
