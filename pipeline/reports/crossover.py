"""Time to the target on other links and cluster sizes, and where one recipe stops paying
against another.

A run's modelled time to the target is the sum over its seeds' steps per stage
(``time_to_target.stage_steps``; a seed that missed: its ``run_end``, a lower bound) of
``global batch / samples/s``, the samples/s of :mod:`pipeline.reports.linkmodel`'s step with ``p``
ranks of the sweep's per-rank batch. Samples to the target are the report's, measured at
its global batch on 4 ranks: the model moves the link and the cluster, not the convergence.
``python -m pipeline.reports.crossover`` prints the model's check against every netem point
(:mod:`pipeline.reports.crossover_check`) and the crossover of 1-bit LAMB against LAMB.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.reports import ranking
from pipeline.reports.crossover_check import check
from pipeline.reports.figures import pyplot
from pipeline.reports.linkmodel import load_profiles, profile_key, repeats_in, step_seconds
from pipeline.reports.stats import mean_std, t_quantile

LINKS_GBPS = (0.1, 1.0, 10.0, 25.0, 100.0)
WORKERS = (4, 16, 64)


def seed_seconds(run: dict, profiles: dict, link_bps: float, p: int, g: int,
                 **scales) -> float | None:  # fmt: skip
    """Modelled seconds of one report record to the target (its run's end when it missed:
    a lower bound); None when its recipe has no profile."""
    stages = profiles.get(profile_key(run.get("strategy")))
    block = run["time_to_target"]
    split = block.get("stage_steps") if block.get("reached") else (
        block.get("run_end") or {}).get("stage_steps")  # fmt: skip
    if not stages or not split:
        return None
    total = 0.0
    for stage, steps in split.items():
        profile = stages.get(stage) or stages.get("default") or stages.get("compression")
        speed = p * profile.batch_per_rank / step_seconds(profile, link_bps, p, g, **scales)
        total += steps * run["global_batch_size"] / speed
    return total


def recipe_times(report: dict, profiles: dict, link_bps: float, p: int, g: int,
                 **scales) -> dict[str, dict]:  # fmt: skip
    """Per report name: per-seed modelled seconds, mean, std, reach rate, and each seed's
    fields that pair it (:data:`pipeline.reports.ranking.PAIRING_FIELDS`)."""
    out: dict[str, dict] = {}
    for run in report["runs"]:
        seconds = seed_seconds(run, profiles, link_bps, p, g, **scales)
        if seconds is None:
            continue
        entry = out.setdefault(run["name"], {"seconds": [], "censored": [], "strategy":
                                             run["strategy"]})  # fmt: skip
        entry["seconds"].append(seconds)
        entry["censored"].append(not run["time_to_target"].get("reached"))
        entry.setdefault("pairing", []).append({k: run.get(k) for k in ranking.PAIRING_FIELDS})
    for entry in out.values():
        entry["mean"], entry["std"] = mean_std(entry["seconds"])
    return out


def crossover(report: dict, profiles: dict, a: str, b: str, p: int, g: int, lo_bps: float = 1e6,
              hi_bps: float = 1e12, shift: float = 0.0) -> float | None:  # fmt: skip
    """The link (bit/s) below which ``b`` reaches the target before ``a`` and above which
    it does not (bisection on log bandwidth of mean(b) + shift·std(b) - (mean(a) - shift·
    std(a))); None when they do not cross in [lo, hi]."""

    def gap(bps: float) -> float:
        times = recipe_times(report, profiles, bps, p, g)
        ta, tb = times[a], times[b]
        return (tb["mean"] + shift * tb["std"]) - (ta["mean"] - shift * ta["std"])

    lo, hi = math.log(lo_bps), math.log(hi_bps)
    if gap(math.exp(lo)) * gap(math.exp(hi)) > 0:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        if gap(math.exp(lo)) * gap(math.exp(mid)) <= 0:
            hi = mid
        else:
            lo = mid
    return math.exp((lo + hi) / 2)


def sweep(report: dict, profiles: dict, links_gbps=LINKS_GBPS, workers=WORKERS,
          gpus_per_node: int = 2) -> list[dict]:  # fmt: skip
    """Per (link, ranks): every timed recipe's modelled time to the target (mean ± std over
    its seeds) and its samples/s per stage."""
    out = []
    for p in workers:
        for gbps in links_gbps:
            bps = gbps * 1e9
            times = recipe_times(report, profiles, bps, p, gpus_per_node)
            rates = {}
            for key, stages in profiles.items():
                rates[key] = {s: p * pr.batch_per_rank / step_seconds(pr, bps, p, gpus_per_node)
                              for s, pr in stages.items()}  # fmt: skip
            out.append({"link_gbps": gbps, "ranks": p, "gpus_per_node": gpus_per_node,
                        "time_to_target_s": {n: {k: t[k] for k in ("mean", "std", "seconds",
                                                                   "censored")}
                                             for n, t in times.items()},
                        "samples_per_s": rates})  # fmt: skip
    return out


LO_GBPS, HI_GBPS = 1e-3, 1e3
"""The links searched for a crossing (Gbit/s): 1 Mbit/s to 1 Tbit/s."""


def _crossings(report: dict, profiles: dict, a: str, b: str, p: int,
               gpus_per_node: int) -> dict[str, float]:  # fmt: skip
    """The crossing (Gbit/s) for the means, and its low and high ends from the seeds'
    spread. Where the two do not cross in the searched links, the crossing lies beyond one
    end: 0.0 when ``b`` does not pay even at the slowest link, ``inf`` when it pays even at
    the fastest (:func:`_open` turns these into JSON)."""
    out = {}
    for label, shift in (("mean", 0.0), ("low", 1.0), ("high", -1.0)):
        bps = crossover(report, profiles, a, b, p, gpus_per_node, lo_bps=LO_GBPS * 1e9,
                        hi_bps=HI_GBPS * 1e9, shift=shift)  # fmt: skip
        if bps is None:
            times = recipe_times(report, profiles, HI_GBPS * 1e9, p, gpus_per_node)
            ta, tb = times[a], times[b]
            pays = tb["mean"] + shift * tb["std"] < ta["mean"] - shift * ta["std"]
            out[label] = math.inf if pays else 0.0
        else:
            out[label] = bps / 1e9
    return out


def _open(value: float) -> tuple[float | None, str | None]:
    """A crossing for JSON: (Gbit/s, None) inside the searched links, (None, "above") when it
    lies above them (``b`` pays at every link), (None, "below") when below (it never does)."""
    if math.isinf(value):
        return None, "above"
    if value == 0.0:
        return None, "below"
    return value, None


def crossovers(report: dict, profiles: dict, a: str = "lamb", b: str = "onebit_lamb",
               workers=WORKERS, gpus_per_node: int = 2,
               by_repeat: list[dict] = ()) -> list[dict]:  # fmt: skip
    """Per cluster size: the link below which ``b`` reaches the target first, for the
    means and for the seeds' spread (``b``'s mean + std against ``a``'s mean - std, and the
    other way round: the range the crossing can lie in). ``by_repeat``: the profiles of
    each repeat of a sweep measured more than once; the crossing at each repeat's speeds is
    given too, and the range spans every repeat's. A crossing outside the searched links is
    null, and ``beyond`` says on which side (``{"high": "above"}``: at the spread's
    optimistic end ``b`` pays at every link up to :data:`HI_GBPS`)."""
    out = []
    for p in workers:
        found = _crossings(report, profiles, a, b, p, gpus_per_node)
        each = [_crossings(report, prof, a, b, p, gpus_per_node) for prof in by_repeat]
        ends = {"mean": found["mean"],
                "low": min(c["low"] for c in (found, *each)),
                "high": max(c["high"] for c in (found, *each))}  # fmt: skip
        values = {k: _open(v) for k, v in ends.items()}
        row = {"ranks": p, "gpus_per_node": gpus_per_node, "pair": [a, b],
               "crossover_gbps": values["mean"][0],
               "crossover_range_gbps": [values["low"][0], values["high"][0]]}  # fmt: skip
        beyond = {k: side for k, (_, side) in values.items() if side}
        if by_repeat:
            opened = [_open(c["mean"]) for c in each]
            row["crossover_by_repeat_gbps"] = [v for v, _ in opened]
            beyond.update({f"repeat {i + 1}": side for i, (_, side) in enumerate(opened) if side})
        if beyond:
            row["beyond"] = beyond
        out.append(row)
    return out


def paired_samples(report: dict, a: str, b: str) -> dict | None:
    """``b``'s samples to the target against ``a``'s on the seeds that pair
    (:func:`pipeline.reports.ranking.pairing_key`: same seed, data, batch and length) and
    reached it in both: the ratio per seed, their geometric mean with its 95 % t interval,
    and the paired two-sided t-test on the log ratio with its detectable difference; None
    with fewer than two such pairs. A recipe's seeds differ in the steps they take, not in
    the speed of a step, so this spread is what widens the crossover's range."""

    def reached(name: str) -> dict[tuple, dict]:
        out = {}
        for run in report["runs"]:
            key = ranking.pairing_key(run)
            if run["name"] == name and key is not None and run["time_to_target"].get("reached"):
                out[tuple(key)] = run
        return out

    first, second = reached(a), reached(b)
    keys = sorted(set(first) & set(second), key=lambda k: k[0])  # by seed
    if len(keys) < 2:
        return None
    xs = [first[k]["time_to_target"]["samples"] for k in keys]
    ys = [second[k]["time_to_target"]["samples"] for k in keys]
    mean, sd, p = ranking.paired_t_test(xs, ys)
    n = len(keys)
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return {"pair": [a, b], "seeds": [first[k]["seed"] for k in keys],
            "samples": [xs, ys], "ratios": [y / x for x, y in zip(xs, ys, strict=True)],
            "geometric_mean": math.exp(mean), "interval": [math.exp(mean - half),
                                                           math.exp(mean + half)],
            "df": n - 1, "p": p,
            "t": mean / (sd / math.sqrt(n)) if sd else None,
            "detectable_difference": ranking.paired_detectable_difference(sd, n)}  # fmt: skip


