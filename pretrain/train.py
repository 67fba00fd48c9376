"""The pretraining loop: setup → (resume) → steps → checkpoints → HF export.

One step: forward/backward over this rank's micro-batches → gradient sync (unless the
optimizer synchronises by itself) → loss-scale check → clip → optimizer step → schedule.
The loop only asks the optimizer ``syncs_internally``; it knows nothing else about it.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from onebit_bert.checkpoint import CheckpointManager
from onebit_bert.config import save_config, to_dict
from onebit_bert.distributed.env import DistContext
from onebit_bert.distributed.netdev import InterfaceCounter, resolve_interface
from onebit_bert.io import atomic_write_json
from onebit_bert.metrics_log import MetricsLogger
from onebit_bert.optim.build import build_optimizer, syncs_internally
from onebit_bert.precision import LossScaler, autocast, resolve_precision
from onebit_bert.shards import PretrainingShards
from pretrain.config import PretrainConfig
from pretrain.data import BatchSchedule, TokenIds, make_batch
from pretrain.model import PretrainingLoss, build_model, load_weights, untrained_position_rows
from pretrain.schedule import lr_multiplier

STAT_KEYS = (
    "mlm_loss_sum",
    "mlm_tokens",
    "mlm_correct",
    "nsp_loss_sum",
    "nsp_examples",
    "nsp_correct",
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


class GradSync:
    """Gradient averaging across ranks: DDP (overlapped with backward, on GPUs) or one
    bucketed all-reduce after the last micro-batch (exact byte and time accounting)."""

    def __init__(self, loss_module: torch.nn.Module, ctx: DistContext, use_ddp: bool):
        self.ctx = ctx
        self.ddp = None
        self.module = loss_module
        if ctx.world_size > 1 and use_ddp:
            self.ddp = DistributedDataParallel(
                loss_module,
                device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,
                gradient_as_bucket_view=True,
            )
            self.ddp.register_comm_hook(None, ctx.comm.ddp_comm_hook())
            self.module = self.ddp

    def context(self, sync: bool):
        """Around one micro-batch's forward/backward: DDP skips its all-reduce unless this
        micro-batch completes a synchronised step."""
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def after_backward(self, sync: bool, params: list[torch.nn.Parameter]) -> None:
        if sync and self.ddp is None and self.ctx.world_size > 1:
            self.ctx.comm.all_reduce_coalesced([p.grad for p in params if p.grad is not None])


def _seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _token_ids(shards: PretrainingShards) -> tuple[TokenIds, Path]:
    from transformers import AutoTokenizer

    tokenizer_dir = shards.tokenizer_dir
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{tokenizer_dir} has no tokenizer.json: the prepared data "
            f"is incomplete, run data_prep again"
        )
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return TokenIds(
        tok.cls_token_id, tok.sep_token_id, tok.pad_token_id, tok.mask_token_id, len(tok)
    ), tokenizer_dir


def _latest_training_checkpoint(path: Path) -> Path | None:
    """``path`` itself, or the newest finished checkpoint under a run directory."""
    if (path / "complete.json").is_file():
        return path
    candidates = sorted(
        p for p in (path / "checkpoints").glob("step_*") if (p / "complete.json").is_file()
    )
    return candidates[-1] if candidates else None


def _to_device(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in batch.items()}


def train(cfg: PretrainConfig, ctx: DistContext) -> dict:
    """Run (or resume) the phase; returns the final summary (also in run_dir)."""
    comm, device, rank = ctx.comm, ctx.device, ctx.rank
    accumulation = cfg.batch_plan(ctx.world_size)
    if cfg.seed < 0:
        raise ValueError("seed must be >= 0")
    train_rows = PretrainingShards(cfg.data.path, "train")
    val_rows = PretrainingShards(cfg.data.path, "validation")
    seq_length = train_rows.seq_length
    if seq_length > cfg.model.max_position_embeddings:
        raise ValueError(
            f"data has sequence length {seq_length} but the model has "
            f"{cfg.model.max_position_embeddings} positions"
        )
    ids, tokenizer_dir = _token_ids(train_rows)
    interface = resolve_interface(cfg.logging.net_interface)
    net = InterfaceCounter(interface) if interface is not None else None
    schedule = BatchSchedule(
        len(train_rows),
        cfg.batch.global_batch_size,
        cfg.batch.micro_batch_size,
        accumulation,
        ctx.world_size,
        cfg.seed,
    )
    max_predictions = cfg.data.max_predictions_per_seq or round(0.15 * seq_length)
    init = _resolve_init(cfg)
    run_dir = Path(cfg.run_dir)
    precision = resolve_precision(cfg.precision, device)

    _seed_everything(cfg.seed, 0)  # identical initial weights on every rank
    model = build_model(cfg.model, ids.vocab_size, ids.pad).to(device)
    _seed_everything(cfg.seed, rank)  # different dropout per rank
    loss_module = PretrainingLoss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(
        cfg.optimizer, model, comm, untrained_position_rows(model, seq_length)
    )
    checkpoints = CheckpointManager(run_dir / "checkpoints", comm, cfg.checkpoint.keep_last)
    resumed = checkpoints.load_latest()
    if resumed is None and init is not None:
        _initialise(cfg, init, model, optimizer, comm)
    # Built after any inherited optimizer state, so this phase's schedule starts at step 0.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(cfg.schedule, s)
    )
    scaler = LossScaler(precision, comm)

    start_step = 0
    if resumed is not None:
        start_step, shared, per_rank = resumed
        model.load_state_dict(shared["model"])
        optim_state = dict(shared["optimizer"])
        optim_state["per_rank"] = (per_rank or {}).get("optimizer")
        optimizer.load_state_dict(optim_state)
        scheduler.load_state_dict(shared["scheduler"])
        scaler.load_state_dict(shared["scaler"])
        if per_rank is not None:
            _set_rng_state(per_rank["rng"])
        else:
            warnings.warn(
                "resuming with a different world size: per-rank RNG and optimizer "
                "errors start fresh",
                stacklevel=2,
            )
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        atomic_write_json(run_dir / "status.json", {"state": "running", "step": start_step})

    use_ddp = cfg.grad_sync == "ddp" or (cfg.grad_sync == "auto" and device.type == "cuda")
    grad_sync = GradSync(loss_module, ctx, use_ddp=use_ddp)
    logger = MetricsLogger(run_dir, ctx.is_main, cfg.logging, config=to_dict(cfg))
    preemption = Preemption()
    tokens_per_step_estimate = cfg.batch.global_batch_size * seq_length
    state = "complete"
    last_saved = start_step
    step = start_step
    started = time.perf_counter()
    try:
        while step < cfg.schedule.max_steps:
            t0 = time.perf_counter()
            comm_before = comm.snapshot()
            net_before = net.snapshot() if net is not None else None
            sync_by_caller = not syncs_internally(optimizer)
            totals = torch.zeros(len(STAT_KEYS) + 2, device=device, dtype=torch.float64)
            micro = schedule.micro_indices(step, rank)
            for a, (k, rows) in enumerate(micro):
                batch = _to_device(
                    make_batch(
                        train_rows,
                        rows,
                        ids,
                        cfg.seed,
                        step,
                        k,
                        cfg.data.mlm_probability,
                        max_predictions,
                        cfg.data.mask_prob,
                        cfg.data.random_prob,
                    ),
                    device,
                )
                sync_now = sync_by_caller and a == len(micro) - 1
                with grad_sync.context(sync_now):
                    with autocast(precision, device):
                        loss, stats = grad_sync.module(**batch)
                    scaler.scaled(loss / accumulation).backward()
                for i, key in enumerate(STAT_KEYS):
                    if key in stats:
                        totals[i] += stats[key].double()
                totals[-2] += float(batch["attention_mask"].sum())
            t1 = time.perf_counter()
            grad_sync.after_backward(sync_by_caller, params)
            t2 = time.perf_counter()
            ok = scaler.unscale_and_check(params)
            grad_norm = float("nan")
            if ok:
                if cfg.clip_grad_norm > 0:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm))
                optimizer.step()
            scaler.update(ok)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            comm_step = comm.snapshot() - comm_before
            net_step = net.snapshot() - net_before if net is not None else None
            step += 1
            # One small all-reduce carries the step's statistics and the stop requests.
            totals[-1] = 1.0 if preemption.requested else 0.0
            comm.all_reduce(totals, op="sum")
            preempted = totals[-1].item() > 0
            if step % cfg.logging.every == 0 or step == cfg.schedule.max_steps:
                logger.log(
                    step,
                    _step_metrics(
                        totals,
                        optimizer,
                        scheduler,
                        scaler,
                        grad_norm,
                        t0,
                        t1,
                        t2,
                        t3,
                        comm_step,
                        net_step,
                        cfg.batch.global_batch_size,
                    ),
                )
            if step % cfg.logging.progress_every == 0:
                logger.progress(
                    _progress_line(
                        step,
                        start_step,
                        cfg.schedule.max_steps,
                        started,
                        totals,
                        tokens_per_step_estimate,
                    )
                )
            if cfg.data.validation_every and step % cfg.data.validation_every == 0:
                logger.log(
                    step, validate(cfg, loss_module, val_rows, ids, max_predictions, ctx, precision)
                )
            stop = preempted or (cfg.stop_after is not None and step - start_step >= cfg.stop_after)
            if step % cfg.checkpoint.every == 0 or stop or step == cfg.schedule.max_steps:
                _save(checkpoints, step, model, optimizer, scheduler, scaler)
                last_saved = step
            if stop:
                state = "preempted" if preempted else "stopped"
                break
    finally:
        preemption.restore()
    validated = cfg.data.validation_every and step % cfg.data.validation_every == 0
    if state == "complete" and not validated:
        logger.log(step, validate(cfg, loss_module, val_rows, ids, max_predictions, ctx, precision))
    summary = {
        "state": state,
        "step": step,
        "last_checkpoint": last_saved,
        "precision": precision,
        "world_size": ctx.world_size,
        "accumulation": accumulation,
        "seq_length": seq_length,
    }
    if rank == 0:
        if state == "complete":
            export_hf(model, tokenizer_dir, run_dir / "final", summary)
        atomic_write_json(run_dir / "status.json", summary)
    logger.close()
    comm.barrier()
    return summary


def _resolve_init(cfg: PretrainConfig) -> tuple[str, Path] | None:
    """What ``model.init_from`` points at: ("checkpoint", dir) or ("hf", dir); checked
    before anything is built."""
    if not cfg.model.init_from:
        return None
    source = Path(cfg.model.init_from)
    checkpoint = _latest_training_checkpoint(source) if source.is_dir() else None
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


def _initialise(cfg: PretrainConfig, init: tuple[str, Path], model, optimizer, comm) -> None:
    """Weights (and optionally optimizer state) from ``model.init_from``."""
    kind, checkpoint = init
    if kind == "hf":
        load_weights(model, checkpoint)
        return
    shared = torch.load(checkpoint / "shared.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(shared["model"])
    if cfg.model.init_optimizer:
        rank_file = checkpoint / f"rank{comm.rank:05d}.pt"
        meta = json.loads((checkpoint / "complete.json").read_text())
        state = dict(shared["optimizer"])
        if meta["world_size"] == comm.world_size and rank_file.is_file():
            state["per_rank"] = torch.load(rank_file, map_location="cpu", weights_only=False).get(
                "optimizer"
            )
        optimizer.load_state_dict(state)
        for group in optimizer.param_groups:  # this phase's own peak learning rate
            group["lr"] = cfg.optimizer.lr
            group["initial_lr"] = cfg.optimizer.lr


def _save(checkpoints: CheckpointManager, step, model, optimizer, scheduler, scaler) -> None:
    optim_state = optimizer.state_dict()
    per_rank_optim = optim_state.pop("per_rank", None)
    shared = {
        "model": model.state_dict(),
        "optimizer": optim_state,
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
    }
    checkpoints.save(step, shared, {"optimizer": per_rank_optim, "rng": _rng_state()})


def _step_metrics(
    totals,
    optimizer,
    scheduler,
    scaler,
    grad_norm,
    t0,
    t1,
    t2,
    t3,
    comm_step,
    net_step,
    global_batch,
) -> dict:
    t = totals.tolist()
    stats = dict(zip(STAT_KEYS, t, strict=False))
    step_s = t3 - t0
    metrics = {
        "loss": stats["mlm_loss_sum"] / max(stats["mlm_tokens"], 1)
        + (stats["nsp_loss_sum"] / stats["nsp_examples"] if stats["nsp_examples"] else 0.0),
        "mlm_loss": stats["mlm_loss_sum"] / max(stats["mlm_tokens"], 1),
        "mlm_accuracy": stats["mlm_correct"] / max(stats["mlm_tokens"], 1),
        "lr": scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "samples_per_s": global_batch / step_s,
        "tokens_per_s": t[-2] / step_s,
        "step_seconds": step_s,
        "forward_backward_seconds": t1 - t0,
        "grad_sync_seconds": t2 - t1,
        "optimizer_seconds": t3 - t2,
        "comm_bytes": comm_step.bytes_sent,
        "comm_seconds": comm_step.seconds,
        "loss_scale": scaler.scale,
        "skipped_steps": scaler.skipped_steps,
        "stage": getattr(optimizer, "stage", "full"),
    }
    if net_step is not None:
        metrics.update(net_tx_bytes=net_step.tx, net_rx_bytes=net_step.rx)
    if stats["nsp_examples"]:
        metrics["nsp_loss"] = stats["nsp_loss_sum"] / stats["nsp_examples"]
        metrics["nsp_accuracy"] = stats["nsp_correct"] / stats["nsp_examples"]
    # per-layer values, as min/mean/max: r (c·f after 1-bit LAMB's switch), and the factor f
    for prefix, attr in (("trust_ratio", "last_trust_ratios"), ("factor", "last_factors")):
        values = getattr(optimizer, attr, None)
        if values is not None and len(values):
            metrics[f"{prefix}_min"] = float(values.min())
            metrics[f"{prefix}_mean"] = float(values.mean())
            metrics[f"{prefix}_max"] = float(values.max())
    error = getattr(optimizer, "last_compression_error", None)
    if error is not None:
        metrics["compression_error"] = float(error)
    return metrics


def _progress_line(step, start_step, max_steps, started, totals, tokens_estimate) -> str:
    elapsed = time.perf_counter() - started
    rate = (step - start_step) / elapsed if elapsed > 0 else 0.0
    eta = (max_steps - step) / rate if rate > 0 else math.inf
    mlm = totals[0].item() / max(totals[1].item(), 1)
    return (
        f"step {step}/{max_steps}  mlm_loss {mlm:.4f}  {rate:.3f} steps/s  "
        f"{rate * tokens_estimate / 1e3:.1f}k tok/s  eta {_hms(eta)}"
    )


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@torch.no_grad()
def validate(
    cfg: PretrainConfig,
    loss_module,
    val_rows: PretrainingShards,
    ids: TokenIds,
    max_predictions: int,
    ctx: DistContext,
    precision: str,
) -> dict:
    """MLM and NSP accuracy on a fixed slice of the validation split (same masks every
    time), summed over ranks."""
    loss_module.eval()
    micro = cfg.batch.micro_batch_size
    totals = torch.zeros(len(STAT_KEYS), device=ctx.device, dtype=torch.float64)
    n_batches = min(cfg.data.validation_batches, len(val_rows) // (micro * ctx.world_size))
    for b in range(n_batches):
        k = b * ctx.world_size + ctx.rank
        rows = np.arange(k * micro, (k + 1) * micro)
        batch = _to_device(
            make_batch(
                val_rows,
                rows,
                ids,
                cfg.seed,
                -1,
                k,
                cfg.data.mlm_probability,
                max_predictions,
                cfg.data.mask_prob,
                cfg.data.random_prob,
            ),
            ctx.device,
        )
        with autocast(precision, ctx.device):
            _, stats = loss_module(**batch)
        for i, key in enumerate(STAT_KEYS):
            if key in stats:
                totals[i] += stats[key].double()
    ctx.comm.all_reduce(totals, op="sum")
    loss_module.train()
    s = dict(zip(STAT_KEYS, totals.tolist(), strict=True))
    out = {
        "val_mlm_loss": s["mlm_loss_sum"] / max(s["mlm_tokens"], 1),
        "val_mlm_accuracy": s["mlm_correct"] / max(s["mlm_tokens"], 1),
        "val_sequences": n_batches * micro * ctx.world_size,
    }
    if s["nsp_examples"]:
        out["val_nsp_accuracy"] = s["nsp_correct"] / s["nsp_examples"]
        out["val_nsp_loss"] = s["nsp_loss_sum"] / s["nsp_examples"]
    return out


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
