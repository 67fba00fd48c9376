"""The pretraining loop, in three parts (as torchtitan's trainer): :meth:`Trainer.__init__`
sets up data, model, strategy, checkpoints and resume; :meth:`Trainer.train_step` runs one
optimizer step and returns a :class:`~pretrain.records.StepRecord`; :meth:`Trainer.run`
logs, validates, checkpoints and stops.

One step: the strategy says what happens to its gradients (a full-precision average, the
optimizer's own communication, or none; logged as ``grad_sync``) → forward/backward over
this rank's micro-batches → the strategy's gradient sync → loss-scale check → clipping →
the strategy's optimizer step → schedule → the strategy's after-step hook. The loop never
asks which optimizer or strategy it runs.

What the constructor checks and reads before the first step (the run lock, the shards'
checksums, the changes a resume allows) is :mod:`pretrain.startup`'s; what the loop measures
between steps (validation, finite weights) is :mod:`pretrain.evaluation`'s.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from onebit_bert.checkpoint import CheckpointManager, NoUsableCheckpoint
from onebit_bert.config import save_config, to_dict
from onebit_bert.distributed.env import DistContext
from onebit_bert.distributed.netdev import InterfaceCounter, resolve_interface
from onebit_bert.metrics_log import MetricsLogger
from onebit_bert.optim.registry import optimizer_spec
from onebit_bert.precision import LossScaler, autocast, resolve_precision
from onebit_bert.run_lock import RunLock, RunLocked
from onebit_bert.shards import PretrainingShards, ShardFormatError
from onebit_bert.strategies import build_strategy
from onebit_bert.timing import PENDING, DeviceClock, resolve_pending
from pretrain import checkpointing, outputs
from pretrain.config import PretrainConfig
from pretrain.data import BatchSchedule, Prefetcher, make_batch
from pretrain.evaluation import validate, weights_finite
from pretrain.model import PretrainingLoss, build_model, compile_body, untrained_position_rows
from pretrain.records import (
    BAD_STEP,
    STAT_KEYS,
    STEP_TOTALS,
    STOP_REQUESTED,
    TOKENS,
    LossSpikeWatch,
    StepRecord,
    progress_line,
)
from pretrain.schedule import lr_multiplier
from pretrain.startup import (
    Preemption,
    lead_shortfall,
    previous_timings,
    resume_changes,
    take_run_lock,
    token_ids,
    verify_shards,
)


class TrainingDiverged(RuntimeError):
    """The run stopped because its loss or gradients stopped being finite, or its loss
    blew up far above its recent level."""


def single_process_notes(cfg: PretrainConfig, world_size: int) -> list[str]:
    """What a compressing optimizer does differently on one process (nothing to compress):
    warned at start and kept in ``status.json``'s ``notes``."""
    name = cfg.optimizer.name
    if world_size > 1 or not optimizer_spec(name).compressed or cfg.strategy.force_compression:
        return []
    what = "exact LAMB without bias correction" if name == "onebit_lamb" else "uncompressed"
    return [
        f"optimizer {name} on one process runs {what}: nothing is compressed, so this run "
        f"measures no compression; use 2+ processes, or strategy.force_compression=true"
    ]


