"""What happens to the step after the freeze: per-layer trust ratios, ‖m/√v‖ and the
gradient noise scale, read from a run's checkpoints.

For every kept checkpoint (``<run>/checkpoints/step_*``) of a LAMB or 1-bit LAMB run this
reads the weights and the optimizer state and, per parameter tensor ("layer"), gives

* ``w``: ‖w‖;
* ``sqrt_v``: ‖√v‖, the second moment's size (1-bit LAMB's frozen one after the freeze,
  so against LAMB's it shows how stale the frozen one has become);
* ``mv``: ‖m / (√v + eps)‖, the update direction's size before the trust ratio (for 1-bit
  LAMB after the freeze, ``v`` is the frozen second moment its steps divide by);
* ``lamb_ratio``: LAMB's trust ratio for that state, ``clamp(‖w‖ / ‖m/(√v+eps) + wd·w‖,
  min_coeff, max_coeff)`` (1 where a norm is 0): what LAMB applies, and what 1-bit LAMB
  would apply if it still computed it;
* 1-bit LAMB: ``c`` (the frozen coefficient), ``f`` (the factor) and ``cf = c·f``, what it
  applies after the freeze;
* ``step``: the applied ratio times ‖u‖ / ‖w‖, the step's size relative to lr·‖w‖;
* ``moved``: ‖w - w_prev‖ / ‖w_prev‖ against the previous kept checkpoint, how far the
  layer went over that interval: steps whose noise cancels make ``step`` large and
  ``moved`` small.

From the run's ``metrics.jsonl``, ``intervals`` gives per kept checkpoint the mean of the
logged training figures :data:`LOGGED` over the steps since the previous one (1-bit LAMB's
``compression_error``, ‖worker error‖ / ‖scaled momentum‖, and its ``factor_mean``; the
trust ratio LAMB logs; the gradient norm before clipping, with its largest value): what
the optimizer did between two checkpoints, not only at them.

Per checkpoint the figures are summarised over layers by their mean (``means``) and their
median (``medians``; a few layers with tiny ‖w‖, biases early on, dominate the mean). Each
1-bit LAMB run is set against the LAMB run of the same batch and length (``pairs``): per
checkpoint, the median over layers of the per-layer ratio 1-bit LAMB / LAMB of ``step``,
``mv``, ``moved``, ``w`` and ``sqrt_v``.

Whether the stale second moment turns the step, not only shrinks it: per pair and kept
checkpoint after the freeze, ``cosines`` gives the cosine between the candidate's direction
``m/(√v+eps)`` under its own ``v`` and under LAMB's ``v`` at the same step (``v_cos``), and
the same for LAMB's momentum (``v_cos_reference``), each a mean over layers weighted by
their element counts. 1 is no turn: a frozen ``v`` that lags LAMB's by one factor per
layer gives 1; one that lags by different factors in different coordinates gives less.

The **gradient noise scale** ``B_simple = tr(Σ) / ‖G‖²`` (McCandlish et al., 2018, appendix
A) is estimated at chosen checkpoints from ``micro_batches`` gradients of ``micro_batch``
sequences each (the next batches of the run's own data order): with ``|g_s|²`` the mean
squared norm of the small-batch gradients and ``|g_b|²`` the squared norm of their mean (a
batch of ``B_b = micro_batches · micro_batch``), ``‖G‖² ≈ (B_b|g_b|² - B_s|g_s|²) / (B_b -
B_s)`` and ``tr(Σ) ≈ (|g_s|² - |g_b|²) / (1/B_s - 1/B_b)``. When the global batch is small
against ``B_simple``, gradient noise dominates the momentum and ‖m/√v‖ shrinks.

``python -m pipeline.reports.mechanism --run NAME=RUN_DIR ... --noise-at 500,1000,3000 --out DIR``
writes ``mechanism.json`` and the figures into ``DIR``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import yaml

from onebit_bert.checkpoint import COMPLETE, SHARED, load_file
from onebit_bert.io import atomic_write_json
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim.build import weight_decay_groups
from onebit_bert.shards import PretrainingShards
from pipeline.reports import cli
from pipeline.reports.figures import pyplot
from pretrain.config import PretrainConfig
from pretrain.data import BatchSchedule, make_batch
from pretrain.model import PretrainingLoss, build_model
from pretrain.outputs import config_path, metrics_path
from pretrain.train import token_ids


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every finished checkpoint of a run, ascending."""
    out = []
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        if (path / COMPLETE).is_file() and (path / SHARED).is_file():
            out.append((int(path.name.split("_")[1]), path))
    return out


