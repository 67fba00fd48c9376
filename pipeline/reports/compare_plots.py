"""The comparison report's figures: validation MLM loss against samples seen, against bytes
sent per rank, and against modelled wall time at chosen bandwidths (one line per run, one
colour per strategy, the target as a dashed line)."""

from __future__ import annotations

from pathlib import Path

from pipeline.reports.figures import pyplot


def write_figures(data: dict, out: Path, bandwidths) -> None:
    """Every figure of :func:`pipeline.reports.compare_markdown.render_markdown` into ``out``."""
    target = data["target"]["val_mlm_loss"]
    plot_curves(data, out / "val_loss_samples.png", "samples seen", _by_samples, target)
    plot_curves(data, out / "val_loss_bytes.png", "bytes sent per rank", _by_bytes, target)
    for bw in bandwidths:
        measure = _by_time(bw)
        if any(measure(run) for run in data["runs"]):
            plot_curves(
                data,
                out / f"val_loss_time_{bw:g}mbit.png",
                f"modelled seconds at {bw:g} Mbit/s",
                measure,
                target,
            )


def _by_samples(run: dict) -> list[tuple[float, float]]:
    return list(run["val_loss"])


def _by_bytes(run: dict) -> list[tuple[float, float]]:
    return [(p["bytes"], p["val_mlm_loss"]) for p in run.get("curve") or []]


def _by_time(bandwidth: float):
    key = f"{bandwidth:g}"

    def measure(run: dict) -> list[tuple[float, float]]:
        points = run.get("curve") or []
        if not points or key not in points[0]["seconds"]:
            return []
        return [(p["seconds"][key], p["val_mlm_loss"]) for p in points]

    return measure


def plot_curves(data: dict, path: Path, xlabel: str, measure, target: float) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for i, arm in enumerate(data["arms"]):
        for j, run in enumerate(arm["seeds"]):
            points = measure(run)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=f"C{i % 10}", lw=1.2, alpha=0.85,
                    ls="-" if i < 10 else "--",
                    label=arm["name"] if j == 0 else None)  # fmt: skip
    ax.axhline(target, color="black", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation MLM loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
