"""The parity report's figures (matplotlib, Agg backend): pretraining loss, validation MLM
accuracy against samples seen, the 1-bit switch diagnostics and fine-tuning scores.

Every function takes the arms built by :func:`pipeline.reports.parity.group_arms` (and, for the
fine-tuning figure, the table of :func:`pipeline.reports.parity.compare_finetuning`) and writes one
PNG.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.reports.figures import pyplot
from pipeline.reports.stats import mean_std


def write_figures(arms: list[dict], finetuning: dict, out: Path) -> bool:
    """Write every figure into ``out``; True when the 1-bit switch figure was written. Without
    fine-tuning results there is no fine-tuning figure (one left from an earlier report in
    ``out`` is removed: the report would not show it)."""
    plot_loss(arms, out / "pretrain_loss.png")
    plot_val_accuracy(arms, out / "val_mlm_accuracy.png")
    has_switch = plot_switch(arms, out / "onebit_switch.png")
    if finetuning:
        plot_finetune(arms, finetuning, out / "finetune_scores.png")
    else:
        (out / "finetune_scores.png").unlink(missing_ok=True)
    return has_switch


def _seed_curves(arms: list[dict], key: str):
    """(arm index, seed index, arm, xs, ys) of every seed whose curve ``key`` has points."""
    for i, arm in enumerate(arms):
        for j, run in enumerate(arm["seeds"]):
            if run[key]:
                xs, ys = zip(*run[key], strict=True)
                yield i, j, arm, xs, ys


def _finish(plt, fig, ax, xlabel: str, ylabel: str, path: Path) -> None:
    _finish_axis(ax, xlabel, ylabel, fontsize=None)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _running_mean(ys: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _mark_freeze(ax, arms: list[dict], scale: int = 1) -> None:
    marked = set()
    for arm in arms:
        step = arm["seeds"][0]["freeze_step"]
        if step is not None and step not in marked:
            marked.add(step)
            ax.axvline(step * scale, color="grey", ls="--", lw=1)
            ax.text(
                step * scale,
                0.98,
                f" freeze step {step}",
                transform=ax.get_xaxis_transform(),
                va="top",
                fontsize=8,
                color="grey",
            )


def plot_loss(arms: list[dict], path: Path) -> None:
    """Pretraining loss per step (running mean), one line per pretraining seed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, j, arm, xs, ys in _seed_curves(arms, "train_loss"):
        window = max(1, len(ys) // 60)
        ax.plot(xs, _running_mean(list(ys), window), color=f"C{i}", lw=1, alpha=0.8,
                label=arm["name"] if j == 0 else None)  # fmt: skip
    _mark_freeze(ax, arms)
    _finish(plt, fig, ax, "step", "pretraining loss (MLM + NSP), running mean", path)


def plot_val_accuracy(arms: list[dict], path: Path) -> None:
    """Validation MLM accuracy against samples seen: each seed, and each arm's mean over the
    evaluation points its seeds share."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(arms):
        curves = [dict(r["val_mlm_accuracy"]) for r in arm["seeds"] if r["val_mlm_accuracy"]]
        for curve in curves:
            ax.plot(list(curve), list(curve.values()), color=f"C{i}", lw=0.8, alpha=0.4)
        common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if common:
            mean = [sum(c[x] for c in curves) / len(curves) for x in common]
            ax.plot(
                common,
                mean,
                color=f"C{i}",
                lw=2,
                marker=".",
                label=f"{arm['name']} (mean of {len(curves)} seeds)",
            )
    batch = arms[0]["seeds"][0]["global_batch_size"]
    _mark_freeze(ax, arms, scale=batch)
    _finish(plt, fig, ax, "samples seen", "validation MLM accuracy", path)


def _plot_band(ax, switch: dict, prefix: str, color: str, label: str | None) -> None:
    """The ``prefix`` mean per step with its min–max band."""
    if switch[f"{prefix}_mean"]:
        xs, mean = zip(*switch[f"{prefix}_mean"], strict=True)
        lo = [v for _, v in switch[f"{prefix}_min"]]
        hi = [v for _, v in switch[f"{prefix}_max"]]
        ax.plot(xs, mean, color=color, lw=1, label=label)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.12, lw=0)


def plot_switch(arms: list[dict], path: Path) -> bool:
    """c·f (or r before the switch) min/mean/max, the factor f, and the relative compression
    error per step; False (no plot) when no run has a compression stage."""
    if not any(r["switch"]["compression_error"] for a in arms for r in a["seeds"]):
        return False
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    for i, arm in enumerate(arms):
        for j, run in enumerate(arm["seeds"]):
            label = arm["name"] if j == 0 else None
            sw = run["switch"]
            for ax, prefix in ((axes[0], "trust_ratio"), (axes[1], "factor")):
                _plot_band(ax, sw, prefix, f"C{i}", label)
            if sw["compression_error"]:
                xs, ys = zip(*sw["compression_error"], strict=True)
                axes[2].plot(xs, ys, color=f"C{i}", lw=1, label=label)
    axes[0].set_ylabel("trust ratio: r, then c·f\n(mean; band: min–max)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("factor f\n(mean; band: min–max)")
    axes[2].set_ylabel("‖worker error‖ / ‖momentum‖")
    axes[2].set_xlabel("step")
    for ax in axes:
        _mark_freeze(ax, arms)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_finetune(arms: list[dict], table: dict, path: Path) -> None:
    """Each task's main metric per arm, and the randomly initialised baseline's when the
    table has one (mean with a ±std bar); GLUE fractions ×100."""
    plt = pyplot()
    tasks = list(table)
    names = list(table[tasks[0]]["metrics"][table[tasks[0]]["main_metric"]])  # arms, baseline
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(tasks)), 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        means, errs = [], []
        for task in tasks:
            row = table[task]["metrics"][table[task]["main_metric"]][name]
            scale = 1.0 if task == "squad" else 100.0  # GLUE metrics are fractions
            means.append(row["mean"] * scale)
            errs.append(row["std"] * scale)
        xs = [t + (i - (len(names) - 1) / 2) * width for t in range(len(tasks))]
        baseline = name not in {a["name"] for a in arms}
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=name,
               color="0.6" if baseline else f"C{i}", hatch="//" if baseline else None)  # fmt: skip
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([f"{t}\n({table[t]['main_metric']})" for t in tasks])
    ax.set_ylabel("score (x100 for GLUE)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_val_loss_target(arms: list[dict], target: float, path: Path, title: str = "") -> None:
    """Validation MLM loss against samples, one line per seed, with the target line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, j, arm, xs, ys in _seed_curves(arms, "val_mlm_loss"):
        label = f"{arm['name']} ({len(arm['seeds'])} seeds)" if j == 0 else None
        ax.plot(xs, ys, color=f"C{i}", lw=1, alpha=0.7, label=label)
    ax.axhline(target, color="black", ls=":", lw=1.2, label=f"target {target:.3f}")
    low = min((y for a in arms for r in a["seeds"] for _, y in r["val_mlm_loss"]), default=target)
    ax.set_ylim(low - 0.1, target + 2.0)
    if title:
        ax.set_title(title, fontsize=9)
    batch = arms[0]["seeds"][0]["global_batch_size"]
    _mark_freeze(ax, arms, scale=batch)
    _finish(plt, fig, ax, "samples seen", "validation MLM loss", path)


def plot_samples_to_target(gate: dict, path: Path) -> None:
    """Samples to target per seed (dots) and each arm's mean (bar), unreached seeds marked
    at the end of the run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(gate["per_seed"])
    for i, name in enumerate(names):
        rows = gate["per_seed"][name]
        reached = [r["samples_to_target"] for r in rows if r["samples_to_target"] is not None]
        missed = [r["max_samples"] for r in rows if r["samples_to_target"] is None]
        if reached:
            ax.bar(i, sum(reached) / len(reached), color=f"C{i}", alpha=0.3, width=0.6)
            ax.scatter([i] * len(reached), reached, color=f"C{i}", zorder=3, label=name)
        if missed:
            ax.scatter([i] * len(missed), missed, color=f"C{i}", marker="x", zorder=3,
                       label=f"{name}: not reached")  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    reached_all = [
        r["samples_to_target"]
        for rows in gate["per_seed"].values()
        for r in rows
        if r["samples_to_target"] is not None
    ]
    if reached_all:
        ax.set_ylim(min(reached_all) * 0.9, max(r["max_samples"] for rows in
                    gate["per_seed"].values() for r in rows) * 1.02)  # fmt: skip
    _finish(plt, fig, ax, "arm", "samples to target", path)


def _mean_curve(runs: list[dict]) -> tuple[list[float], list[float]]:
    """The mean validation loss over ``runs`` at the samples every one of them evaluated."""
    common = set.intersection(*({x for x, _ in r["val_mlm_loss"]} for r in runs))
    xs = sorted(common)
    tables = [dict(r["val_mlm_loss"]) for r in runs]
    return xs, [sum(t[x] for t in tables) / len(tables) for x in xs]


def plot_sensitivity(rows: list[dict], runs: list[dict], arms: list[dict], target: float,
                     path: Path) -> None:  # fmt: skip
    """Left: each sensitivity run's validation loss against samples, beside the gated arms'
    mean curves and the target. Right: samples to target against the share of the run at
    the freeze, beside each gated arm's mean ± std band (when the arms have a gate)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 2])
    for k, arm in enumerate(arms):
        runs_with = [r for r in arm["seeds"] if r["val_mlm_loss"]]
        if runs_with:
            xs, ys = _mean_curve(runs_with)
            left.plot(xs, ys, color="black", ls=("--", ":", "-.")[k % 3], lw=1.4,
                      label=f"{arm['name']}: mean of {len(runs_with)}")  # fmt: skip
    for i, run in enumerate(runs):
        if run["val_mlm_loss"]:
            xs, ys = zip(*run["val_mlm_loss"], strict=True)
            left.plot(xs, ys, color=f"C{i}", lw=1, label=f"{run['name']} (seed {run['seed']})")
    left.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.3f}")
    low = min((y for r in runs for _, y in r["val_mlm_loss"]), default=target)
    left.set_ylim(low - 0.1, target + 1.0)
    left.set_title("validation loss", fontsize=9)
    _finish_axis(left, "samples seen", "validation MLM loss")
    for i, row in enumerate(rows):
        if row["freeze_fraction"] is None:
            continue
        reached = row["samples_to_target"] is not None
        y = row["samples_to_target"] if reached else row["max_samples"]
        label = row["name"] + ("" if reached else " (not reached)")
        marker = "o" if reached else "x"
        right.scatter(
            [row["freeze_fraction"]], [y], color=f"C{i}", marker=marker, label=label, zorder=3
        )
    for k, arm in enumerate(arms):
        values = arm.get("samples_to_target", [])
        reached = [v for v in values if v is not None]
        if len(reached) >= 2:
            mean, std = mean_std(reached)
            label = f"{arm['name']}: mean ± std of {len(reached)}"
            color = ("0.75", "wheat", "lightblue")[k % 3]
            right.axhspan(mean - std, mean + std, color=color, alpha=0.5, label=label)
        # a gated arm that freezes: its own seeds at its freeze share
        shares = [
            (r["freeze_step"] / (r["max_samples"] // r["global_batch_size"]), v)
            for r, v in zip(arm["seeds"], values, strict=False)
            if isinstance(r.get("freeze_step"), int) and v is not None
        ]
        if shares:
            right.scatter(*zip(*shares, strict=True), color="black", marker="_", s=80,
                          label=f"{arm['name']}: its seeds")  # fmt: skip
    right.set_title("samples to target by freeze share", fontsize=9)
    right.xaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    _finish_axis(right, "freeze step / run length", "samples to target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finish_axis(ax, xlabel: str, ylabel: str, fontsize: int | None = 7) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=fontsize)
