"""How consecutive steps line up: replay a few steps of a run from a kept checkpoint,
keeping the weights after every step.

Kept checkpoints are 250 steps apart, too far to see what one step does against the next.
This copies a run's resolved config and one checkpoint into a work directory, resumes it
there for ``steps`` steps with a checkpoint after each (a resume is exact, so these are the
run's own steps; the original run directory is only read), and from the weights
``w_0 … w_K`` it gives, for the whole model and per layer (parameter tensor):

* ``cos``: the mean cosine between consecutive updates ``Δ_t = w_{t+1} - w_t`` and
  ``Δ_{t+1}``; near 1 the steps go on in one direction, near -1 each step takes the last
  one back;
* ``efficiency``: ``‖w_K - w_0‖ / Σ_t ‖Δ_t‖``, the share of the path that is net progress;
* ``step``: the mean ‖Δ_t‖ (per layer also relative to ‖w_0‖, ``step_rel``).

With ``--loss`` it also evaluates the validation MLM loss (the run's own validation rows
and masks, summed as its ranks sum them) of ``w_0``, ``w_1`` and their mean: if each step
takes the last one back, the mean is the point the two oscillate around, and the loss it
gains over them is what the oscillation costs at that moment.

``python -m pipeline.reports.replay --run NAME=RUN_DIR ... --at 1500,3000 --steps 8 --out DIR``
writes ``replay.json`` into ``DIR`` (each replay's work directory is removed after it is
read, unless ``--keep``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from onebit_bert.checkpoint import COMPLETE, SHARED, load_file
from onebit_bert.io import atomic_write_json, atomic_write_text, read_json_object
from onebit_bert.shards import PretrainingShards
from pipeline.reports import cli
from pipeline.reports.mechanism import run_config
from pretrain.evaluation import validation_batch, validation_batch_count
from pretrain.model import PretrainingLoss, build_model
from pretrain.outputs import config_path
from pretrain.train import token_ids


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def world_size_of(checkpoint: Path) -> int:
    """How many ranks wrote ``checkpoint`` (its ``complete.json`` records it)."""
    record = read_json_object(checkpoint / COMPLETE, "not a finished checkpoint")
    if not isinstance(record.get("world_size"), int):
        raise ValueError(f"{checkpoint / COMPLETE} records no world_size: not a run checkpoint")
    return record["world_size"]


def replay(run_dir: Path, step: int, steps: int, work: Path) -> list[dict[str, torch.Tensor]]:
    """The weights at ``step`` and after each of the next ``steps`` steps of ``run_dir``,
    replayed in ``work`` (emptied first) on as many local ranks as wrote the checkpoint."""
    source = _step_dir(run_dir, step)
    if not (source / COMPLETE).is_file():
        raise FileNotFoundError(
            f"{source} is not a finished checkpoint of {run_dir}: pick a step from "
            f"{run_dir / 'checkpoints'}"
        )
    if steps < 2:
        raise ValueError(f"steps={steps}: at least 2 are needed to set one step against the next")
    if work.exists():
        shutil.rmtree(work)
    (work / "checkpoints").mkdir(parents=True)
    cfg = yaml.safe_load(config_path(run_dir).read_text())
    cfg["run_dir"] = str(work)
    config = work / "replay.yaml"
    atomic_write_text(config, yaml.safe_dump(cfg, sort_keys=False))
    shutil.copytree(source, _step_dir(work, step))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world_size_of(source)}", "-m", "pretrain", "--config", str(config),
        "checkpoint.every=1", f"checkpoint.keep_last={steps + 1}", f"stop_after={steps}",
        "data.validation_every=0", "logging.progress_every=1000000", "logging.wandb=false",
    ]  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])  # where `pretrain` imports from
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"replaying {steps} steps of {run_dir} from step {step} failed "
            f"(exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return [
        _distinct(load_file(_step_dir(work, s) / SHARED)["model"])
        for s in range(step, step + steps + 1)
    ]


def _distinct(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a state dict, each stored tensor once (a tied weight,
    the word embeddings and the MLM decoder, keeps its first name)."""
    seen, out = set(), {}
    for name, tensor in model.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.dtype.is_floating_point and key not in seen:
            seen.add(key)
            out[name] = tensor.float()
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float(a.flatten() @ b.flatten()) / (na * nb) if na and nb else 0.0


def _line_up(sequence: list[torch.Tensor]) -> dict:
    deltas = [b - a for a, b in zip(sequence[:-1], sequence[1:], strict=True)]
    path = sum(float(d.norm()) for d in deltas)
    cosines = [_cosine(a, b) for a, b in zip(deltas[:-1], deltas[1:], strict=True)]
    return {
        "cos": sum(cosines) / len(cosines),
        "efficiency": float((sequence[-1] - sequence[0]).norm()) / path if path else 1.0,
        "step": path / len(deltas),
    }


