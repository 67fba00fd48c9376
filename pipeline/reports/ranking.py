"""Which recipes reach the target first at each bandwidth: groups, not a single winner.

**Censored seeds.** A seed that never reaches the target is not dropped: its time to the
target is at least the modelled time of its whole run (:func:`run_end`, stored in its
``time_to_target`` block as ``run_end``), so it counts with that lower bound. A recipe's
mean over its seeds is then a lower bound too, marked ``≥``, and the reach rate (seeds at
the target / seeds) stands beside it.

**Groups.** Per bandwidth the recipe with the lowest mean leads. Every other recipe is set
against it (:data:`ALPHA`): by the paired t-test on the log ratio of the times of the
seeds they share, seed k of every recipe starting from the same initialisation and data
order (:func:`pairing_key` checks seed, data identity, batch and length; records without
their data pair with nothing), or by Welch's two-sided t-test on every seed where fewer
than two seeds pair. One that is significantly slower is *behind*, one that is not is
among the *leaders*: the data cannot tell it from the first. Each pair's detectable
difference says how large a gap the test could have found with :data:`POWER`
(:func:`detectable_difference`, :func:`paired_detectable_difference`): two unpaired seeds
per recipe detect only gaps of tens of per cent; pairs remove the spread the seeds share.
A censored seed's lower bound makes its recipe look faster than it is, so "behind" stays a
safe call for it; a leader with censored seeds is flagged, since against it "behind" may
be too generous.

**The sweep's spread.** Speeds measured more than once (``bench.netem --repeats``) give
each seed one time per repeat. A recipe's interval is the union of its repeats' t
intervals (:func:`interval`), and a recipe is behind only when it is behind at every pair
of repeats: a difference the machine's run-to-run speed could make is not called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.reports.stats import mean_std, t_quantile, t_two_sided_p, welch_t_test
from pipeline.reports.timing import (
    seconds_by_bandwidth,
    seconds_by_repeat,
    speeds,
    speeds_by_repeat,
    stage_steps,
)

ALPHA = 0.05
POWER = 0.8
TEST = (
    "against the first, the paired two-sided t-test on the log ratio of per-seed modelled "
    "times over the seeds the two share (same seed, data, batch and length; n - 1 df), or "
    f"where fewer than two pair, Welch's two-sided t-test on every seed; alpha = {ALPHA}; "
    f"detectable difference at {POWER:.0%} power: (t(1 - alpha/2, df) + t(power, df)) · "
    "standard error (of the mean log ratio, or Welch's with Welch–Satterthwaite df, in % of "
    "the first's mean); a seed that never reached the target "
    "counts with its run's end as a lower bound (≥); where the speeds were measured more "
    "than once, behind means slower at every pair of repeats, and the interval [lo, hi] of "
    "a mean is the union of the repeats' 95 % t intervals over seeds (cut at zero)"
)


PREREGISTERED = "configs/compare/groups.yaml"
"""Where the comparison's test, margin and seed count were fixed before the seeds they judge
(:func:`load_preregistration`), relative to the repository root."""


@dataclass(frozen=True)
class Preregistration:
    """The groups' test as fixed before the runs it judges (:data:`PREREGISTERED`)."""

    path: str
    test: str
    alpha: float
    power: float
    within: float
    """a recipe whose mean time is within this share of the first's owes seeds"""
    seeds: int
    """the seeds each such recipe gets"""
    leaders: bool
    """every leader (not separable from the first) owes seeds too, however far behind"""
    bandwidths_mbit: tuple[float, ...]
    sweep_repeats: int
    preregistered: str
    """when it was fixed (ISO 8601 UTC)"""
    amended: str | None
    """when and why it was changed, before any run it judges (None: never)"""

    def as_dict(self) -> dict:
        return {**self.__dict__, "bandwidths_mbit": list(self.bandwidths_mbit)}


