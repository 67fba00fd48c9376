"""Time to the target on other links and cluster sizes, from what the netem sweeps measured.

**The step model.** Per recipe and stage (1-bit recipes: ``warmup``, ``compression``;
others one), a :class:`Profile` from a ``bench.netem`` row: the compute seconds per step
(the step time at the sweep's fastest link, less that link's modelled exposed traffic; in
units of the reference row's machine speed, so that sweeps run at other machine states
agree: each row's ``compute_only_samples_per_s``), the payload a rank exchanges per step
(the bytes its host's link received at the sweep's slowest link, divided by the
collective's factor below) and how much of the traffic can hide behind compute (CO2 and
Streaming DiLoCo send a round's average during the next steps: up to one step's compute per
step; every other recipe waits). On ``p`` ranks in nodes of ``g``, ``n = p / g`` nodes,
the bytes each node's link carries per step for a payload ``V``:

- ``ring`` (a ring all-reduce: LAMB, AdamW, PowerSGD's factors, the local-step averages per
  step of the round): ``2 (p - 1) / p · V``, the ring ordered by node;
- ``compressed`` (the 1-bit all-to-all, then the all-gather of the compressed chunks; also
  int8 warmups): ``g (p - g) / p · V + (p - 1) / p · V``: each rank sends ``V / p`` to every
  rank outside its node, and the all-gather's ring crosses into each node once;
- ``node_ring``, ``node_compressed`` (the node hierarchy: exact averages inside a node, the
  collective between nodes on each rank's ``1 / g`` shard): ``2 (n - 1) / n · V``;
- ``neighbours`` (DecentLaM, DmSGD): ``k · V`` for ``k`` neighbours per step.

A step then takes ``compute + max(0, bytes · 8 / B + latency · messages - hide · compute)``
on a link of ``B`` bit/s, and a run's time to the target is the sum over its seeds' steps
per stage (``time_to_target.stage_steps``; a seed that missed: its ``run_end``, a lower
bound) of ``global batch / samples/s``, with ``p`` ranks of the sweep's per-rank batch.
Samples to the target are the report's, measured at its global batch on 4 ranks: the model
moves the link and the cluster, not the convergence.

:func:`check` sets the model against every netem point in the repository: each point is
predicted from the same recipe's other points (the same sweep's other bandwidth first,
else another sweep), never from itself.
"""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass
from pathlib import Path

from onebit_bert.recipes import RECIPES
from pipeline.stats import mean_std

REPO = Path(__file__).resolve().parents[1]
LINKS_GBPS = (0.1, 1.0, 10.0, 25.0, 100.0)
WORKERS = (4, 16, 64)
HIDES = {"co2", "streaming_diloco"}
"""Strategies whose averages travel while the next steps compute."""


@dataclass(frozen=True)
class Profile:
    """One recipe stage's step, as the model needs it."""

    recipe: str
    stage: str
    pattern: str
    payload_bytes: float
    compute_s: float
    hide: float
    neighbours: int
    batch_per_rank: int
    source: str


def pattern_of(key: str, stage: str) -> tuple[str, int]:
    """(collective pattern, neighbours) of a recipe key's stage (``decentlam/ring``)."""
    name, _, topology = key.partition("/")
    recipe = RECIPES.get(name)
    node = recipe is not None and recipe.settings.get("comm.hierarchy") == "node"
    measure = recipe.measure if recipe else "data_parallel"
    if measure == "decentralized":
        return "neighbours", 2 if topology in ("ring", "") else 1
    if measure == "zero_one_adam":
        return "compressed", 0
    if measure == "onebit":
        compressed = stage == "compression" or "comm.compression.grad" in recipe.settings
        return ("node_" if node else "") + ("compressed" if compressed else "ring"), 0
    if measure == "data_parallel" and node:
        return "node_ring", 0
    return "ring", 0