def update_statistics(weights: list[dict[str, torch.Tensor]]) -> dict:
    """How the consecutive updates of a sequence of weights (``weights[t]``: name ->
    tensor) line up: for the whole model (every tensor with more than one element,
    concatenated) and per layer (see the module docstring)."""
    if len(weights) < 3:
        raise ValueError("at least 3 sets of weights (2 steps) are needed")
    names = [n for n, t in weights[0].items() if t.numel() > 1]
    whole = _line_up([torch.cat([w[n].flatten() for n in names]) for w in weights])
    layers = {}
    for name in names:
        row = _line_up([w[name] for w in weights])
        norm = float(weights[0][name].norm())
        layers[name] = {**row, "step_rel": row["step"] / norm if norm else 0.0}
    return {"model": whole, "layers": layers}


@torch.no_grad()
def validation_loss(
    run_dir: Path, states: list[dict[str, torch.Tensor]], world_size: int
) -> list[float]:
    """The validation MLM loss of each of ``states`` (model state dicts), on the rows and
    masks the run validates on, summed over its ``world_size`` ranks' micro-batches."""
    cfg = run_config(run_dir)
    ids = token_ids(PretrainingShards(cfg.data.path, "train"))
    rows = PretrainingShards(cfg.data.path, "validation")
    loss_module = PretrainingLoss(build_model(cfg.model, ids.vocab_size, ids.pad))
    loss_module.eval()
    batches = [
        {
            k: torch.as_tensor(v)
            for k, v in validation_batch(rows, ids, cfg, b, r, world_size).items()
        }
        for b in range(validation_batch_count(cfg, len(rows), world_size))
        for r in range(world_size)
    ]
    out = []
    for state in states:
        loss_module.model.load_state_dict(state)
        total = tokens = 0.0
        for batch in batches:
            _, stats = loss_module(**batch)
            total += float(stats["mlm_loss_sum"])
            tokens += float(stats["mlm_tokens"])
        out.append(total / max(tokens, 1.0))
    return out


def analyse(run_dir: Path, step: int, steps: int, work: Path, loss: bool, keep: bool) -> dict:
    """One replay's figures (see the module docstring)."""
    weights = replay(run_dir, step, steps, work)
    row = {"step": step, "steps": steps, **update_statistics(weights)}
    if loss:
        first = load_file(_step_dir(work, step) / SHARED)["model"]
        second = load_file(_step_dir(work, step + 1) / SHARED)["model"]
        mean = {
            k: (v + second[k]) / 2 if v.dtype.is_floating_point else v for k, v in first.items()
        }
        w0, w1, middle = validation_loss(
            run_dir, [first, second, mean], world_size_of(_step_dir(run_dir, step))
        )
        row["loss"] = {"w0": w0, "w1": w1, "mean": middle}
    if not keep:
        shutil.rmtree(work)
    return row


def _largest(layers: dict, n: int = 3) -> list[tuple[str, dict]]:
    return sorted(layers.items(), key=lambda kv: -kv[1]["step"])[:n]


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.replay --run NAME=RUN_DIR ... --at STEPS --out DIR``."""
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = cli.report_parser("pipeline.reports.replay", summary, "NAME=RUN_DIR")
    parser.add_argument(
        "--at", required=True, help="kept checkpoints (comma-separated) to replay from"
    )
    parser.add_argument("--steps", type=int, default=8, help="steps to replay from each")
    parser.add_argument(
        "--loss", action="store_true", help="also the loss of w_0, w_1 and their mean"
    )
    parser.add_argument("--keep", action="store_true", help="keep the replays' work directories")

    def write(args) -> str:
        torch.set_num_threads(1)
        at = [int(s) for s in args.at.split(",") if s.strip()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        runs = []
        for spec in args.run:
            name, _, directory = spec.partition("=")
            if not name or not directory:
                raise ValueError(f"--run {spec!r} is not of the form NAME=RUN_DIR")
            rows = []
            for step in at:
                work = out / "work" / f"{name}-step{step}"
                row = analyse(Path(directory), step, args.steps, work, args.loss, args.keep)
                rows.append(row)
                whole = row["model"]
                line = (
                    f"{name} from step {step}: cos {whole['cos']:+.3f}, efficiency "
                    f"{whole['efficiency']:.3f}, step {whole['step']:.3f}"
                )
                if "loss" in row:
                    loss = row["loss"]
                    line += (
                        f"; loss w0 {loss['w0']:.4f} w1 {loss['w1']:.4f} mean {loss['mean']:.4f}"
                    )
                print(line)
                for layer, fig in _largest(row["layers"]):
                    print(
                        f"  {layer}: step {fig['step']:.3f} ({fig['step_rel']:.4f} of |w|), "
                        f"cos {fig['cos']:+.3f}, efficiency {fig['efficiency']:.3f}"
                    )
            runs.append({"name": name, "run_dir": directory, "replays": rows})
        if not args.keep and (out / "work").is_dir() and not any((out / "work").iterdir()):
            (out / "work").rmdir()
        atomic_write_json(out / "replay.json", {"runs": runs})
        return f"replay: {out}/replay.json"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