def load_preregistration(path: str | Path = PREREGISTERED) -> Preregistration:
    """Read a pre-registration file; refused (one error naming the file and the field) when
    a field is missing or unknown, or when its test is not the one :func:`groups` computes
    (the paired test at :data:`ALPHA`, detectable differences at :data:`POWER`)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such pre-registration file (see {PREREGISTERED})")
    raw = yaml.safe_load(path.read_text()) or {}
    fields = [f for f in Preregistration.__dataclass_fields__ if f != "path"]
    raw.setdefault("amended", None)
    missing = [f for f in fields if f not in raw]
    unknown = sorted(set(raw) - set(fields))
    if missing or unknown:
        raise ValueError(f"{path}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}"
                         f"; it needs exactly {', '.join(fields)}")  # fmt: skip
    computed = {"test": "paired", "alpha": ALPHA, "power": POWER}
    for key, value in computed.items():
        if raw[key] != value:
            raise ValueError(
                f"{path}: {key} is {raw[key]!r}, but pipeline.reports.ranking computes "
                f"{key} {value!r}: a different test is a code change, made before the runs"
            )
    if float(raw["within"]) <= 0 or int(raw["seeds"]) < 2:
        raise ValueError(f"{path}: within must be > 0 and seeds >= 2")
    return Preregistration(
        path=str(path), test=raw["test"], alpha=float(raw["alpha"]),
        power=float(raw["power"]), within=float(raw["within"]), seeds=int(raw["seeds"]),
        leaders=bool(raw["leaders"]),
        bandwidths_mbit=tuple(float(b) for b in raw["bandwidths_mbit"]),
        sweep_repeats=int(raw["sweep_repeats"]), preregistered=str(raw["preregistered"]),
        amended=None if raw["amended"] is None else str(raw["amended"]),
    )  # fmt: skip


def preregistration_lines(plan: Preregistration, report: dict) -> list[str]:
    """The report's statement of its pre-registered test and what it still owes: the
    recipes short of ``plan.seeds`` (:func:`seeds_owed`), and the pre-registered bandwidths
    the groups lack."""
    owed = seeds_owed(report, plan.within, plan.seeds, plan.leaders)
    have = {float(row["bandwidth_mbit"]) for row in report.get("groups") or []}
    absent = [bandwidth_label(b) for b in plan.bandwidths_mbit if b not in have]
    who = f"every recipe within {plan.within * 100:g} % of the first at a bandwidth"
    text = (
        f"Pre-registered on {plan.preregistered} in `{plan.path}`: the test above, "
        f"{who}{' or among its leaders' if plan.leaders else ''} to {plan.seeds} seeds, "
        f"at {' and '.join(bandwidth_label(b) for b in plan.bandwidths_mbit)} with "
        f"{plan.sweep_repeats} repeats of the sweep"
        + (f" (amended {plan.amended})" if plan.amended else "") + ". "
    )  # fmt: skip
    if owed:
        text += (f"**Seeds still owed**: {owed_text(owed, plan.seeds)}; until they run, "
                 "these groups are provisional.")  # fmt: skip
    else:
        text += f"Every such recipe has its {plan.seeds} seeds."
    if absent:
        text += f" **Not measured**: {', '.join(absent)}."
    return [text, ""]


# ----------------------------------------------------------------------------- censoring


def _run_stages(run: dict, siblings: list[dict]) -> dict[str, float] | None:
    """Steps per stage of the whole run: from its per-step stages (a run read from its
    directory), its stored curve, or a sibling seed's split at the target with the last
    stage carried on to the run's end (stages only ever move forward)."""
    steps = float(run["steps"])
    if run.get("stages") is not None:
        return stage_steps(run, steps)
    curve = [p for p in run.get("curve") or [] if p.get("stage_steps")]
    candidates = [curve[-1]["stage_steps"]] if curve else []
    candidates += [
        s["time_to_target"]["stage_steps"]
        for s in siblings
        if (s.get("time_to_target") or {}).get("stage_steps")
    ]
    if not candidates:
        return {"default": steps}
    split = dict(candidates[0])
    last = list(split)[-1]
    split[last] += steps - sum(split.values())
    return split