def run_config(run_dir: Path) -> PretrainConfig:
    """The resolved config a pretraining run saved in its directory."""
    from onebit_bert.config import from_dict

    return from_dict(PretrainConfig, yaml.safe_load(config_path(run_dir).read_text()))


def _named_in_optimizer_order(model, weight_decay: float) -> list[tuple[str, float]]:
    """(parameter name, its weight decay) in the order the optimizer indexes them."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        (names[id(p)], group["weight_decay"])
        for group in weight_decay_groups(model.named_parameters(), weight_decay)
        for p in group["params"]
    ]


def layer_statistics(
    state: dict, names: list[tuple[str, float]], previous: dict | None = None
) -> dict:
    """Per-layer figures of one checkpoint's optimizer and weights (see the module
    docstring); names are the model's parameter names, ``previous`` the weights of the
    checkpoint before (for ``moved``)."""
    opt = state["optimizer"]
    group = opt["param_groups"][0]
    eps, lo, hi = group["eps"], group["min_coeff"], group["max_coeff"]
    weights = state["model"]
    rows = {}
    for index, (name, wd) in enumerate(names):
        st = opt["state"].get(index)
        if not st or "exp_avg" not in st:
            continue
        w = weights[name.removeprefix("model.")].float()
        if w.shape != st["exp_avg"].shape:
            raise ValueError(
                f"optimizer entry {index} has shape {tuple(st['exp_avg'].shape)} but "
                f"parameter {name} {tuple(w.shape)}: the checkpoint was not written by this "
                f"model and its weight-decay grouping"
            )
        direction = st["exp_avg"].float() / (st["exp_avg_sq"].float().sqrt() + eps)
        update = direction + wd * w if wd else direction
        w_norm, u_norm = float(w.norm()), float(update.norm())
        ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, lo), hi)
        row = {
            "w": w_norm,
            "mv": float(direction.norm()),
            "u": u_norm,
            "lamb_ratio": ratio,
            "sqrt_v": float(st["exp_avg_sq"].float().sqrt().norm()),
        }
        applied = ratio
        if "last_factor" in st:  # 1-bit LAMB after the freeze
            c, f = float(st["lamb_coeff"]), float(st["last_factor"])
            row |= {"c": c, "f": f, "cf": c * f}
            applied = c * f
        row["step"] = applied * u_norm / w_norm if w_norm else 0.0
        if previous is not None:
            before = previous[name.removeprefix("model.")].float()
            if float(before.norm()) > 0:
                row["moved"] = float((w - before).norm() / before.norm())
        rows[name] = row
    return rows


LOGGED = ("compression_error", "factor_mean", "trust_ratio_mean", "grad_norm")
"""The per-step figures of ``metrics.jsonl`` averaged between kept checkpoints."""
PEAKS = ("grad_norm",)
"""Those whose largest value between kept checkpoints is also given (``<name>_max``): a
gradient norm (before clipping) that spikes."""


def interval_means(records: list[dict], steps: list[int]) -> dict:
    """For each of ``steps`` (ascending checkpoint steps), the mean of each :data:`LOGGED`
    figure (and the largest value of each of :data:`PEAKS`) over the training records with
    a step after the previous checkpoint (0 for the first) and up to this one; figures no
    record in the interval logs are left out."""
    out, previous = {}, 0
    for step in steps:
        row = {}
        for key in LOGGED:
            values = [
                float(r[key]) for r in records
                if previous < r.get("step", -1) <= step and r.get(key) is not None
                and math.isfinite(float(r[key]))
            ]  # fmt: skip
            if values:
                row[key] = float(np.mean(values))
                if key in PEAKS:
                    row[f"{key}_max"] = float(max(values))
        out[step] = row
        previous = step
    return out


def _summary(rows: dict, reduce=np.mean) -> dict:
    """``reduce`` (the mean by default) over layers of each per-layer figure."""
    keys = {k for row in rows.values() for k in row}
    return {k: float(reduce([r[k] for r in rows.values() if k in r])) for k in sorted(keys)}


PAIRED = ("step", "mv", "moved", "w", "sqrt_v")
"""The per-layer figures a 1-bit LAMB run is set against its LAMB twin on."""


def pair_ratios(reference: dict, candidate: dict) -> dict:
    """Per checkpoint both runs kept: the median over the layers they share of the per-layer
    ratio candidate / reference of each figure in :data:`PAIRED` (layers where the
    reference's figure is 0 left out)."""
    out = {}
    for step in sorted(set(reference["layers"]) & set(candidate["layers"]), key=int):
        ref, cand = reference["layers"][step], candidate["layers"][step]
        row = {}
        for key in PAIRED:
            ratios = [
                cand[n][key] / ref[n][key]
                for n in ref.keys() & cand.keys()
                if key in ref[n] and key in cand[n] and ref[n][key] > 0
            ]
            if ratios:
                row[key] = float(np.median(ratios))
        out[step] = row
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float((a * b).sum()) / denominator if denominator > 0 else 1.0


def preconditioner_cosines(reference: dict, candidate: dict, eps: float) -> dict:
    """``v_cos`` and ``v_cos_reference`` (module docstring) of two optimizer state dicts of
    one model at one step, entries matched by index."""
    totals = {"v_cos": 0.0, "v_cos_reference": 0.0}
    count = 0
    for index, cand in candidate["state"].items():
        ref = reference["state"].get(index)
        if not ref or "exp_avg" not in cand or "exp_avg" not in ref:
            continue
        if ref["exp_avg"].shape != cand["exp_avg"].shape:
            raise ValueError(
                f"optimizer entry {index} has shape {tuple(cand['exp_avg'].shape)} in the "
                f"candidate and {tuple(ref['exp_avg'].shape)} in the reference: not one model"
            )
        own, theirs = (st["exp_avg_sq"].float().sqrt() + eps for st in (cand, ref))
        n = cand["exp_avg"].numel()
        for key, st in (("v_cos", cand), ("v_cos_reference", ref)):
            m = st["exp_avg"].float()
            totals[key] += n * _cosine(m / own, m / theirs)
        count += n
    return {key: total / count for key, total in totals.items()} if count else {}


def pair_cosines(reference: dict, candidate: dict) -> dict:
    """:func:`preconditioner_cosines` at every checkpoint after the candidate's freeze that
    both runs kept, read from their ``run_dir``."""
    kept = dict(checkpoint_dirs(Path(reference["run_dir"])))
    out = {}
    for step, path in checkpoint_dirs(Path(candidate["run_dir"])):
        if step <= candidate["freeze_step"] or step not in kept:
            continue
        cand = load_file(path / SHARED)["optimizer"]
        ref = load_file(kept[step] / SHARED)["optimizer"]
        out[step] = preconditioner_cosines(ref, cand, cand["param_groups"][0]["eps"])
    return out


def pairs(runs: list[dict], cosines: bool = False) -> list[dict]:
    """Each 1-bit LAMB run against the first LAMB run of the same global batch and
    length; with ``cosines``, also :func:`pair_cosines` from the runs' checkpoints."""
    out = []
    for cand in runs:
        if cand["freeze_step"] is None:
            continue
        shape = (cand["global_batch_size"], cand["max_steps"])
        ref = next(
            (r for r in runs
             if r["freeze_step"] is None and (r["global_batch_size"], r["max_steps"]) == shape),
            None,
        )  # fmt: skip
        if ref is not None:
            pair = {"candidate": cand["name"], "reference": ref["name"],
                    "ratios": pair_ratios(ref, cand)}  # fmt: skip
            if cosines:
                pair["cosines"] = pair_cosines(ref, cand)
            out.append(pair)
    return out


def noise_scale(
    cfg: PretrainConfig,
    shards: PretrainingShards,
    ids,
    step: int,
    checkpoint: Path,
    micro_batches: int = 32,
    micro_batch: int = 32,
) -> dict:
    """``B_simple`` at a checkpoint of the run ``cfg`` describes (module docstring), from the
    run's next batches of ``shards``."""
    model = build_model(cfg.model, ids.vocab_size, ids.pad)
    model.load_state_dict(load_file(checkpoint / SHARED)["model"])
    model.train()
    loss_module = PretrainingLoss(model)
    schedule = BatchSchedule(len(shards), micro_batch * micro_batches, micro_batch, 1, 1, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for k, rows in enumerate(np.array_split(schedule.global_indices(step), micro_batches)):
        batch = make_batch(shards, rows, ids, cfg.data, seed=cfg.seed, step=step, micro=k)
        tensors = {key: torch.from_numpy(np.asarray(v)) for key, v in batch.items()}
        model.zero_grad(set_to_none=True)
        loss, _ = loss_module(**tensors)
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]))
    return {"step": step, **estimate_noise_scale(torch.stack(grads), micro_batch)}


