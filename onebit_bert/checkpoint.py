"""Training checkpoints: atomic, per-rank where needed, verified on load, the last K kept.

A checkpoint is a directory ``step_00001234/`` holding ``shared.pt`` (what all ranks have
in common: model, replicated optimizer state, loss scale; written by rank 0),
``rank00003.pt`` per rank (what differs: this rank's optimizer errors, RNG states) and
``complete.json`` (step, world size, file sizes), written last. Ranks write into
``step_00001234.tmp/``, which rank 0 renames into place once every rank is done, so a
crash leaves either the previous checkpoint or a ``.tmp`` directory that is ignored.

On load, the newest checkpoint whose files all check out on every rank is used; a corrupt
or partial one is skipped with a warning.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from onebit_bert.distributed.comm import Communicator
from onebit_bert.io import atomic_open, atomic_write_json

COMPLETE = "complete.json"
SHARED = "shared.pt"


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _save(obj: Any, path: Path) -> None:
    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


class CheckpointManager:
    """Save and restore training state under ``directory`` for the ranks of ``comm``."""

    def __init__(self, directory: str | Path, comm: Communicator, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.directory = Path(directory)
        self.comm = comm
        self.keep_last = keep_last

    def checkpoints(self) -> list[Path]:
        """Finished checkpoint directories, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(
            p for p in self.directory.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
        )

    def save(self, step: int, shared: dict, per_rank: dict) -> Path:
        """Collective: every rank calls it with its own ``per_rank`` state."""
        final = self.directory / f"step_{step:08d}"
        tmp = self.directory / f"step_{step:08d}.tmp"
        if self.comm.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.comm.barrier()
        _save(per_rank, tmp / _rank_file(self.comm.rank))
        if self.comm.rank == 0:
            _save(shared, tmp / SHARED)
        self.comm.barrier()
        if self.comm.rank == 0:
            files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
            atomic_write_json(
                tmp / COMPLETE, {"step": step, "world_size": self.comm.world_size, "files": files}
            )
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.comm.barrier()
        return final

    def _check(self, path: Path) -> tuple[dict, dict | None] | None:
        """This rank's view of one checkpoint: (shared, per_rank) or None if unusable."""
        try:
            meta = json.loads((path / COMPLETE).read_text())
            for name, size in meta["files"].items():
                if (path / name).stat().st_size != size:
                    raise OSError(f"{name} has the wrong size")
            shared = torch.load(path / SHARED, map_location="cpu", weights_only=False)
            per_rank = None
            if meta["world_size"] == self.comm.world_size:
                per_rank = torch.load(
                    path / _rank_file(self.comm.rank), map_location="cpu", weights_only=False
                )
            return shared, per_rank
        except Exception as err:  # any unreadable piece makes the checkpoint unusable
            warnings.warn(
                f"checkpoint {path} is unusable ({type(err).__name__}: {err}); trying an older one",
                stacklevel=3,
            )
            return None

    def load_latest(self) -> tuple[int, dict, dict | None] | None:
        """Collective: (step, shared, per_rank) of the newest checkpoint usable on every
        rank, or None. ``per_rank`` is None when it was saved by a different world size."""
        for path in reversed(self.checkpoints()):
            found = self._check(path)
            ok = torch.tensor([0.0 if found is None else 1.0], device=self.comm.device)
            self.comm.all_reduce(ok, op="min")
            if ok.item() == 1.0 and found is not None:
                step = json.loads((path / COMPLETE).read_text())["step"]
                return step, found[0], found[1]
        return None