def run_end(run: dict, netem: dict | None, siblings: list[dict]) -> dict:
    """The lower bound of a censored seed's time to the target: the samples of its whole
    run and their modelled seconds per bandwidth (empty where its speed is not measured)."""
    batch = run["global_batch_size"]
    split = _run_stages(run, siblings)
    measured = speeds(netem, run.get("strategy"), run.get("world_size"))
    out = {
        "samples": float(run["steps"]) * batch,
        "stage_steps": split,
        "seconds": seconds_by_bandwidth(split, batch, measured),
    }
    repeated = seconds_by_repeat(
        split, batch, speeds_by_repeat(netem, run.get("strategy"), run.get("world_size"))
    )
    if repeated:
        out["seconds_by_repeat"] = repeated
    return out


def attach_run_ends(arms: list[dict], netem: dict | None) -> None:
    """Give every seed that did not reach the target its ``run_end`` (in place)."""
    for arm in arms:
        for run in arm["seeds"]:
            block = run["time_to_target"]
            if not block.get("reached") and run.get("steps"):
                block["run_end"] = run_end(run, netem, arm["seeds"])


# ----------------------------------------------------------------------------- groups


def detectable_difference(a: list[float], b: list[float], alpha: float = ALPHA,
                          power: float = POWER) -> float | None:  # fmt: skip
    """The smallest difference of means Welch's two-sided test at ``alpha`` detects with
    probability ``power``, from the two samples' spreads (normal-shift approximation with
    t quantiles at the Welch–Satterthwaite df); None with fewer than two values a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = mean_std(a)[1] ** 2 / len(a), mean_std(b)[1] ** 2 / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return (t_quantile(1 - alpha / 2, df) + t_quantile(power, df)) * se


def _entry(arm: dict, key: str) -> dict | None:
    """One recipe's per-seed times at bandwidth ``key``; None when no seed has a time.
    Where the sweep measured the bandwidth more than once, ``by_repeat`` holds the seeds'
    times at each repeat's speeds."""
    values, censored, repeated, pairs = [], [], [], []
    for run in arm["seeds"]:
        block = run["time_to_target"]
        if not block.get("reached"):
            block = block.get("run_end") or {}
        value = (block.get("seconds") or {}).get(key)
        if value is None:
            continue
        values.append(value)
        censored.append(not run["time_to_target"].get("reached"))
        repeated.append((block.get("seconds_by_repeat") or {}).get(key))
        pairs.append(pairing_key(run))
    if not values:
        return None
    counts = {len(r) if r else 0 for r in repeated}
    by_repeat = None
    if len(counts) == 1 and 0 not in counts:
        by_repeat = [list(t) for t in zip(*repeated, strict=True)]
    return {
        "name": arm["name"],
        "seconds": values,
        "censored": censored,
        "reached": sum(1 for r in arm["seeds"] if r["time_to_target"].get("reached")),
        "seeds": len(arm["seeds"]),
        "mean": sum(values) / len(values),
        "lower_bound": any(censored),
        **({"by_repeat": by_repeat} if by_repeat else {}),
        "interval": interval(by_repeat or [values]),
        "pairing": pairs,
    }


PAIRING_FIELDS = ("seed", "data", "global_batch_size", "steps")
"""The fields of a run record that :func:`pairing_key` reads."""


def pairing_key(run: dict) -> list | None:
    """What makes seed k of two recipes a pair: the seed (initialisation and data order),
    the data identity, the global batch and the run's length. None when the run does not
    record its data (an earlier vocabulary's record) or its seed: it pairs with nothing."""
    if run.get("seed") is None or not run.get("data"):
        return None
    data = run["data"]
    return [run["seed"], data.get("tokenizer_sha256"), data.get("shards_sha256"),
            run.get("global_batch_size"), run.get("steps")]  # fmt: skip


