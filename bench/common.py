"""Pieces the benchmarks share: the prepared Wikipedia sample they train on."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

from data_prep.outputs import seq_dir

REPO = Path(__file__).resolve().parents[1]
WIKI = "enwiki_wikiextractor_sample/*.txt.gz"
VOCAB = "bert_vocab/uncased/vocab.txt"


ADAM_FAMILY = ("adamw", "onebit_adam", "zero_one_adam")
"""Optimizers the benchmarks run at AdamW's learning rate."""


def pretrain_config(
    data: Path,
    run_dir: Path,
    optimizer: str,
    *,
    steps: int,
    batch: int,
    micro: int,
    freeze_step: int = 5,
    model: str = "bert-mini",
    vocab_size: int | None = None,
    stop_after: int | None = None,
    net_interface: str | None = None,
    strategy: dict | None = None,
    momentum: float | None = None,
    optimizer_fields: dict | None = None,
    comm: dict | None = None,
) -> dict:
    """The pretraining config every benchmark trains with: fp32, a constant learning rate
    (1e-4 for AdamW, 1-bit Adam and 0/1 Adam, 5e-3 for the others), no checkpoints, no
    wandb.
    ``stop_after`` stops there without the final validation and export; ``strategy`` is the
    config's ``strategy`` section (e.g. ``{"name": "co2", "outer_every": 8}``; default: the
    optimizer's own); ``momentum``: ``optimizer.betas[0]`` (default: the optimizer's);
    ``optimizer_fields``: more ``optimizer`` fields (e.g. 0/1 Adam's schedule); ``comm``:
    the ``comm`` section (codecs per kind of traffic, hierarchy, overlap)."""
    cfg = {
        "run_dir": str(run_dir),
        "model": {"preset": model, "vocab_size": vocab_size},
        "data": {"path": str(data)},
        "batch": {"global_batch_size": batch, "micro_batch_size": micro},
        "optimizer": {
            "name": optimizer,
            "lr": 1e-4 if optimizer in ADAM_FAMILY else 5e-3,
            "freeze_step": freeze_step,
            "eps": 1e-6,
            "weight_decay": 0.01,
            "max_coeff": 0.3,
        },
        "schedule": {"name": "constant", "max_steps": steps, "warmup_proportion": 0.0},
        "checkpoint": {"every": 10**6},
        "logging": {"wandb": False, "progress_every": 10**6, "net_interface": net_interface},
        "precision": "fp32",
    }
    if stop_after is not None:
        cfg["stop_after"] = stop_after
    if strategy is not None:
        cfg["strategy"] = dict(strategy)
    if momentum is not None:
        cfg["optimizer"]["betas"] = [momentum, 0.999]
    if optimizer_fields:
        cfg["optimizer"].update(optimizer_fields)
    if comm:
        cfg["comm"] = comm
    return cfg


