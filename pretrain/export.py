"""``python -m pretrain export RUN_DIR [--step N] [--out DIR]``: one training checkpoint of
a pretraining run in HF format with its tokenizer, as the run writes ``final/`` at its end,
so that an intermediate checkpoint can be fine-tuned or published. Runs on one process, on
CPU; the checkpoint's sha256 is checked before its weights are used."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from onebit_bert.checkpoint import COMPLETE, SHARED, load_file
from onebit_bert.config import load_config
from onebit_bert.io import sha256_file
from onebit_bert.shards import PretrainingShards
from pretrain import outputs
from pretrain.checkpointing import export_hf
from pretrain.config import PretrainConfig
from pretrain.model import build_model
from pretrain.startup import token_ids


def finished_steps(run_dir: Path) -> dict[int, Path]:
    """The run's finished checkpoints by step."""
    folder = outputs.checkpoints_dir(run_dir)
    found = {}
    for path in sorted(folder.glob("step_*")):
        if (path / COMPLETE).is_file() and path.name.removeprefix("step_").isdigit():
            found[int(path.name.removeprefix("step_"))] = path
    return found


def export_checkpoint(run_dir: str | Path, step: int | None = None, out=None) -> Path:
    """Write checkpoint ``step`` (default: the newest) of ``run_dir`` to ``out`` (default:
    ``RUN_DIR/exports/step_<N>``) as an HF model directory; returns ``out``."""
    run_dir = Path(run_dir)
    config = outputs.config_path(run_dir)
    if not config.is_file():
        raise FileNotFoundError(f"{run_dir} is not a pretraining run: it has no {config.name}")
    steps = finished_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir} has no finished checkpoint to export")
    if step is None:
        step = max(steps)
    if step not in steps:
        have = ", ".join(str(s) for s in sorted(steps))
        raise ValueError(f"{run_dir} has no checkpoint at step {step}; it has steps {have}")
    checkpoint = steps[step]
    meta = json.loads((checkpoint / COMPLETE).read_text())
    expected = meta.get("sha256", {}).get(SHARED)
    if expected is None or sha256_file(checkpoint / SHARED) != expected:
        raise ValueError(f"{checkpoint / SHARED} does not match its sha256: not exported")
    cfg = load_config(PretrainConfig, config)
    shards = PretrainingShards(cfg.data.path, "train")
    ids = token_ids(shards)
    model = build_model(cfg.model, ids.vocab_size, ids.pad)
    model.load_state_dict(load_file(checkpoint / SHARED)["model"])
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise ValueError(f"{checkpoint} holds non-finite weights: not exported")
    out = Path(out) if out is not None else run_dir / "exports" / f"step_{step:08d}"
    export_hf(model, shards.tokenizer_dir, out, {"step": step, "checkpoint": str(checkpoint)})
    return out
