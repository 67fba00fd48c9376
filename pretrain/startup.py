"""What a pretraining phase checks and reads before its first step (the constructor of
:class:`~pretrain.train.Trainer`), and the signals and limits its loop watches.

- the run lock, taken by rank 0 and agreed by every rank (:func:`take_run_lock`);
- every shard against its sha256, the work spread over the ranks (:func:`verify_shards`);
- the tokenizer's special ids (:func:`token_ids`);
- on a resume, the config changes ``resume.allow_changes`` allows (:func:`resume_changes`)
  and the save and step seconds the last launch recorded (:func:`previous_timings`);
- whether ``checkpoint.preemption_lead_s`` covers a save (:func:`lead_shortfall`), and the
  preemption signals (:class:`Preemption`).
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import torch

from onebit_bert.config import read_config_file, to_dict
from onebit_bert.distributed.env import DistContext
from onebit_bert.run_lock import RunLock, RunLocked
from onebit_bert.shards import (
    PretrainingShards,
    ShardFormatError,
    damage_of,
    first_damaged_shard,
)
from pretrain import checkpointing, outputs
from pretrain.config import PretrainConfig
from pretrain.data import TokenIds


def take_run_lock(lock: RunLock | None, ctx: DistContext, run_dir: str | Path) -> None:
    """Rank 0 (the one with a ``lock``) takes the run directory's lock before anything is
    written; every rank stops with :class:`RunLocked` if another live launch holds it."""
    ok = torch.ones(1, device=ctx.device)
    error = None
    if lock is not None:
        try:
            lock.acquire()
        except RunLocked as err:
            error = err
            ok.zero_()
    with ctx.comm.traffic("statistics"):
        ctx.comm.all_reduce(ok, op="min")
    if error is not None:
        raise error
    if ok.item() == 0:
        raise RunLocked(
            f"{run_dir}: rank 0 could not take the run lock (its error names the launch "
            f"that holds it)"
        )


def verify_shards(splits: tuple[PretrainingShards, ...], ctx: DistContext) -> None:
    """Every shard of ``splits`` against the manifest's sha256, before any training, the
    work spread over the ranks (:func:`~onebit_bert.shards.first_damaged_shard`); one
    all-reduce tells every rank the first damaged one, so all stop with the same
    :class:`ShardFormatError` naming it."""
    none = sum(s.num_shards for s in splits)
    found = first_damaged_shard(splits, ctx.rank, ctx.world_size)
    first = torch.tensor([none if found is None else found], dtype=torch.float64, device=ctx.device)
    with ctx.comm.traffic("statistics"):
        ctx.comm.all_reduce(first, op="min")
    if int(first.item()) < none:
        raise ShardFormatError(damage_of(splits, int(first.item())))


def token_ids(shards: PretrainingShards) -> TokenIds:
    """The special token ids and vocabulary size of the prepared data's tokenizer."""
    from transformers import AutoTokenizer

    if not (shards.tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{shards.tokenizer_dir} has no tokenizer.json: the prepared data "
            f"is incomplete, run data_prep again"
        )
    tok = AutoTokenizer.from_pretrained(shards.tokenizer_dir)
    return TokenIds(
        tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.mask_token_id, len(tok)
    )


def resume_changes(cfg: PretrainConfig) -> dict:
    """On a resume, the changes ``resume.allow_changes`` allows against the run's recorded
    config; a :class:`ValueError` for any other change that alters the trajectory, before
    the checkpoint's state is restored or anything is written."""
    recorded = outputs.config_path(Path(cfg.run_dir))
    if not recorded.is_file():
        return {}
    previous = read_config_file(recorded)
    return checkpointing.check_resume_changes(previous, to_dict(cfg), cfg.resume.allow_changes)


def previous_timings(run_dir: Path) -> tuple[float | None, float | None]:
    """The save and step seconds the last launch of the run in ``run_dir`` recorded."""
    try:
        previous = outputs.read_status(run_dir) or {}
    except outputs.StatusUnreadable:
        return None, None
    return previous.get("save_seconds"), previous.get("step_seconds")


def lead_shortfall(lead_s: float, save_s: float, step_s: float) -> str | None:
    """The warning when a preemption lead of ``lead_s`` seconds cannot cover one step and
    a checkpoint save twice over (the rule of the cluster guide: lead >= 2 x save + step),
    else None. Twice the save: a loaded file system can be slower than the measured save."""
    needed = 2 * save_s + step_s
    if lead_s >= needed:
        return None
    return (
        f"checkpoint.preemption_lead_s is {lead_s:g} s, but a save took {save_s:.1f} s and "
        f"a step {step_s:.1f} s here: a preemption may kill the run before its checkpoint "
        f"is written; raise slurm.signal_lead to at least {math.ceil(needed)} s"
    )


class Preemption:
    """SIGUSR1/SIGTERM set a flag; the loop checks it (agreed by all ranks) between steps."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum, _frame):
        self.requested = True

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
