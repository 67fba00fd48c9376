"""Training checkpoints: atomic, per-rank where needed, verified on load, the last K kept.

A checkpoint is a directory ``step_00001234/`` holding ``shared.pt`` (what all ranks have
in common: model, replicated optimizer state, loss scale; written by rank 0),
``rank00003.pt`` per rank (what differs: this rank's optimizer errors, RNG states) and
``complete.json`` (step, world size, size and sha256 of every file), written last. Ranks
write into ``step_00001234.tmp/``, which rank 0 renames into place once every rank is
done, so a crash leaves either the previous checkpoint or a ``.tmp`` directory that is
ignored.

On load, the newest checkpoint whose files all check out (size and sha256) on every rank
is used; a corrupt or partial one is skipped with a warning naming it. Files are read with
``torch.load(weights_only=True)``: a checkpoint holds tensors and plain Python values only,
so loading one cannot run code. When checkpoints exist but none is usable,
:meth:`CheckpointManager.load_latest` raises :class:`NoUsableCheckpoint` (listing them)
instead of letting the run silently start again from step 0.

Saving step ``S`` removes any checkpoint of a later step (left by a timeline that was
abandoned because none of them could be loaded) before keeping the newest ``keep_last``.
"""

from __future__ import annotations

import errno
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from onebit_bert.distributed.comm import Communicator
from onebit_bert.io import (
    NoSpaceError,
    atomic_open,
    atomic_write_json,
    free_space,
    sha256_file,
)

