"""Which post-freeze figure goes with the seed pairs a candidate loses: the mechanism
report's figures of several seed pairs set beside the paired gate's per-pair outcome.

Each ``--run SEED=DIR`` names a folder written by :mod:`pipeline.reports.mechanism` for one
seed pair (a LAMB run and the candidate run of the same seed); ``--gate`` is the parity
report (``report.json``) whose paired gate gives, per seed, log(samples_candidate /
samples_LAMB). Per figure and kept checkpoint this lists every pair's value and the Pearson
correlation across pairs between the figure and that log ratio, beside the |r| a
correlation of that many pairs needs for p < 0.05 (two-sided), before any allowance for the
number of figures and checkpoints read. The figures:

* ``moved``, ``step``, ``mv``, ``sqrt_v``: the median over layers of the per-layer ratio candidate /
  LAMB (the mechanism report's ``pairs``);
* ``v_cos``, ``v_cos_reference``: how far the candidate's second moment turns its own and
  LAMB's direction against LAMB's second moment (the mechanism report's ``cosines``);
* ``cf``: the candidate's median c·f, ``lamb_ratio``: LAMB's median trust ratio;
* ``compression_error``, ``factor_mean``: the candidate's logged figures averaged over the
  steps since the previous checkpoint, ``grad_norm_max`` its largest gradient norm before
  clipping there (the mechanism report's ``intervals``).

It describes; it does not test a hypothesis fixed in advance.

``python -m pipeline.reports.mechanism_pairs --gate REPORT_JSON --arm onebit_lamb
--run 1=DIR1 ... --out DIR``
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from onebit_bert.io import atomic_write_json, atomic_write_text
from pipeline.reports import cli
from pipeline.reports.stats import correlation, t_quantile

PAIR_FIGURES = ("moved", "step", "mv", "sqrt_v")
PAIR_COSINES = ("v_cos", "v_cos_reference")
CANDIDATE_MEDIANS = ("cf",)
REFERENCE_MEDIANS = ("lamb_ratio",)
CANDIDATE_INTERVALS = ("compression_error", "factor_mean", "grad_norm_max")
FIGURES = PAIR_FIGURES + PAIR_COSINES + CANDIDATE_MEDIANS + REFERENCE_MEDIANS + CANDIDATE_INTERVALS


def critical_r(n: int, alpha: float = 0.05) -> float:
    """The |r| that n pairs need for a two-sided p below ``alpha`` (Student's t with n - 2
    degrees of freedom)."""
    if n < 3:
        raise ValueError(f"a correlation needs at least 3 pairs, got {n}")
    t = t_quantile(1 - alpha / 2, n - 2)
    return t / math.sqrt(n - 2 + t * t)


def log_ratios(gate_report: dict, arm: str) -> dict[int, float]:
    """seed -> log(samples_arm / samples_reference) from a parity report's paired gate."""
    gates = (gate_report.get("gate") or {}).get("gates") or {}
    if arm not in gates:
        raise ValueError(
            f"the gate report has no paired gate for arm {arm!r} (it has {sorted(gates)}); "
            "pass --arm with one of them"
        )
    gate = gates[arm]
    if "log_ratios" not in gate:
        raise ValueError(
            f"arm {arm!r}'s gate is not a paired one: rerun the report with --test paired"
        )
    return {int(s): float(v) for s, v in zip(gate["seeds"], gate["log_ratios"], strict=True)}


def pair_figures(mechanism: dict, candidate: str) -> dict[str, dict[int, float]]:
    """figure -> {checkpoint step: value} for one seed pair's mechanism report, the
    candidate named ``candidate``."""
    runs = {run["name"]: run for run in mechanism["runs"]}
    pair = next((p for p in mechanism["pairs"] if p["candidate"] == candidate), None)
    if pair is None:
        raise ValueError(
            f"the mechanism report has no pair for candidate {candidate!r} (its pairs: "
            f"{[p['candidate'] for p in mechanism['pairs']]}); pass --candidate"
        )
    cand, ref = runs[candidate], runs[pair["reference"]]
    out: dict[str, dict[int, float]] = {f: {} for f in FIGURES}
    for field, keys in (("ratios", PAIR_FIGURES), ("cosines", PAIR_COSINES)):
        for step, row in (pair.get(field) or {}).items():
            for key in keys:
                if key in row:
                    out[key][int(step)] = float(row[key])
    for source, keys, field in (
        (cand, CANDIDATE_MEDIANS, "medians"),
        (ref, REFERENCE_MEDIANS, "medians"),
        (cand, CANDIDATE_INTERVALS, "intervals"),
    ):
        for step, row in (source.get(field) or {}).items():
            for key in keys:
                if key in row:
                    out[key][int(step)] = float(row[key])
    return out