def samples_lines(paired: dict | None) -> list[str]:
    """The sentence of :func:`paired_samples` under the crossover's table."""
    if not paired:
        return []
    a, b = paired["pair"]
    seeds = ", ".join(f"{s}: {r:.3f}" for s, r in zip(paired["seeds"], paired["ratios"],
                                                      strict=True))  # fmt: skip
    low, high = paired["interval"]
    t = "no spread" if paired["t"] is None else f"t {paired['t']:.2f} on {paired['df']} df"
    return [
        f"Samples to the target, {b} against {a}, on the {len(paired['seeds'])} seeds that "
        f"pair and reached it in both: ×{paired['geometric_mean']:.3f}, 95 % interval "
        f"[{low:.3f}, {high:.3f}] (geometric mean of the ratios; per seed {seeds}). Paired "
        f"two-sided t-test on the log ratio: {t}, p {paired['p']:.2g}; detectable difference "
        f"at {ranking.POWER:.0%} power {paired['detectable_difference']:.0%}. A recipe's "
        "seeds differ in steps, not in the speed of a step, so this spread is what widens "
        "the range above.",
        "",
    ]


def crossover_lines(rows: list[dict]) -> list[str]:
    """A report's section for :func:`crossovers`."""
    if not rows:
        return []
    a, b = rows[0]["pair"]

    def gbps(value: float | None, row: dict, end: str) -> str:
        if value is not None:
            return f"{value:.2g}"
        side = (row.get("beyond") or {}).get(end)
        if side == "above":
            return f"> {HI_GBPS:g}"
        if side == "below":
            return f"< {LO_GBPS:g}"
        return f"none in {LO_GBPS:g}–{HI_GBPS:g}"

    lines = [
        f"## Where {b} stops paying against {a}",
        "",
        f"The link per node (Gbit/s) below which {b} reaches the target before {a}, from "
        "each recipe's compute per step, bytes per step and overlap in the netem files "
        "(`pipeline/linkmodel.py`), on nodes of 2 ranks; the range: "
        f"{b}'s mean ∓ std against {a}'s ± std over their seeds"
        + (", at every repeat of the sweep" if "crossover_by_repeat_gbps" in rows[0] else "")
        + ". A seed that missed the target counts at its run's end, so a recipe with one is "
        "modelled too fast."
        + (
            f" `> {HI_GBPS:g}`: {b} pays at every link up to {HI_GBPS:g} Gbit/s; "
            f"`< {LO_GBPS:g}`: at none down to {LO_GBPS:g} Gbit/s."
            if any(r.get("beyond") for r in rows)
            else ""
        ),
        "",
    ]
    repeated = "crossover_by_repeat_gbps" in rows[0]
    if repeated:
        lines += ["| ranks | crossover | at each repeat | range |", "|---:|---:|---|---|"]
    else:
        lines += ["| ranks | crossover | range |", "|---:|---:|---|"]
    for row in rows:
        low, high = row["crossover_range_gbps"]
        dash = "–" if low is not None and high is not None else " to "
        each = (" | " + ", ".join(gbps(v, row, f"repeat {i + 1}") for i, v in
                                  enumerate(row["crossover_by_repeat_gbps"]))
                if repeated else "")  # fmt: skip
        lines.append(f"| {row['ranks']} | {gbps(row['crossover_gbps'], row, 'mean')}{each} | "
                     f"{gbps(low, row, 'low')}{dash}{gbps(high, row, 'high')} |")  # fmt: skip
    lines.append("")
    lines += samples_lines(rows[0].get("samples_paired"))
    figure = rows[0].get("figure")
    if figure:
        lines += [f"![modelled time to the target against the link]({figure})", ""]
    return lines


