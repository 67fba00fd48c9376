"""Checkpoints of a pretraining run: what is saved, restoring it, starting from another
run (``model.init_from``), and the HF-format export at the end."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from onebit_bert.checkpoint import CheckpointManager, load_file
from onebit_bert.io import atomic_write_json
from onebit_bert.strategies import Strategy
from onebit_bert.strategies.local_steps import default_outer_lr
from pretrain.config import RESUME_MAY_CHANGE, PretrainConfig
from pretrain.model import load_weights


def seed_everything(seed: int, rank: int) -> None:
    """Python's, numpy's and torch's generators from ``seed + rank``."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def rng_state() -> dict:
    """This process's generator states (per-rank checkpoint state)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # as tensors and plain values, so the file loads with weights_only=True
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        # This rank's own GPU (the current device) only: it draws on no other, and a
        # resume may see another number of GPUs per node.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, list | tuple):  # older checkpoints: every visible GPU's state
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)


def save(checkpoints: CheckpointManager, step: int, strategy: Strategy, scheduler, scaler) -> None:
    """Model, strategy (optimizer) state, schedule, loss scale; per rank: the strategy's
    own state and the generators."""
    shared, per_rank = strategy.state_dict()
    checkpoints.save(
        step,
        {
            "model": strategy.shared_model_state(),
            **shared,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
        },
        {**per_rank, "rng": rng_state()},
    )


def restore(shared: dict, per_rank: dict | None, strategy: Strategy, scheduler, scaler) -> None:
    """The inverse of :func:`save` (``per_rank`` None: written at another world size)."""
    strategy.model.load_state_dict(shared["model"])
    strategy.load_state_dict(shared, per_rank)
    scheduler.load_state_dict(shared["scheduler"])
    scaler.load_state_dict(shared["scaler"])
    if per_rank is not None:
        set_rng_state(per_rank["rng"])


def latest_training_checkpoint(path: Path) -> Path | None:
    """``path`` itself, or the newest finished checkpoint under a run directory."""
    if (path / "complete.json").is_file():
        return path
    candidates = sorted(
        p for p in (path / "checkpoints").glob("step_*") if (p / "complete.json").is_file()
    )
    return candidates[-1] if candidates else None


def resolve_init(cfg: PretrainConfig) -> tuple[str, Path] | None:
    """What ``model.init_from`` points at: ("checkpoint", dir) or ("hf", dir); checked
    before anything is built."""
    if not cfg.model.init_from:
        return None
    source = Path(cfg.model.init_from)
    checkpoint = latest_training_checkpoint(source) if source.is_dir() else None
    if checkpoint is not None:
        return "checkpoint", checkpoint
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"model.init_from {source} is neither a pretraining run, a "
            f"checkpoint, nor an HF model directory"
        )
    if cfg.model.init_optimizer:
        raise ValueError(
            "model.init_optimizer needs a training checkpoint in init_from, "
            f"and {source} is an HF model directory"
        )
    return "hf", source


def initialise(cfg: PretrainConfig, init: tuple[str, Path], strategy: Strategy) -> None:
    """Weights (and with ``model.init_optimizer`` the optimizer state) from
    ``model.init_from``; the optimizer keeps this phase's own peak learning rate."""
    kind, checkpoint = init
    if kind == "hf":
        load_weights(strategy.model, checkpoint)
        return
    shared = load_file(checkpoint / "shared.pt")
    strategy.model.load_state_dict(shared["model"])
    if cfg.model.init_optimizer:
        comm = strategy.comm
        rank_file = checkpoint / f"rank{comm.rank:05d}.pt"
        meta = json.loads((checkpoint / "complete.json").read_text())
        per_rank = None
        if meta["world_size"] == comm.world_size and rank_file.is_file():
            per_rank = load_file(rank_file)
        strategy.load_state_dict(shared, per_rank, same_run=False)
        for group in strategy.optimizer.param_groups:
            group["lr"] = cfg.optimizer.lr
            group["initial_lr"] = cfg.optimizer.lr


def export_hf(model, tokenizer_dir: Path, out: Path, summary: dict) -> None:
    """The trained model and its tokenizer in HF format (``from_pretrained`` loads both)."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    atomic_write_json(tmp / "pretrain_summary.json", summary)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


# ----------------------------------------------------------------------------- resume changes
def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _covered(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def _resolved(config: dict) -> dict:
    """``config`` with the fields whose null stands for a value replaced by that value, so
    a config written when the field had that value as its default reads the same
    (``strategy.outer_lr``: 1.0 before DiLoCo made it null)."""
    strategy = config.get("strategy")
    if not isinstance(strategy, dict) or strategy.get("outer_lr", 0) is not None:
        return config
    name = strategy.get("name", "auto")
    return {**config, "strategy": {**strategy, "outer_lr": default_outer_lr(name)}}


def resume_changes(recorded: dict, current: dict, allowed=()) -> tuple[dict, dict]:
    """(allowed, refused) changes between the config a run recorded and the one resuming
    it, each ``{key: [recorded, current]}``. Keys the recorded config lacks (written before
    the field existed) and the keys of :data:`RESUME_MAY_CHANGE` are not changes."""
    old, new = _flatten(_resolved(recorded)), _flatten(_resolved(current))
    ok, refused = {}, {}
    for key, value in new.items():
        if key not in old or _covered(key, RESUME_MAY_CHANGE):
            continue
        before = old[key]
        if isinstance(before, list | tuple) and isinstance(value, list | tuple):
            same = list(before) == list(value)
        else:
            same = before == value
        if not same:
            (ok if _covered(key, allowed) else refused)[key] = [before, value]
    return ok, refused


def check_resume_changes(recorded: dict, current: dict, allowed=()) -> dict:
    """The allowed changes; a :class:`ValueError` listing the others."""
    ok, refused = resume_changes(recorded, current, allowed)
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in refused.items())
        keys = ",".join(refused)
        raise ValueError(
            f"this resume changes settings that alter the training trajectory ({listed}); "
            f"restore them, start a new run_dir (or a new phase with model.init_from), or "
            f"allow them with resume.allow_changes=[{keys}]"
        )
    return ok