def estimate_noise_scale(grads: torch.Tensor, micro_batch: int) -> dict:
    """``B_simple`` from ``grads`` (one flattened gradient per row, each the mean over
    ``micro_batch`` examples): the unbiased estimators of the module docstring."""
    if grads.dim() != 2 or grads.shape[0] < 2:
        raise ValueError("estimate_noise_scale needs a [micro-batches >= 2, parameters] tensor")
    stacked = grads.double()
    small = float((stacked**2).sum(1).mean())
    big = float((stacked.mean(0) ** 2).sum())
    b_s, b_b = micro_batch, micro_batch * grads.shape[0]
    g2 = (b_b * big - b_s * small) / (b_b - b_s)
    trace = (small - big) / (1 / b_s - 1 / b_b)
    return {
        "small_batch": b_s,
        "big_batch": b_b,
        "grad_norm_sq": g2,
        "trace_sigma": trace,
        "b_simple": trace / g2 if g2 > 0 else math.inf,
    }


def analyse_run(name: str, run_dir: Path, noise_at: list[int], micro_batches: int) -> dict:
    """Every checkpoint's per-layer figures and their means, and the noise scale at the
    checkpoints nearest to ``noise_at``."""
    cfg = run_config(run_dir)
    shards = PretrainingShards(cfg.data.path, "train")
    ids = token_ids(shards)
    model = PretrainingLoss(build_model(cfg.model, ids.vocab_size, ids.pad))
    names = _named_in_optimizer_order(model, cfg.optimizer.weight_decay)
    points = checkpoint_dirs(run_dir)
    if not points:
        raise FileNotFoundError(f"run {name!r}: no finished checkpoints under {run_dir}")
    layers, means, medians, previous = {}, {}, {}, None
    for step, path in points:
        state = load_file(path / SHARED)
        rows = layer_statistics(state, names, previous)
        layers[step], means[step], medians[step] = rows, _summary(rows), _summary(rows, np.median)
        previous = state["model"]
    metrics = metrics_path(run_dir)
    records = read_metrics(metrics) if metrics.is_file() else []
    intervals = interval_means(records, [step for step, _ in points])
    noise = []
    for wanted in noise_at:
        step, path = min(points, key=lambda p: abs(p[0] - wanted))
        noise.append(
            noise_scale(cfg, shards, ids, step, path, micro_batches, cfg.batch.micro_batch_size)
        )
    return {
        "name": name,
        "run_dir": str(run_dir),
        "optimizer": cfg.optimizer.name,
        "freeze_step": cfg.optimizer.freeze_step if "onebit" in cfg.optimizer.name else None,
        "global_batch_size": cfg.batch.global_batch_size,
        "max_steps": cfg.schedule.max_steps,
        "means": means,
        "medians": medians,
        "intervals": intervals,
        "layers": layers,
        "noise": noise,
    }