def repeat_profiles(netem_paths: list[str]) -> list[dict]:
    """The profiles of each repeat where a file measured its points more than once (empty
    otherwise)."""
    count = repeats_in(netem_paths)
    return [load_profiles(netem_paths, r)[0] for r in range(count)] if count > 1 else []


def report_crossovers(report: dict, netem_paths: list[str], a: str, b: str,
                      figure: Path | None = None) -> list[dict]:  # fmt: skip
    """:func:`crossovers` for a comparison's ``report.json``; empty when either recipe has
    no seed at the target or no measured speed. With ``figure``, :func:`plot` draws every
    recipe there from the same speeds, and the first row names it (its ``figure``)."""
    if not netem_paths:
        return []
    profiles, _ = load_profiles(netem_paths)
    times = recipe_times(report, profiles, 1e9, 4, 2)
    names = {r["name"]: r for r in report["runs"] if r["time_to_target"].get("reached")}
    if a not in times or b not in times or a not in names or b not in names:
        return []
    each = repeat_profiles(netem_paths)
    rows = crossovers(report, profiles, a, b, by_repeat=each)
    paired = paired_samples(report, a, b)
    if paired:
        rows[0]["samples_paired"] = paired
    if figure is not None:
        plot(report, profiles, figure, by_repeat=each)
        rows[0]["figure"] = figure.name
    return rows