class Trainer:
    """One pretraining phase on this rank: built (and resumed) by the constructor, run by
    :meth:`run`."""

    def __init__(self, cfg: PretrainConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.accumulation = cfg.batch_plan(ctx.world_size)
        self.lock = RunLock(cfg.run_dir) if ctx.rank == 0 else None
        # Signals are caught from here on (release() gives them back): a preemption that
        # arrives while the run is being built (resumed, its status written) is honoured at
        # the first step.
        self.preemption: Preemption | None = Preemption()
        try:
            take_run_lock(self.lock, ctx, cfg.run_dir)
            self._build()
        except BaseException as err:
            if isinstance(err, NoUsableCheckpoint | ShardFormatError) and ctx.rank == 0:
                # the last launch's word (stopped, preempted) no longer holds
                outputs.RunStatus(cfg.run_dir).fail(one_line(err), ctx.rank)
            self.release()
            raise

    def _build(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self._setup_data()
        init = checkpointing.resolve_init(cfg)
        self.run_dir = Path(cfg.run_dir)
        self.precision = resolve_precision(cfg.precision, ctx.device)
        self.clock = DeviceClock(ctx.device)
        """Phase and communication seconds on the device's clock (CUDA events on a GPU)."""
        if cfg.comm.overlap and self.precision == "fp16":
            raise ValueError(
                "comm.overlap folds gradients into the momentum during the backward pass, "
                "before fp16's loss scale is checked; use precision bf16 or fp32, or "
                "comm.overlap=false"
            )
        self._setup_model()
        self.checkpoints = CheckpointManager(
            outputs.checkpoints_dir(self.run_dir), ctx.comm, cfg.checkpoint.keep_last
        )
        resumed = self.checkpoints.load_latest(cfg.checkpoint.allow_restart)
        self.config_changes = resume_changes(cfg) if resumed is not None else {}
        if resumed is None and init is not None:
            checkpointing.initialise(cfg, init, self.strategy)
        # Built after any inherited optimizer state, so this phase's schedule starts at 0.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.strategy.optimizer, lambda s: lr_multiplier(cfg.schedule, s)
        )
        self.scaler = LossScaler(self.precision, ctx.comm)
        self.start_step = 0
        self.resumed = resumed is not None
        if resumed is not None:
            self.start_step = resumed[0]
        self.step = self.start_step
        """The step in progress (what a failure is recorded at)."""
        self.last_saved = self.start_step if self.resumed else None
        """The newest checkpoint of this run (None: none yet)."""
        if resumed is not None:
            self.start_step, shared, per_rank = resumed
            checkpointing.restore(shared, per_rank, self.strategy, self.scheduler, self.scaler)
            if per_rank is None:
                warnings.warn(
                    "resuming with a different world size: per-rank RNG and optimizer "
                    "errors start fresh",
                    stacklevel=2,
                )
        self.status = outputs.RunStatus(self.run_dir, is_writer=ctx.rank == 0)
        self.recipe = cfg.resolved_recipe()
        if ctx.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            recorded = dataclasses.replace(cfg, recipe=self.recipe)
            save_config(recorded, outputs.config_path(self.run_dir))
        notes = single_process_notes(cfg, ctx.world_size)
        self.save_seconds, self.step_seconds = (
            previous_timings(self.run_dir) if self.resumed else (None, None)
        )
        self._lead_warned = False
        short = self._lead_check()
        if short:
            notes.append(short)
        if self.config_changes:
            changed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in self.config_changes.items())
            notes.append(f"resumed with changes allowed by resume.allow_changes: {changed}")
        if self.lock is not None and self.lock.took_over:
            notes.append(f"took over the run lock of {self.lock.took_over}")
        for note in notes:
            warnings.warn(note, stacklevel=2)
        self.status.start(
            self.start_step,
            last_checkpoint=self.start_step if self.resumed else None,
            world_size=ctx.world_size,
            recipe=self.recipe,
            **({"notes": notes} if notes else {}),
            **({"save_seconds": self.save_seconds} if self.save_seconds is not None else {}),
            **({"step_seconds": self.step_seconds} if self.step_seconds is not None else {}),
        )
        self.logger = MetricsLogger(
            self.run_dir,
            ctx.is_main,
            cfg.logging,
            config=to_dict(cfg),
            resume_step=self.start_step if self.resumed else None,
        )
        if self.resumed:
            self.logger.progress(
                f"resuming from step {self.start_step} "
                f"({outputs.checkpoints_dir(self.run_dir) / f'step_{self.start_step:08d}'})"
            )
        if self.config_changes:
            self.logger.log(self.start_step, {"resume_changes": self.config_changes})

    def release(self) -> None:
        """Stop the batch prefetcher and give the run directory's lock back (rank 0; the
        others hold none)."""
        prefetcher = getattr(self, "prefetcher", None)
        if prefetcher is not None:
            prefetcher.close()
        if self.preemption is not None:
            self.preemption.restore()
            self.preemption = None
        if self.lock is not None:
            self.lock.release()

    def _setup_data(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.train_rows = PretrainingShards(cfg.data.path, "train")
        self.val_rows = PretrainingShards(cfg.data.path, "validation")
        self.seq_length = self.train_rows.seq_length
        if self.seq_length > cfg.model.max_position_embeddings:
            raise ValueError(
                f"data has sequence length {self.seq_length} but the model has "
                f"{cfg.model.max_position_embeddings} positions"
            )
        self.ids = token_ids(self.train_rows)
        if cfg.data.verify_shards:
            verify_shards((self.train_rows, self.val_rows), ctx)
        interface = resolve_interface(cfg.logging.net_interface)
        self.net = InterfaceCounter(interface) if interface is not None else None
        self.schedule = BatchSchedule(
            len(self.train_rows),
            cfg.batch.global_batch_size,
            cfg.batch.micro_batch_size,
            self.accumulation,
            ctx.world_size,
            cfg.seed,
        )
        self.prefetcher = Prefetcher(
            self._build_micro_batch, pin=ctx.device.type == "cuda", enabled=cfg.data.prefetch
        )

    def _build_micro_batch(self, rows: np.ndarray, step: int, micro: int) -> dict:
        """Micro-batch ``micro`` of global batch ``step`` (host arrays; the prefetcher's
        thread runs this, and nothing else reads ``train_rows`` while it lives)."""
        cfg = self.cfg
        return make_batch(
            self.train_rows, rows, self.ids, cfg.data, seed=cfg.seed, step=step, micro=micro
        )

    def _micro_batches(self, batch_index: int) -> list[tuple[tuple, tuple]]:
        """This rank's micro-batches of global batch ``batch_index`` as prefetcher jobs:
        ``((batch_index, k), (rows, step, micro))``."""
        return [
            ((batch_index, k), (rows, batch_index, k))
            for k, rows in self.schedule.micro_indices(batch_index, self.ctx.rank)
        ]

    def _setup_model(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        checkpointing.seed_everything(cfg.seed, 0)  # identical initial weights on every rank
        self.model = build_model(cfg.model, self.ids.vocab_size, self.ids.pad).to(ctx.device)
        compile_body(self.model, cfg.model.compile)
        checkpointing.seed_everything(cfg.seed, ctx.rank)  # different dropout per rank
        self.loss_module = PretrainingLoss(self.model)
        self.strategy = build_strategy(
            cfg.strategy,
            cfg.optimizer,
            self.model,
            self.loss_module,
            ctx,
            untrained_position_rows(self.model, self.seq_length),
            total_steps=cfg.schedule.max_steps,
            comm_cfg=cfg.comm,
            clip_grad_norm=cfg.clip_grad_norm,
        )

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> StepRecord:
        """Optimizer step ``step`` on this rank; statistics summed over ranks with the stop
        requests (SIGUSR1/SIGTERM seen by any rank) in the same all-reduce.

        Steps are numbered from 1 everywhere (this method, the strategy hooks, the logs,
        the checkpoints, ``schedule.max_steps``): step N is the N-th optimizer step. Only
        the data schedule counts its batches from 0 (``step - 1``)."""
        cfg, ctx, comm, strategy = self.cfg, self.ctx, self.ctx.comm, self.strategy
        clock, pending_before = self.clock, len(PENDING)
        marks = [clock.mark()]  # start, backward done, gradients synced, end
        grad_sync = strategy.gradient_sync()  # the strategy's hooks act on the same answer
        comm_before, intra_before = comm.snapshot(), comm.intra_stats.copy()
        net_before = self.net.snapshot() if self.net is not None else None
        # every STEP_TOTALS entry, summed over ranks in one all-reduce
        totals = torch.zeros(len(STEP_TOTALS), device=ctx.device, dtype=torch.float64)
        batch_index = step - 1
        micro = self._micro_batches(batch_index)
        # the batch after this step's last one is built while that one trains
        following = self._micro_batches(step)[0] if step < cfg.schedule.max_steps else None
        for a, (key, args) in enumerate(micro):
            then = micro[a + 1] if a + 1 < len(micro) else following
            raw, tensors = self.prefetcher.get(key, args, then)
            batch = {k: t.to(ctx.device, non_blocking=True) for k, t in tensors.items()}
            with strategy.backward_context(a == len(micro) - 1):
                with autocast(self.precision, ctx.device):
                    loss, stats = strategy.forward_module(**batch)
                self.scaler.scaled(loss / self.accumulation).backward()
            for i, key in enumerate(STAT_KEYS):
                if key in stats:
                    totals[i] += stats[key].double()
            totals[TOKENS] += float(raw["attention_mask"].sum())  # host copy: no GPU sync
        marks.append(clock.mark())
        strategy.after_backward()
        marks.append(clock.mark())
        ok = self.scaler.unscale_and_check(strategy.params)
        grad_norm = float("nan")
        bad_grads = not ok and self.scaler.scale <= 1.0  # overflow at the smallest scale
        if ok:
            if cfg.clip_grad_norm > 0:
                grad_norm = strategy.clip_gradients(cfg.clip_grad_norm)
                bad_grads = not math.isfinite(grad_norm)
            strategy.step()
        self.scaler.update(ok)
        with warnings.catch_warnings():
            # The lr is a function of the loop's step, advanced on every step: also on a
            # skipped (overflowed) step and under strategies whose update does not go
            # through optimizer.step() (decentlam, dmsgd), where torch would warn.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            self.scheduler.step()
        strategy.optimizer.zero_grad(set_to_none=True)
        strategy.after_step(step)
        marks.append(clock.mark())
        comm_step = comm.snapshot() - comm_before
        pending_step = len(PENDING)
        intra_step = comm.intra_stats.copy() - intra_before
        net_step = self.net.snapshot() - net_before if self.net is not None else None
        stop_requested = self.preemption is not None and self.preemption.requested
        totals[BAD_STEP] = 1.0 if bad_grads else 0.0
        totals[STOP_REQUESTED] = 1.0 if stop_requested else 0.0
        with comm.traffic("statistics"):
            comm.all_reduce(totals, op="sum")
        values = totals.tolist()  # the step's wait for the device: its events are done
        t0, t1, t2, t3 = (clock.seconds(marks[0], m) for m in marks)
        resolved = resolve_pending(since=pending_before, upto=pending_step)
        for kind, seconds in resolved.get(id(comm.stats), {}).items():
            comm_step.add_seconds(kind, seconds)
        stats = dict(zip(STAT_KEYS, values, strict=False))
        bad = None
        if not (math.isfinite(stats["mlm_loss_sum"]) and math.isfinite(stats["nsp_loss_sum"])):
            bad = "non-finite loss"
        elif values[BAD_STEP] > 0:
            bad = "non-finite gradient norm" if ok else "fp16 overflow at loss scale 1"
        return StepRecord(
            stats=stats,
            tokens=values[TOKENS],
            grad_norm=grad_norm,
            t_start=t0,
            t_backward_done=t1,
            t_sync_done=t2,
            t_end=t3,
            comm=comm_step,
            net=net_step,
            preempted=values[STOP_REQUESTED] > 0,
            bad=bad,
            grad_sync=grad_sync,
            intra_node_bytes=intra_step.bytes_sent,
        )

    def step_metrics(self, record: StepRecord) -> dict:
        extra = {
            "clock": self.clock.name,
            "loss_scale": self.scaler.scale,
            "skipped_steps": self.scaler.skipped_steps,
            **self.strategy.metrics(),
        }
        lr = self.scheduler.get_last_lr()[0]
        return record.metrics(lr, self.cfg.batch.global_batch_size, extra)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        """Train to ``schedule.max_steps`` (or a stop); returns the summary (also in
        ``status.json``)."""
        cfg, log_cfg = self.cfg, self.cfg.logging
        max_steps, every_val = cfg.schedule.max_steps, cfg.data.validation_every
        tokens_per_step = cfg.batch.global_batch_size * self.seq_length
        if self.preemption is None:  # a second run() on this trainer
            self.preemption = Preemption()
        state, step, bad_run = "complete", self.start_step, 0
        loss_watch = LossSpikeWatch(cfg.divergence.loss_spike_factor, cfg.divergence.loss_window)
        last_saved = self.start_step if self.resumed else None
        started = time.perf_counter()
        try:
            while step < max_steps:
                step += 1
                self.step = step
                record = self.train_step(step)
                self.step_seconds = record.t_end - record.t_start
                if step % log_cfg.every == 0 or step == max_steps:
                    self.logger.log(step, self.step_metrics(record))
                if step % log_cfg.progress_every == 0:
                    self.logger.progress(
                        progress_line(
                            record, step, self.start_step, max_steps, started, tokens_per_step
                        )
                    )
                bad_run = bad_run + 1 if record.bad else 0
                if bad_run >= cfg.divergence.max_bad_steps:
                    self._diverged(step, f"{bad_run} bad steps in a row ({record.bad})", last_saved)
                spike = loss_watch.check(record.loss)
                if spike is not None:
                    self._diverged(step, spike, last_saved, spike=True)
                if every_val and step % every_val == 0:
                    self.logger.log(step, self.validate())
                stop = record.preempted or (
                    cfg.stop_after is not None and step - self.start_step >= cfg.stop_after
                )
                if step % cfg.checkpoint.every == 0 or stop or step == max_steps:
                    last_saved = step if self.save(step) else last_saved
                    self.last_saved = last_saved
                self.status.heartbeat(step, last_saved)
                if self.lock is not None:
                    self.lock.heartbeat()
                if stop:
                    state = "preempted" if record.preempted else "stopped"
                    break
        finally:
            self.preemption.restore()
            self.preemption = None
        if state == "complete" and not (every_val and step % every_val == 0):
            self.logger.log(step, self.validate())
        if state == "complete" and not self.model_is_finite():
            self._diverged(step, "the final weights are not finite", last_saved)
        return self._finish(state, step, last_saved)

    def model_is_finite(self) -> bool:
        """Whether the evaluation model's weights are finite on every rank (collective)."""
        return weights_finite(self.strategy.eval_model(), self.ctx)

    def save(self, step: int) -> bool:
        """Checkpoint ``step``, unless the weights are not finite (then warn, keep the
        previous checkpoints, and return False). The save time goes into ``status.json``
        and is checked against ``checkpoint.preemption_lead_s``."""
        self.strategy.drain()
        if not self.model_is_finite():
            warnings.warn(f"weights are not finite at step {step}: not checkpointed", stacklevel=2)
            return False
        started = time.perf_counter()
        checkpointing.save(self.checkpoints, step, self.strategy, self.scheduler, self.scaler)
        self.save_seconds = time.perf_counter() - started
        self.status.update(save_seconds=self.save_seconds, step_seconds=self.step_seconds)
        short = self._lead_check()
        if short and not self._lead_warned and self.ctx.is_main:  # rank 0 writes the most
            self._lead_warned = True
            warnings.warn(short, stacklevel=2)
            self.status.update(lead_warning=short)
        return True

    def _lead_check(self) -> str | None:
        lead = self.cfg.checkpoint.preemption_lead_s
        if lead is None or self.save_seconds is None:
            return None
        return lead_shortfall(lead, self.save_seconds, self.step_seconds or 0.0)

    def _diverged(self, step: int, cause: str, last_saved: int | None, spike: bool = False) -> None:
        """Stop: status ``diverged``, nothing saved or exported, :class:`TrainingDiverged`.

        A ``spike`` of step N's loss measures the weights after update N - 1: a checkpoint
        of step N - 1 holds the blow-up, so rank 0 moves it aside (to
        ``checkpoints/diverged_step_<N-1>``, which no resume loads) and names the one
        before it as the last good checkpoint."""
        if spike and last_saved is not None and last_saved == step - 1:
            if self.ctx.rank == 0:
                self.checkpoints.set_aside(last_saved, "diverged")
            self.ctx.comm.barrier()
            kept = self.checkpoints.checkpoints()
            last_saved = int(kept[-1].name.split("_", 1)[1]) if kept else None
        good = f"step {last_saved}" if last_saved is not None else "none"
        message = (
            f"training diverged at step {step}: {cause}; last good checkpoint: {good} "
            f"(lower optimizer.lr, raise schedule.warmup_proportion, or check the data)"
        )
        self.status.finish(outputs.DIVERGED, {"step": step, "last_checkpoint": last_saved})
        self.logger.close()
        self.ctx.comm.barrier()
        raise TrainingDiverged(message)

    def _finish(self, state: str, step: int, last_saved: int | None) -> dict:
        self.strategy.drain()
        summary = {
            "state": state,
            "step": step,
            "last_checkpoint": last_saved,
            "precision": self.precision,
            "world_size": self.ctx.world_size,
            "accumulation": self.accumulation,
            "seq_length": self.seq_length,
        }
        if state == "complete":
            model = self.strategy.eval_model()  # collective for some strategies
        if self.ctx.rank == 0 and state == "complete":
            checkpointing.export_hf(
                model,
                self.train_rows.tokenizer_dir,
                outputs.final_dir(self.run_dir),
                summary,
            )
        self.status.finish(state, summary)
        self.logger.close()
        self.ctx.comm.barrier()
        return summary

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict:
        """MLM and NSP accuracy of the strategy's evaluation model on a fixed slice of the
        validation split (same masks every time), summed over ranks."""
        self.strategy.drain()
        model = self.strategy.eval_model()
        loss_module = self.loss_module if model is self.model else PretrainingLoss(model)
        return validate(loss_module, self.val_rows, self.ids, self.cfg, self.ctx, self.precision)


def one_line(err: BaseException, limit: int = 500) -> str:
    """``Type: message`` on one line (a collective library's multi-line text joined)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:limit]


def denormals_flushed() -> bool:
    """Whether every torch thread flushes subnormal floats to zero: a product that is
    subnormal unless flushed, over enough elements for torch to split it across its
    intra-op threads."""
    return not bool((torch.full((1 << 20,), 1e-30) * 1e-10).any())


def flush_denormals() -> None:
    """Flush subnormal floats to zero on every torch thread of this process
    (``PretrainConfig.flush_denormal``; ``python -m pretrain`` calls it at start-up). The
    CPU's flag is per thread, and torch's intra-op threads take it from the thread that
    starts them, so this must run before torch's first parallel operation; a CPU without the
    flag, or threads already started, is an error that says so."""
    if not torch.set_flush_denormal(True):
        raise ValueError(
            "flush_denormal: true, but this CPU cannot flush subnormal floats (it lacks "
            "SSE3); set flush_denormal: false"
        )
    if not denormals_flushed():
        torch.set_flush_denormal(False)
        raise ValueError(
            "flush_denormal: true, but torch's threads were started before it was set, so "
            "only some of them would flush; call pretrain.train.flush_denormals() before any "
            "torch operation (python -m pretrain does), or run with one thread"
        )


def train(cfg: PretrainConfig, ctx: DistContext) -> dict:
    """Run (or resume) the phase; returns the final summary (also in the run directory).
    A run that raises is marked ``failed`` in its status before the error propagates, by
    whichever rank failed first (:meth:`~pretrain.outputs.RunStatus.fail`): a rank whose
    collective broke because another rank left keeps that rank's message. With
    ``flush_denormal``, :func:`flush_denormals` must have run in this process."""
    if cfg.flush_denormal and not denormals_flushed():
        raise ValueError(
            "flush_denormal: true, but this process does not flush subnormal floats: call "
            "pretrain.train.flush_denormals() before any torch operation (python -m pretrain "
            "does)"
        )
    trainer = Trainer(cfg, ctx)
    try:
        return trainer.run()
    except (TrainingDiverged, RunLocked):
        raise
    except BaseException as err:
        trainer.status.fail(
            one_line(err),
            ctx.rank,
            step=trainer.step,
            last_checkpoint=trainer.last_saved,
        )
        raise
    finally:
        trainer.release()