def plot(runs: list[dict], out: Path) -> list[str]:
    """trust.png (applied ratio, ‖m/√v‖, the step and how far the layers moved, over
    samples, median over layers) and noise.png (B_simple beside the global batch)."""
    plt = pyplot()
    written = []
    fig, axes = plt.subplots(1, 4, figsize=(19, 4))
    for index, run in enumerate(runs):
        color = f"C{index}"  # one colour per run in every panel
        batch = run["global_batch_size"]
        steps = sorted(int(s) for s in run["medians"])
        x = [s * batch for s in steps]
        medians = [run["medians"][s] for s in steps]
        onebit = run["freeze_step"] is not None
        applied = [m["cf"] if onebit and "cf" in m else m["lamb_ratio"] for m in medians]
        label = f"{run['name']} (batch {batch})"
        axes[0].plot(x, applied, color=color, label=label + (": c·f" if onebit else ": r"))
        if onebit:
            lamb_r = [m["lamb_ratio"] for m in medians]
            axes[0].plot(x, lamb_r, color=color, ls=":", label=label + ": LAMB's r")
        axes[1].plot(x, [m["mv"] for m in medians], color=color, label=label)
        axes[2].plot(x, [m["step"] for m in medians], color=color, label=label)
        moved = [(xi, m["moved"]) for xi, m in zip(x, medians, strict=True) if "moved" in m]
        if moved:
            axes[3].plot(*zip(*moved, strict=True), color=color, label=label)
    for ax, title in zip(
        axes,
        (
            "applied trust ratio",
            "‖m/√v‖",
            "step / (lr·‖w‖)",
            "‖w - w_prev‖ / ‖w_prev‖ since the last checkpoint",
        ),  # fmt: skip
        strict=True,
    ):
        ax.set_title(title + " (median over layers)", fontsize=9)
        ax.set_xlabel("samples")
    axes[3].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "trust.png", dpi=110)
    plt.close(fig)
    written.append("trust.png")
    if any(run["noise"] for run in runs):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            if run["noise"]:
                xs = [n["step"] * run["global_batch_size"] for n in run["noise"]]
                ax.plot(xs, [n["b_simple"] for n in run["noise"]], "o-", label=run["name"])
        for batch in sorted({run["global_batch_size"] for run in runs}):
            ax.axhline(batch, ls="--", color="grey", lw=0.8)
            ax.text(0, batch, f" batch {batch}", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("samples")
        ax.set_ylabel("B_simple (sequences)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "noise.png", dpi=110)
        plt.close(fig)
        written.append("noise.png")
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.mechanism --run NAME=RUN_DIR ... --out DIR``."""
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = cli.report_parser("pipeline.reports.mechanism", summary, "NAME=RUN_DIR")
    parser.add_argument(
        "--noise-at", default="", help="steps (comma-separated) to estimate B_simple at"
    )
    parser.add_argument("--micro-batches", type=int, default=32)

    def write(args) -> str:
        torch.set_num_threads(1)
        noise_at = [int(s) for s in args.noise_at.split(",") if s.strip()]
        runs = []
        for spec in args.run:
            name, _, directory = spec.partition("=")
            if not name or not directory:
                raise ValueError(f"--run {spec!r} is not of the form NAME=RUN_DIR")
            runs.append(analyse_run(name, Path(directory), noise_at, args.micro_batches))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        figures = plot(runs, out)
        paired = pairs(runs, cosines=True)
        atomic_write_json(
            out / "mechanism.json", {"runs": runs, "pairs": paired, "figures": figures}
        )
        for run in runs:
            last = run["medians"][max(run["medians"])]
            print(f"{run['name']}: last checkpoint {max(run['medians'])}, medians: {last}")
            for n in run["noise"]:
                print(f"  B_simple at step {n['step']}: {n['b_simple']:.1f}")
        for pair in paired:
            print(f"{pair['candidate']} / {pair['reference']}, medians of per-layer ratios:")
            for step, row in pair["ratios"].items():
                print(f"  step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
            for step, row in pair["cosines"].items():
                print(f"  step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
        return f"mechanism: {out}/mechanism.json"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