def common_pairs(first: dict, entry: dict) -> list[tuple[int, int]]:
    """(index in ``first``, index in ``entry``) of the seeds the two share by
    :func:`pairing_key`."""
    where = {tuple(k): i for i, k in enumerate(first.get("pairing") or []) if k is not None}
    return [(where[tuple(k)], j) for j, k in enumerate(entry.get("pairing") or [])
            if k is not None and tuple(k) in where]  # fmt: skip


def paired_t_test(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Two-sided paired t-test on log(b_i / a_i): (mean log ratio, its standard deviation,
    p). With no spread, p is 1 for a zero mean and 0 otherwise."""
    logs = [math.log(y / x) for x, y in zip(a, b, strict=True)]
    mean, sd = mean_std(logs)
    if sd == 0:
        return mean, sd, 1.0 if mean == 0 else 0.0
    return mean, sd, t_two_sided_p(mean / (sd / math.sqrt(len(logs))), len(logs) - 1)


def paired_detectable_difference(sd: float, n: int, alpha: float = ALPHA,
                                 power: float = POWER) -> float:  # fmt: skip
    """The smallest ratio - 1 the paired test on ``n`` pairs with log-ratio spread ``sd``
    detects with probability ``power``: exp((t(1 - alpha/2) + t(power)) · sd / sqrt(n)) - 1,
    n - 1 df."""
    return math.expm1((t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1))
                      * sd / math.sqrt(n))  # fmt: skip


def interval(samples: list[list[float]], level: float = 0.95) -> list[float]:
    """The ``level`` confidence interval of the mean time, widened by the sweep: the union
    over the repeats of the sweep (``samples``: the seeds' times at each repeat's speeds,
    one list for a sweep measured once) of Student's t interval over the seeds (a single
    seed's interval is its value). A time is never negative: a t interval that reaches
    below zero (two seeds far apart) is cut there."""
    lows, highs = [], []
    for values in samples:
        mean, std = mean_std(values)
        half = 0.0
        if len(values) > 1:
            half = t_quantile(0.5 + level / 2, len(values) - 1) * std / math.sqrt(len(values))
        lows.append(max(0.0, mean - half))
        highs.append(mean + half)
    return [min(lows), max(highs)]


def groups(arms: list[dict], bandwidths: list[float]) -> list[dict]:
    """Per bandwidth: every timed recipe by mean (censored seeds at their lower bound), the
    leaders (not separable from the first), the recipes clearly behind it, those that
    cannot be tested (one seed), those no seed of which reached the target, and those
    without a measured speed there."""
    out = []
    for bw in bandwidths:
        key = f"{bw:g}"
        ranking, missed, unmeasured = [], [], []
        for arm in arms:
            reached = any(r["time_to_target"].get("reached") for r in arm["seeds"])
            entry = _entry(arm, key)
            if not reached:
                missed.append(arm["name"])
            elif entry is None:
                unmeasured.append(arm["name"])
            else:
                ranking.append(entry)
        ranking.sort(key=lambda e: e["mean"])
        row = {"bandwidth_mbit": bw, "test": TEST, "ranking": ranking, "leaders": [],
               "behind": [], "untested": [], "not_reached": missed,
               "not_measured": unmeasured}  # fmt: skip
        if ranking:
            first = ranking[0]
            row["leaders"].append(first["name"])
            for entry in ranking[1:]:
                _compare(first, entry, row)
            if len(first["seconds"]) < 2:
                row["untested"] = [e["name"] for e in ranking[1:]]
                row["leaders"], row["behind"] = [first["name"]], []
        out.append(row)
    return out


def _compare(first: dict, entry: dict, row: dict) -> None:
    """``entry`` against the first. Where two or more of their seeds pair
    (:func:`pairing_key`: same seed, data, batch and length), the paired t-test on the log
    ratio of those seeds' times (``test``: "paired"); otherwise Welch's test on every
    seed. Behind when the test finds it slower at every pair of the sweep's repeats (the
    first's times at one repeat's speeds, ``entry``'s at another), so that the run-to-run
    spread of the speeds cannot make a tie look like a gap; ``p_vs_first`` is the largest
    p of those pairs (the one pair without repeats)."""
    common = common_pairs(first, entry)
    paired = len(common) >= 2
    if not paired and (len(entry["seconds"]) < 2 or len(first["seconds"]) < 2):
        row["untested"].append(entry["name"])
        return
    slower, p_max, sds = True, 0.0, []
    for a in first.get("by_repeat") or [first["seconds"]]:
        for b in entry.get("by_repeat") or [entry["seconds"]]:
            if paired:
                mean_log, sd, p = paired_t_test([a[i] for i, _ in common],
                                                [b[j] for _, j in common])  # fmt: skip
                sds.append(sd)
                slower = slower and mean_log > 0
            else:
                p = welch_t_test(a, b).p
                slower = slower and sum(b) / len(b) > sum(a) / len(a)
            p_max = max(p_max, p)
    entry["test"] = "paired" if paired else "welch"
    entry["p_vs_first"] = p_max
    if paired:
        entry["pairs_vs_first"] = len(common)
        dd = paired_detectable_difference(max(sds), len(common))
        entry["detectable_difference_pct"] = 100 * dd
    else:
        dd = detectable_difference(first["seconds"], entry["seconds"])
        entry["detectable_difference_pct"] = 100 * dd / first["mean"]
    if p_max < ALPHA and slower:
        row["behind"].append(entry["name"])
    else:
        row["leaders"].append(entry["name"])


# ----------------------------------------------------------------------------- text


def bandwidth_label(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def human_seconds(value: float) -> str:
    """Seconds as reports print them: hours, minutes or seconds."""
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


def entry_text(entry: dict) -> str:
    """``name ≥ 3.85 h [3.60 h, 4.10 h] (3/4)``: mean (a lower bound when a seed is
    censored), its interval (:func:`interval`; left out for one seed measured once), reach
    rate."""
    mark = "≥ " if entry["lower_bound"] else ""
    rate = f"{entry['reached']}/{entry['seeds']}"
    text = f"{entry['name']} {mark}{human_seconds(entry['mean'])}"
    lo, hi = entry.get("interval") or (entry["mean"], entry["mean"])
    if hi > lo:
        text += f" [{human_seconds(lo)}, {human_seconds(hi)}]"
    return f"{text} ({rate})"


def answer(row: dict) -> str:
    """The per-bandwidth answer in one sentence: the leading group and its detectable
    difference, what is clearly behind."""
    by_name = {e["name"]: e for e in row["ranking"]}
    if not row["ranking"]:
        return "no recipe has a modelled time here"
    first = row["ranking"][0]
    if len(first["seconds"]) < 2:
        return f"{entry_text(first)} is first, on one seed: no test"
    leaders = [entry_text(by_name[n]) for n in row["leaders"]]
    pcts = [by_name[n]["detectable_difference_pct"] for n in row["leaders"][1:]]
    if pcts:
        span = f"{min(pcts):.0f}–{max(pcts):.0f} %" if len(pcts) > 1 else f"{pcts[0]:.0f} %"
        text = (f"leaders not separable at this power (detectable difference {span}): "
                f"{', '.join(leaders)}")  # fmt: skip
    else:
        # each recipe behind was judged by the paired test or Welch's (see _compare)
        tests = sorted({by_name[n]["test"] for n in row["behind"]})
        names = " or ".join("paired t-test" if t == "paired" else "Welch" for t in tests)
        if tests:
            text = f"{leaders[0]} is ahead of every recipe tested against it ({names}, p < {ALPHA})"
        else:
            text = f"{leaders[0]} is first; no other recipe could be tested against it"
    if first["lower_bound"]:
        text += f" ({first['name']}'s mean is a lower bound: a seed missed the target)"
    return text


def group_lines(rows: list[dict]) -> list[str]:
    """The report's section for :func:`groups`."""
    if not rows:
        return []
    lines = [
        "## Which recipes reach the target first",
        "",
        "Per bandwidth of the netem benchmark, recipes by modelled time to the target: the "
        "mean over every seed (seeds at target / seeds), where a seed that never reached the "
        "target counts with its run's end as a lower bound, so the mean is one too (≥). "
        f"Test: {rows[0].get('test', TEST)}. *Leaders*: the first and every recipe the test "
        "cannot tell from it; *behind*: slower than the first at p < 0.05.",
        "",
        "| bandwidth | the answer | clearly behind | one seed (no test) | never reached "
        "| not measured |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        by_name = {e["name"]: e for e in row["ranking"]}
        behind = ", ".join(entry_text(by_name[n]) for n in row["behind"]) or "–"
        untested = ", ".join(entry_text(by_name[n]) for n in row["untested"]) or "–"
        lines.append(
            f"| {bandwidth_label(row['bandwidth_mbit'])} | {answer(row)} | {behind} | "
            f"{untested} | {', '.join(row['not_reached']) or '–'} | "
            f"{', '.join(row['not_measured']) or '–'} |"
        )
    return [*lines, ""]


# ----------------------------------------------------------------------------- seeds owed


def seeds_owed(report: dict, within: float, seeds: int, leaders: bool = False) -> list[dict]:
    """The recipes a comparison owes more seeds: every recipe whose mean time to the target
    at some bandwidth of ``report["groups"]`` is within ``within`` of that bandwidth's
    first, or with ``leaders`` is among that bandwidth's leaders, and that has fewer than
    ``seeds`` seeds. One entry per recipe: its seeds now, the
    bandwidths that put it there, and the ``--nodes`` its tuning ran with (so that
    ``pipeline.tune --evaluate`` can run the rest the same way)."""
    owed: dict[str, dict] = {}
    for row in report.get("groups") or []:
        if not row["ranking"]:
            continue
        first = row["ranking"][0]["mean"]
        leading = set(row.get("leaders") or ()) if leaders else set()
        for entry in row["ranking"]:
            close = entry["mean"] <= (1 + within) * first or entry["name"] in leading
            if close and entry["seeds"] < seeds:
                item = owed.setdefault(entry["name"], {
                    "name": entry["name"], "seeds": entry["seeds"], "bandwidths_mbit": [],
                    "nodes": ((report.get("tuning") or {}).get(entry["name"]) or {}).get(
                        "nodes", 1),
                })  # fmt: skip
                item["bandwidths_mbit"].append(row["bandwidth_mbit"])
    return sorted(owed.values(), key=lambda e: e["name"])


def owed_text(owed: list[dict], seeds: int) -> str:
    """``name (have/seeds), ...`` for :func:`seeds_owed`'s entries."""
    return ", ".join(f"{e['name']} ({e['seeds']}/{seeds})" for e in owed)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.ranking --report R [--preregistered F]``: the recipes
    that owe seeds (:func:`seeds_owed`) under the pre-registered margin, leaders rule and
    seed count, one ``RECIPE NODES`` line each."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m pipeline.reports.ranking",
                                     description=main.__doc__)  # fmt: skip
    parser.add_argument("--report", default="docs/results/compare/tuned/report.json")
    parser.add_argument(
        "--preregistered",
        default=PREREGISTERED,
        help=f"the pre-registered margin and seed count (default {PREREGISTERED})",
    )
    parser.add_argument("--json", action="store_true", help="the entries as JSON instead")
    args = parser.parse_args(argv)
    path = Path(args.report)
    if not path.is_file():
        parser.error(f"--report {path}: no such file (a pipeline.reports.compare report.json)")
    try:
        plan = load_preregistration(args.preregistered)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    owed = seeds_owed(json.loads(path.read_text()), plan.within, plan.seeds, plan.leaders)
    if args.json:
        print(json.dumps(owed))
    else:
        for entry in owed:
            print(entry["name"], entry["nodes"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