def add_data_root(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--data-root``, the folder of the shared data (default: ``$DATA_ROOT``, else
    ``../shared/data`` beside the checkout)."""
    default = os.environ.get("DATA_ROOT", REPO.parent / "shared" / "data")
    parser.add_argument("--data-root", default=default, help=help)


def shared_data_error(data_root: Path, vocab: bool = True) -> str | None:
    """Why ``data_root`` cannot feed the benchmarks (it lacks the Wikipedia sample or, with
    ``vocab``, the BERT vocabulary), or None."""
    if not list(data_root.glob(WIKI)) or (vocab and not (data_root / VOCAB).is_file()):
        needed = "the Wikipedia sample or the BERT vocabulary" if vocab else "the Wikipedia sample"
        return f"{data_root} lacks {needed}; set --data-root / DATA_ROOT"
    return None


def shared_data_root(
    parser: argparse.ArgumentParser, args: argparse.Namespace, vocab: bool = True
) -> Path:
    """``--data-root`` resolved; a usage error (exit status 2) when it lacks what
    :func:`shared_data_error` checks."""
    data_root = Path(args.data_root).resolve()
    error = shared_data_error(data_root, vocab)
    if error:
        parser.error(error)
    return data_root


def data_prep_command(
    data_root: Path, out: Path, *overrides: str, max_documents: int | None = None
) -> list[str]:
    """``python -m data_prep`` on the shared sample config, writing to ``out``, with the
    Wikipedia sample (its first ``max_documents`` articles, or all) as the only source."""
    limit = "" if max_documents is None else f", max_documents: {max_documents}"
    return [
        sys.executable,
        "-m",
        "data_prep",
        "--config",
        str(REPO / "configs/data/sample.yaml"),
        f"output={out}",
        f"data_root={data_root}",
        "progress=false",
        f"sources=[{{name: wikipedia, kind: wikiextractor, paths: [{WIKI}]{limit}}}]",
        *overrides,
    ]


def _run_data_stage(command: list[str], what: str) -> None:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:  # the stage's own one-line error, not a traceback
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        raise SystemExit(f"preparing {what} failed: {lines[-1]}")


def prepare_wikipedia(
    data_root: Path, out: Path, seq_lengths=(128,), max_documents: int = 3000
) -> Path:
    """Prepare ``max_documents`` articles of the shared Wikipedia sample at ``seq_lengths``
    with BERT's uncased vocabulary (the data stage's own CLI); returns the output folder."""
    lengths = ",".join(str(n) for n in seq_lengths)
    command = data_prep_command(
        data_root,
        out,
        f"instances.seq_lengths=[{lengths}]",
        "sequences_per_shard=1024",
        max_documents=max_documents,
    )
    _run_data_stage(command, "the Wikipedia sample")
    return out


def prepare_wikipedia_seq128(data_root: Path, out: Path, max_documents: int = 3000) -> Path:
    """:func:`prepare_wikipedia` at sequence length 128; returns its shard folder."""
    return seq_dir(prepare_wikipedia(data_root, out, (128,), max_documents), 128)


GENERATED_VOCAB = 30522
"""The WordPiece vocabulary asked of the generated corpus (BERT's size; the small corpus
yields fewer, so the benchmarks pad the model to this width: ``model.vocab_size``)."""


def prepare_generated(out: Path, seq_lengths=(128,)) -> Path:
    """The smoke corpus (``python -m smoke_data``, no input files), prepared at
    ``seq_lengths`` with a WordPiece vocabulary trained on it; returns the output folder."""
    from smoke_data.documents import write_corpus

    inputs = out.parent / f"{out.name}-inputs"
    write_corpus(inputs)
    lengths = ",".join(str(n) for n in seq_lengths)
    command = [
        sys.executable,
        "-m",
        "data_prep",
        "--config",
        str(REPO / "configs/data/smoke.yaml"),
        f"output={out}",
        f"data_root={inputs}",
        f"instances.seq_lengths=[{lengths}]",
        f"tokenizer.vocab_size={GENERATED_VOCAB}",
        "sequences_per_shard=256",
    ]
    _run_data_stage(command, "the generated corpus")
    return out


def at_least(minimum: int, why: str | None = None):
    """An argparse ``type``: an integer of at least ``minimum`` (``why`` says why, in the
    message of one that is smaller)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be at least {minimum}{reason}, not {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its "invalid ... value" message
    return parse


def init_gloo(rank: int, world_size: int, store: str) -> None:
    """Join the benchmark's gloo process group through the file store ``store``."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )


def run_gloo_ranks(rank_main, world_size: int, *args):
    """Run ``rank_main(rank, world_size, store, out_path, *args)`` on ``world_size`` spawned
    gloo processes (``store`` for :func:`init_gloo`) and return what rank 0 saved to
    ``out_path`` with ``torch.save``."""
    import os
    import tempfile

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        mp.spawn(
            rank_main,
            args=(world_size, os.path.join(tmp, "store"), out_path, *args),
            nprocs=world_size,
        )
        return torch.load(out_path)