def correlate(per_seed: dict[int, dict], log_ratio: list[float]) -> dict:
    """Per figure and step every pair has: the values, seed for seed (ascending), and their
    Pearson r with ``log_ratio`` (in the same order; None where either has no spread)."""
    seeds = sorted(per_seed)
    out = {}
    for figure in FIGURES:
        steps = set.intersection(*(set(per_seed[s][figure]) for s in seeds))
        rows = {}
        for step in sorted(steps):
            values = [per_seed[s][figure][step] for s in seeds]
            rows[step] = {"values": values, "r": correlation(values, log_ratio)}
        if rows:
            out[figure] = rows
    return out


def markdown(result: dict) -> str:
    """One table per figure: a row per seed pair (with its samples ratio), a column per
    checkpoint, and the correlation row."""
    seeds, ratios, n = result["seeds"], result["log_ratios"], len(result["seeds"])
    lines = [
        f"# Mechanism figures against the paired gate: {result['arm']}, {n} seed pairs",
        "",
        f"Correlation r across the {n} pairs with log(samples ratio); |r| > "
        f"{result['critical_r']:.3f} is needed for p < 0.05 (two-sided) at one figure and "
        "one checkpoint, before any allowance for how many are read. Descriptive.",
    ]
    for figure, rows in result["figures"].items():
        steps = list(rows)
        lines += ["", f"## {figure}", ""]
        lines.append("| seed | samples ratio | " + " | ".join(str(s) for s in steps) + " |")
        lines.append("|---:|---:|" + "---:|" * len(steps))
        for i, seed in enumerate(seeds):
            cells = " | ".join(f"{rows[s]['values'][i]:.3f}" for s in steps)
            lines.append(f"| {seed} | {math.exp(ratios[i]):.3f} | {cells} |")
        rs = " | ".join("–" if rows[s]["r"] is None else f"{rows[s]['r']:+.2f}" for s in steps)
        lines.append(f"| r | | {rs} |")
    return "\n".join(lines) + "\n"


def analyse(gate_report: dict, arm: str, pairs: dict[int, dict], candidate: str) -> dict:
    """The correlation tables for ``pairs`` (seed -> mechanism report)."""
    ratios = log_ratios(gate_report, arm)
    seeds = sorted(pairs)
    missing = [s for s in seeds if s not in ratios]
    if missing:
        raise ValueError(f"the gate report has no pair for seed(s) {missing}")
    critical = critical_r(len(seeds))
    per_seed = {seed: pair_figures(pairs[seed], candidate) for seed in seeds}
    log_ratio = [ratios[s] for s in seeds]
    return {
        "arm": arm,
        "candidate": candidate,
        "seeds": seeds,
        "log_ratios": log_ratio,
        "critical_r": critical,
        "figures": correlate(per_seed, log_ratio),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.mechanism_pairs --gate R --arm A --run SEED=DIR ...``."""
    summary = " ".join(__doc__.split("\n\n")[0].split())
    parser = cli.report_parser("pipeline.reports.mechanism_pairs", summary, "SEED=DIR")
    parser.add_argument("--gate", required=True, help="the parity report.json with the paired gate")
    parser.add_argument("--arm", required=True, help="the gated arm, as named in the report")
    parser.add_argument(
        "--candidate", help="its run's name in the mechanism reports (default: the arm's)"
    )

    def write(args) -> str:
        pairs = {}
        for spec in args.run:
            seed, _, directory = spec.partition("=")
            if not seed.isdigit() or not directory:
                raise ValueError(f"--run {spec!r} is not of the form SEED=DIR")
            path = Path(directory) / "mechanism.json"
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} does not exist: run python -m pipeline.reports.mechanism "
                    f"--out {directory} first"
                )
            pairs[int(seed)] = json.loads(path.read_text())
        gate = json.loads(Path(args.gate).read_text())
        result = analyse(gate, args.arm, pairs, args.candidate or args.arm)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "pairs.json", result)
        atomic_write_text(out / "pairs.md", markdown(result))
        return f"mechanism pairs: {out}/pairs.md"

    return cli.run(parser, argv, write)


if __name__ == "__main__":
    raise SystemExit(main())
