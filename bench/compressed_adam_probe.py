"""Where DeepSpeed-style compressed Adam blows up: one process, compression forced.

Trains the comparison's model on its data (a prepared pretraining config: model, data,
schedule) with :class:`~onebit_bert.optim.ZeroOneAdam` or
:class:`~onebit_bert.optim.OneBitAdam` on one process, the whole global batch per step
and the 1-bit all-reduce forced on (``force_compression``; its averaging over one rank
keeps the quantisation noise of the sign and scale). Every ``--every`` steps it prints the
step's kind, the training loss, the gradient norm and the three parameters that moved most
in that step (largest absolute change of one element); the last line is JSON with the
losses, the first step whose loss exceeded the previous minimum by ``--jump``, and the
largest single-step move of each parameter.

    python -m bench.compressed_adam_probe \\
        --config runs/compare/configs/pretrain_zero_one_adam-seed1_phase1.yaml --lr 1e-3

It shows which elements the 1-bit average throws: those whose own gradients, and so the
second moment ``v``, are small against the layer's (rare vocabulary rows, positions), and,
with ``--no-mask-untrained``, those with no gradient at all (``v = 0``).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from onebit_bert.config import load_config
from onebit_bert.optim import OneBitAdam, ZeroOneAdam
from onebit_bert.shards import PretrainingShards
from pretrain.config import PretrainConfig
from pretrain.data import BatchSchedule, make_batch, to_device
from pretrain.model import PretrainingLoss, build_model
from pretrain.schedule import lr_multiplier
from pretrain.startup import token_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compressed_adam_probe")
    parser.add_argument("--config", required=True, help="a pretraining config (data prepared)")
    parser.add_argument("--optimizer", choices=["zero_one_adam", "onebit_adam"],
                        default="zero_one_adam")  # fmt: skip
    parser.add_argument("--steps", type=int, default=130)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--var-update-scaler", type=int, default=16, help="0/1 Adam's kappa")
    parser.add_argument("--every", type=int, default=10, help="print every N steps")
    parser.add_argument("--jump", type=float, default=1.0, help="loss rise that counts")
    parser.add_argument("--no-mask-untrained", action="store_true")
    args = parser.parse_args(argv)

    cfg = load_config(PretrainConfig, args.config, [])
    torch.set_num_threads(1)
    rows = PretrainingShards(cfg.data.path, "train")
    ids = token_ids(rows)
    batch = cfg.batch.global_batch_size
    schedule = BatchSchedule(len(rows), batch, batch, 1, 1, cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, ids.vocab_size, ids.pad)
    loss_fn = PretrainingLoss(model)
    names = {p: n for n, p in model.named_parameters()}
    o = cfg.optimizer
    common = dict(lr=args.lr, weight_decay=o.weight_decay, force_compression=True)
    if args.optimizer == "zero_one_adam":
        opt = ZeroOneAdam(
            model.parameters(),
            var_freeze_step=o.var_freeze_step,
            var_update_scaler=args.var_update_scaler,
            local_step_scaler=o.local_step_scaler,
            **common,
        )
    else:
        opt = OneBitAdam(model.parameters(), freeze_step=o.freeze_step, **common)
    opt.mask_untrained = not args.no_mask_untrained
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(cfg.schedule, s))
    losses, largest, first_jump, best = [], {}, None, math.inf
    for step in range(args.steps):
        ((k, micro_rows),) = schedule.micro_indices(step, 0)
        raw = make_batch(rows, micro_rows, ids, cfg.data, seed=cfg.seed, step=step, micro=k)
        loss, _ = loss_fn(**to_device(raw, torch.device("cpu")))
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm
                                                         or math.inf))  # fmt: skip
        before = {p: p.detach().clone() for p in model.parameters()}
        kind = getattr(opt, "next_step_kind", None) or ("warmup" if not opt.syncs_internally
                                                        else "compression")  # fmt: skip
        opt.step()
        lr_schedule.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        losses.append(value)
        if first_jump is None and value > best + args.jump:
            first_jump = step + 1
        best = min(best, value)
        moves = {names[p]: float((p.detach() - before[p]).abs().max()) for p in before}
        for name, move in moves.items():
            largest[name] = max(largest.get(name, 0.0), move)
        if (step + 1) % args.every == 0 or step == 0:
            top = sorted(moves.items(), key=lambda kv: -kv[1])[:3]
            moved = ", ".join(f"{n} {m:.3g}" for n, m in top)
            print(f"step {step + 1} {kind} loss {value:.3f} grad_norm {grad_norm:.3g} | {moved}",
                  flush=True)  # fmt: skip
    print(json.dumps({
        "optimizer": args.optimizer, "lr": args.lr, "steps": args.steps,
        "var_update_scaler": args.var_update_scaler,
        "mask_untrained": opt.mask_untrained, "first_loss_jump_step": first_jump,
        "min_loss": min(losses), "final_loss": losses[-1],
        "largest_step_move": dict(sorted(largest.items(), key=lambda kv: -kv[1])[:6]),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