COMPLETE = "complete.json"
SHARED = "shared.pt"


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist, but none loads on every rank."""


def _step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _save(obj: Any, path: Path) -> None:
    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


WRITTEN_WORLD_SIZE = "written_world_size"
"""Key :meth:`CheckpointManager.load_latest` adds to the shared state: the number of ranks
that wrote the checkpoint."""


def _file_record(path: Path, device=None) -> torch.Tensor:
    """A file's sha256 (32 bytes) and size (8 bytes, little-endian) as a uint8 tensor."""
    digest = bytes.fromhex(sha256_file(path)) + path.stat().st_size.to_bytes(8, "little")
    return torch.tensor(list(digest), dtype=torch.uint8, device=device)


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
        """Collective: every rank calls it with its own ``per_rank`` state.

        A full device raises :class:`~onebit_bert.io.NoSpaceError` naming the file and the
        free space, before anything is written when the device has less room than the
        newest checkpoint takes; a failed save leaves no ``.tmp`` directory behind (rank 0
        removes it) and the checkpoints before it untouched."""
        tmp = self.directory / f"step_{step:08d}.tmp"
        try:
            return self._save_checkpoint(step, shared, per_rank, tmp)
        except BaseException:
            if self.comm.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _check_room(self, step: int) -> None:
        """:class:`NoSpaceError` when the device holds less free space than the newest
        checkpoint takes (a save would fill it mid-write)."""
        previous = self.checkpoints()
        if not previous:
            return
        needed = sum(f.stat().st_size for f in previous[-1].iterdir() if f.is_file())
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise NoSpaceError(
                errno.ENOSPC,
                f"no space left on device for checkpoint step {step} in {self.directory}: "
                f"{previous[-1].name} took {needed / 1e6:.1f} MB, and only "
                f"{free_space(self.directory)}; free space there or lower checkpoint.keep_last",
            )

    def _save_checkpoint(self, step: int, shared: dict, per_rank: dict, tmp: Path) -> Path:
        final = self.directory / f"step_{step:08d}"
        self._check_room(step)
        if self.comm.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.comm.barrier()
        own = tmp / _rank_file(self.comm.rank)
        _save(per_rank, own)
        mine = _file_record(own, self.comm.device)  # each rank hashes its own file, all at once
        every = torch.empty(
            self.comm.world_size, mine.numel(), dtype=torch.uint8, device=mine.device
        )
        with self.comm.traffic("statistics"):
            self.comm.all_gather(every, mine)  # also: every rank has written its file
        if self.comm.rank == 0:
            _save(shared, tmp / SHARED)
            files, sha256 = {}, {}
            for rank, record in enumerate(every.cpu()):
                name = _rank_file(rank)
                files[name] = int.from_bytes(bytes(record[32:].tolist()), "little")
                sha256[name] = bytes(record[:32].tolist()).hex()
            files[SHARED] = (tmp / SHARED).stat().st_size
            sha256[SHARED] = sha256_file(tmp / SHARED)
            atomic_write_json(
                tmp / COMPLETE,
                {
                    "step": step,
                    "world_size": self.comm.world_size,
                    "files": files,
                    "sha256": sha256,
                },
            )
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune(step)
        self.comm.barrier()
        return final

    def set_aside(self, step: int, why: str) -> Path | None:
        """Rename the checkpoint of ``step`` to ``<why>_step_XXXXXXXX`` (kept for a look, never
        loaded or pruned); returns the new path, or None when there is no such checkpoint."""
        path = self.directory / f"step_{step:08d}"
        if not path.is_dir():
            return None
        target = self.directory / f"{why}_{path.name}"
        if target.exists():
            shutil.rmtree(target)
        path.rename(target)
        return target

    def _prune(self, step: int) -> None:
        """After saving ``step``: drop checkpoints of later steps (an abandoned timeline),
        then all but the newest ``keep_last``."""
        kept = []
        for path in self.checkpoints():
            if _step_of(path) > step:
                warnings.warn(f"removing {path}: later than the step just saved", stacklevel=3)
                shutil.rmtree(path, ignore_errors=True)
            else:
                kept.append(path)
        for old in kept[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _check(self, path: Path) -> tuple[dict, dict | None] | None:
        """This rank's view of one checkpoint: (shared, per_rank) or None if unusable."""
        try:
            meta = json.loads((path / COMPLETE).read_text())
            names = [SHARED]
            if meta["world_size"] == self.comm.world_size:
                names.append(_rank_file(self.comm.rank))
            for name in meta["files"]:
                if (path / name).stat().st_size != meta["files"][name]:
                    raise OSError(f"{name} has the wrong size")
            for name in names:
                expected = meta.get("sha256", {}).get(name)
                if expected is None:
                    raise OSError(f"{COMPLETE} has no checksum for {name} (an older format)")
                if sha256_file(path / name) != expected:
                    raise OSError(f"{name} does not match its sha256 (corrupted)")
            shared = load_file(path / SHARED)
            shared[WRITTEN_WORLD_SIZE] = meta["world_size"]
            per_rank = load_file(path / names[1]) if len(names) > 1 else None
            return shared, per_rank
        except Exception as err:  # any unreadable piece makes the checkpoint unusable
            warnings.warn(
                f"checkpoint {path} is unusable ({type(err).__name__}: {err}); trying an older one",
                stacklevel=3,
            )
            return None

    def load_latest(self, allow_restart: bool = False) -> tuple[int, dict, dict | None] | None:
        """Collective: (step, shared, per_rank) of the newest checkpoint usable on every
        rank, or None when there is none. ``per_rank`` is None when it was saved by a
        different world size. Checkpoints that exist but none of which is usable raise
        :class:`NoUsableCheckpoint`, unless ``allow_restart``."""
        candidates = self.checkpoints()
        for path in reversed(candidates):
            found = self._check(path)
            ok = torch.tensor([0.0 if found is None else 1.0], device=self.comm.device)
            self.comm.all_reduce(ok, op="min")
            if ok.item() == 1.0 and found is not None:
                step = json.loads((path / COMPLETE).read_text())["step"]
                return step, found[0], found[1]
        if candidates and not allow_restart:
            raise NoUsableCheckpoint(
                f"none of the checkpoints in {self.directory} can be loaded "
                f"({', '.join(p.name for p in candidates)}; the warnings above say why). "
                f"Restore one, or set checkpoint.allow_restart=true to start again from "
                f"step 0 (later checkpoints are then replaced)"
            )
        return None


def load_file(path: Path) -> Any:
    """A checkpoint file, on CPU, with ``weights_only=True`` (tensors and plain values)."""
    return torch.load(path, map_location="cpu", weights_only=True)