def plot(report: dict, profiles: dict, path: Path, ranks=(4, 64), gpus_per_node: int = 2,
         by_repeat: list[dict] = ()) -> None:  # fmt: skip
    """Time to the target against the link per recipe, the band its seeds' spread gives
    (mean ± std; with ``by_repeat``, widened to span every repeat's mean ± std), one panel
    per cluster size."""
    plt = pyplot()
    grid = [10 ** (7 + 5 * i / 50) for i in range(51)]  # 10 Mbit/s .. 1 Tbit/s
    fig, axes = plt.subplots(1, len(ranks), figsize=(7 * len(ranks), 5), squeeze=False)
    for ax, p in zip(axes[0], ranks, strict=True):
        series: dict[str, list] = {}
        for bps in grid:
            spans: dict[str, list] = {}
            for prof in by_repeat:
                for name, t in recipe_times(report, prof, bps, p, gpus_per_node).items():
                    spans.setdefault(name, []).append(t)
            for name, t in recipe_times(report, profiles, bps, p, gpus_per_node).items():
                if not all(t["censored"]):
                    every = [t, *spans.get(name, [])]
                    low = min(x["mean"] - x["std"] for x in every)
                    high = max(x["mean"] + x["std"] for x in every)
                    series.setdefault(name, []).append((bps / 1e9, t["mean"] / 3600,
                                                        low / 3600, high / 3600))  # fmt: skip
        for name, points in series.items():
            xs, ys, lows, highs = zip(*points, strict=True)
            style = "-" if name in ("lamb", "onebit_lamb") else ":"
            (line,) = ax.plot(xs, ys, style, label=name, linewidth=2 if style == "-" else 1)
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.12)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link per node (Gbit/s)")
        ax.set_ylabel("modelled time to the target (h)")
        band = "mean ± std over seeds" + (", every repeat" if by_repeat else "")
        ax.set_title(f"{p} ranks, {gpus_per_node} per node; band: {band}")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.crossover``: print the model's check against every netem point
    and the crossover; with ``--out``, write ``crossover.json`` and ``crossover.png``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pipeline.reports.crossover", description=__doc__
    )
    parser.add_argument("--report", default="docs/results/compare/tuned/report.json")
    parser.add_argument("--out", type=Path, help="folder for crossover.json and crossover.png")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    netem = report["time_model"]["netem"]
    if not netem:
        parser.error(f"{args.report} has no netem files (time_model.netem): no speeds to model")
    profiles, _ = load_profiles(netem)
    each = repeat_profiles(netem)
    checked = check()
    result = {
        "report": args.report,
        "netem": netem,
        "check": checked["summary"],
        "crossover": crossovers(report, profiles, by_repeat=each),
        "sweep": sweep(report, profiles),
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "crossover.json").write_text(
            json.dumps({**result, "check_points": checked["points"]}, indent=1) + "\n"
        )
        plot(report, profiles, args.out / "crossover.png", by_repeat=each)
    print(json.dumps({k: v for k, v in result.items() if k != "sweep"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