def link_factor(pattern: str, p: int, g: int, neighbours: int = 0) -> float:
    """Bytes a node's link carries per byte of payload (see the module's note)."""
    n = max(p // g, 1)
    if pattern == "ring":
        return 2 * (p - 1) / p
    if pattern == "compressed":
        return g * (p - g) / p + (p - 1) / p
    if pattern in ("node_ring", "node_compressed"):
        return 2 * (n - 1) / n
    if pattern == "neighbours":
        return float(neighbours) if n > 1 else 0.0
    raise ValueError(f"unknown collective pattern {pattern!r}")


def messages(pattern: str, p: int, g: int, neighbours: int = 0) -> int:
    """Latency-bound rounds of the collective per step."""
    n = max(p // g, 1)
    return {"ring": 2 * (p - 1), "compressed": 2 * (p - 1), "node_ring": 2 * (n - 1),
            "node_compressed": 2 * (n - 1), "neighbours": neighbours}[pattern]  # fmt: skip


def step_seconds(profile: Profile, link_bps: float, p: int, g: int, latency_s: float = 0.0,
                 compute_scale: float = 1.0, payload_scale: float = 1.0) -> float:  # fmt: skip
    """One step of ``profile`` on ``p`` ranks in nodes of ``g`` over ``link_bps``."""
    compute = profile.compute_s * compute_scale
    bytes_ = link_factor(profile.pattern, p, g, profile.neighbours) * profile.payload_bytes
    comm = bytes_ * payload_scale * 8 / link_bps
    comm += latency_s * messages(profile.pattern, p, g, profile.neighbours)
    return compute + max(0.0, comm - profile.hide * compute)


def _stages(run: dict) -> list[tuple[str, dict]]:
    """(stage, its measurement) of one netem runs entry."""
    out = [("warmup", run["warmup"])] if "warmup" in run else []
    return [*out, ("compression" if out else "default", run)]


def _exposed(pattern, payload, neighbours, bw_mbit, p, g) -> float:
    return link_factor(pattern, p, g, neighbours) * payload * 8 / (bw_mbit * 1e6)


def profiles_of(rows: list[dict], source: str, key: str,
                reference_speed: float | None = None) -> dict:  # fmt: skip
    """Stage -> :class:`Profile` of recipe ``key`` from one sweep's rows (one world size):
    payload at the slowest link, compute at the fastest; in units of ``reference_speed``
    (compute-only samples/s of another machine state) when given, else as measured."""
    rows = sorted((r for r in rows if key in r.get("runs", {})), key=lambda r: r["bandwidth_mbit"])
    if not rows:
        return {}
    slow, fast = rows[0], rows[-1]
    p, g = slow["world_size"], slow.get("ranks_per_host", 1)
    out = {}
    for (stage, s_run), (_, f_run) in zip(_stages(slow["runs"][key]), _stages(fast["runs"][key]),
                                          strict=True):  # fmt: skip
        pattern, k = pattern_of(key, stage)
        factor = link_factor(pattern, p, g, k) or 1.0
        payload = max(s_run["wire_bytes_per_step"], f_run["wire_bytes_per_step"]) / factor
        name = key.partition("/")[0]
        hide = 1.0 if name in RECIPES and RECIPES[name].strategy in HIDES else 0.0
        exposed = _exposed(pattern, payload, k, fast["bandwidth_mbit"], p, g)
        # a recipe that hides its traffic hides all of it on the fastest link
        compute = f_run["step_seconds"] - (0.0 if hide else exposed)
        if reference_speed:
            compute *= fast["compute_only_samples_per_s"] / reference_speed
        compute = max(compute, 1e-9)
        out[stage] = Profile(key, stage, pattern, payload, compute, hide, k,
                             int(fast["global_batch"] // fast["world_size"]), source)  # fmt: skip
    return out


def load_profiles(netem_paths: list[str]) -> tuple[dict, float]:
    """recipe key -> stage -> :class:`Profile`, each recipe from the file the report took its
    speeds from (the last that measured it), and the reference machine speed (compute-only
    samples/s of the first file's fastest row)."""
    files = [(p, json.loads((REPO / p).read_text())) for p in netem_paths]
    first_rows = sorted(files[0][1]["results"], key=lambda r: r["bandwidth_mbit"])
    reference = first_rows[-1]["compute_only_samples_per_s"]
    out: dict[str, dict] = {}
    for path, netem in files:
        keys = {k for r in netem["results"] for k in r.get("runs", {})}
        for key in keys:
            out[key] = profiles_of(netem["results"], path, key, reference)
    return out, reference


def _profile_key(strategy: str | None) -> str | None:
    return None if strategy is None else strategy.partition(":")[0]


def seed_seconds(run: dict, profiles: dict, link_bps: float, p: int, g: int,
                 **scales) -> float | None:  # fmt: skip
    """Modelled seconds of one report record to the target (its run's end when it missed:
    a lower bound); None when its recipe has no profile."""
    stages = profiles.get(_profile_key(run.get("strategy")))
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
    """Per report name: per-seed modelled seconds, mean, std, reach rate."""
    out: dict[str, dict] = {}
    for run in report["runs"]:
        seconds = seed_seconds(run, profiles, link_bps, p, g, **scales)
        if seconds is None:
            continue
        entry = out.setdefault(run["name"], {"seconds": [], "censored": [], "strategy":
                                             run["strategy"]})  # fmt: skip
        entry["seconds"].append(seconds)
        entry["censored"].append(not run["time_to_target"].get("reached"))
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


def check(profiles_from: list[str] | None = None) -> dict:
    """Every netem point of the repository predicted from the same recipe's other points;
    the error of the modelled samples/s against the measured, per point and summarised."""
    paths = profiles_from or sorted(
        str(Path(p).relative_to(REPO))
        for p in glob.glob(str(REPO / "docs/**/netem*.json"), recursive=True)
    )
    rows = []
    for path in paths:
        netem = json.loads((REPO / path).read_text())
        for row in netem.get("results", []):
            rows.append((path, row))
    points = []
    for path, row in rows:
        for key, run in row.get("runs", {}).items():
            for stage, measured in _stages(run):
                predicted, source = _predict(path, row, key, stage, rows)
                if predicted is None:
                    continue
                points.append({
                    "file": path, "bandwidth_mbit": row["bandwidth_mbit"],
                    "world_size": row["world_size"],
                    "ranks_per_host": row.get("ranks_per_host", 1), "recipe": key,
                    "stage": stage, "measured_samples_per_s": measured["samples_per_s"],
                    "modelled_samples_per_s": predicted, "from": source,
                    "error": predicted / measured["samples_per_s"] - 1,
                })  # fmt: skip
    return {"points": points, "summary": _summary(points)}


def _predict(path: str, row: dict, key: str, stage: str, rows: list) -> tuple:
    """Samples/s of (row, key, stage) from the same sweep's other bandwidth, else from other
    sweeps of the same layout (median; their compute rescaled by the rows' compute-only
    speeds, the machine's state); the row's own measurement is never used."""
    p, g = row["world_size"], row.get("ranks_per_host", 1)
    same = [(f, r) for f, r in rows if f == path and r is not row]
    other = [(f, r) for f, r in rows if f != path]
    for label, pool in (("same sweep", same), ("other sweeps", other)):
        guesses = []
        for f, r in pool:
            if (r["world_size"], r.get("ranks_per_host", 1)) != (p, g) or key not in r["runs"]:
                continue
            partner = [x for x in rows if x[0] == f and key in x[1]["runs"]
                       and x[1]["world_size"] == p and x[1] is not row]  # fmt: skip
            speed = row["compute_only_samples_per_s"] if label == "other sweeps" else None
            prof = profiles_of([x[1] for x in partner], f, key, speed)
            if stage in prof:
                step = step_seconds(prof[stage], row["bandwidth_mbit"] * 1e6, p, g)
                guesses.append(p * prof[stage].batch_per_rank / step)
        if guesses:
            guesses.sort()
            return guesses[len(guesses) // 2], label
    return None, None


def _summary(points: list[dict]) -> dict:
    def stats(sel: list[dict]) -> dict:
        errors = sorted(abs(p["error"]) for p in sel)
        if not errors:
            return {"points": 0}
        return {"points": len(errors), "median_abs_error": errors[len(errors) // 2],
                "p90_abs_error": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
                "max_abs_error": errors[-1],
                "mean_error": sum(p["error"] for p in sel) / len(sel)}  # fmt: skip

    out = {"all": stats(points)}
    for label in ("same sweep", "other sweeps"):
        out[label] = stats([p for p in points if p["from"] == label])
    for bw in sorted({p["bandwidth_mbit"] for p in points}):
        out[f"{bw:g} Mbit/s"] = stats([p for p in points if p["bandwidth_mbit"] == bw])
    return out


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


def crossovers(report: dict, profiles: dict, a: str = "lamb", b: str = "onebit_lamb",
               workers=WORKERS, gpus_per_node: int = 2) -> list[dict]:  # fmt: skip
    """Per cluster size: the link below which ``b`` reaches the target first, for the
    means and for the seeds' spread (``b``'s mean + std against ``a``'s mean - std, and the
    other way round: the range the crossing can lie in)."""
    out = []
    for p in workers:
        found = {}
        for label, shift in (("mean", 0.0), ("low", 1.0), ("high", -1.0)):
            bps = crossover(report, profiles, a, b, p, gpus_per_node, shift=shift)
            found[label] = None if bps is None else bps / 1e9
        out.append({"ranks": p, "gpus_per_node": gpus_per_node, "pair": [a, b],
                    "crossover_gbps": found["mean"],
                    "crossover_range_gbps": [found["low"], found["high"]]})  # fmt: skip
    return out


def plot(report: dict, profiles: dict, path: Path, ranks=(4, 64), gpus_per_node: int = 2) -> None:
    """Time to the target against the link per recipe, the band its seeds' spread gives
    (mean ± std), one panel per cluster size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [10 ** (7 + 5 * i / 50) for i in range(51)]  # 10 Mbit/s .. 1 Tbit/s
    fig, axes = plt.subplots(1, len(ranks), figsize=(7 * len(ranks), 5), squeeze=False)
    for ax, p in zip(axes[0], ranks, strict=True):
        series: dict[str, list] = {}
        for bps in grid:
            for name, t in recipe_times(report, profiles, bps, p, gpus_per_node).items():
                if not all(t["censored"]):
                    series.setdefault(name, []).append((bps / 1e9, t["mean"] / 3600,
                                                        t["std"] / 3600))  # fmt: skip
        for name, points in series.items():
            xs, ys, ss = zip(*points, strict=True)
            style = "-" if name in ("lamb", "onebit_lamb") else ":"
            (line,) = ax.plot(xs, ys, style, label=name, linewidth=2 if style == "-" else 1)
            ax.fill_between(xs, [y - s for y, s in zip(ys, ss, strict=True)],
                            [y + s for y, s in zip(ys, ss, strict=True)],
                            color=line.get_color(), alpha=0.12)  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link per node (Gbit/s)")
        ax.set_ylabel("modelled time to the target (h)")
        ax.set_title(f"{p} ranks, {gpus_per_node} per node; band: mean ± std over seeds")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.crossover``: print the model's check against every netem point
    and the crossover; with ``--out``, write ``crossover.json`` and ``crossover.png``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.crossover", description=__doc__)
    parser.add_argument("--report", default="docs/compare/tuned/report.json")
    parser.add_argument("--out", type=Path, help="folder for crossover.json and crossover.png")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    netem = report["time_model"]["netem"]
    if not netem:
        parser.error(f"{args.report} has no netem files (time_model.netem): no speeds to model")
    profiles, _ = load_profiles(netem)
    checked = check()
    result = {
        "report": args.report,
        "netem": netem,
        "check": checked["summary"],
        "crossover": crossovers(report, profiles),
        "sweep": sweep(report, profiles),
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "crossover.json").write_text(
            json.dumps({**result, "check_points": checked["points"]}, indent=1) + "\n"
        )
        plot(report, profiles, args.out / "crossover.png")
    print(json.dumps({k: v for k, v in result.items() if k != "sweep"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
