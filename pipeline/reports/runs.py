"""Runs as both reports read them: loaded from their directories, grouped into arms, and
judged against the reference arm.

A run is one pretraining seed (:func:`load_run`): its curves, final metrics, bytes per kind
of traffic and fine-tuning results. Runs that share a name are one arm's seeds
(:func:`group_arms`); the first arm is the reference. Verdicts (:data:`TEST`) rest on the
spread between pretraining seeds: Welch's two-sided t-test on per-seed values
(:func:`welch_verdict`), or, where an arm has one seed, where that seed falls against the
reference's (:func:`verdict`, the comparison's rule).
"""

from __future__ import annotations

import math

from finetune import outputs as finetune_outputs
from onebit_bert.optim.auto_freeze import AUTO
from pipeline.reports.stats import mean_std, t_quantile, welch_t_test
from pipeline.reports.tables import summary
from pipeline.run_files import (
    RunInputs,
    by_samples,
    max_samples,
    parse_run,
    read_run,
    read_totals,
)

ALPHA = 0.05
TEST = (
    "Welch's two-sided t-test on per-pretraining-seed values (fine-tuning: each pretraining "
    f"seed's mean over its fine-tuning seeds), alpha = {ALPHA}: *differs* when p < {ALPHA}, "
    "otherwise *no significant difference*; an arm with a single pretraining seed gets "
    "*1 seed: no verdict*."
)
VERDICT_TEST = (
    f"two or more pretraining seeds: Welch's two-sided t-test on per-seed values, alpha = "
    f"{ALPHA}; one seed: *differs* when the value lies outside the reference's two-sided "
    f"95 % prediction interval for one more seed (mean ± t(0.975, n-1)·s·sqrt(1 + 1/n)); "
    f"the reference needs two or more seeds."
)
"""What :func:`verdict` does (the comparison's verdicts)."""
NO_VERDICT = "1 seed: no verdict"
NO_SIGNAL = "no signal at this scale"
SIGNAL_FACTOR = 3.0
"""A task carries signal when the reference's pretrained score beats the randomly
initialised baseline's by at least this many fine-tuning seed spreads."""
PRETRAIN_METRICS = ("val_mlm_accuracy", "val_mlm_loss", "val_nsp_accuracy", "final_train_loss")
SWITCH_KEYS = (
    "trust_ratio_min",
    "trust_ratio_mean",
    "trust_ratio_max",
    "factor_min",
    "factor_mean",
    "factor_max",
    "compression_error",
)


INTRA_NODE_BYTES = "comm_bytes_intra_node"
"""Not a kind of traffic: what a node hierarchy's phases kept inside a node (counted apart
from ``comm_bytes`` and from every kind)."""


def totals(by_step: dict[int, dict]) -> dict:
    """What a run's steps add up to: bytes in all (``comm_bytes_total``), bytes and
    seconds per kind of traffic (``comm_by_kind``), and the time of its first logged record
    (``started``). An archived record keeps these in ``totals.json`` (its metrics are
    thinned); :func:`load_run` reads them from there."""
    steps = sorted(by_step)
    times = [by_step[s]["time"] for s in steps if "time" in by_step[s]]
    by_kind: dict[str, list[float]] = {}  # kind -> [bytes, seconds] over the run
    for s in steps:
        for key, value in by_step[s].items():
            for prefix, slot in (("comm_bytes_", 0), ("comm_seconds_", 1)):
                if (
                    key.startswith(prefix)
                    and key != INTRA_NODE_BYTES
                    and isinstance(value, int | float)
                ):
                    by_kind.setdefault(key[len(prefix) :], [0, 0.0])[slot] += value
    return {
        "steps": len(steps),
        "started": min(times) if times else None,
        "comm_bytes_total": sum(
            by_step[s]["comm_bytes"] for s in steps if "comm_bytes" in by_step[s]
        ),
        "comm_by_kind": {k: {"bytes": b, "seconds": t} for k, (b, t) in sorted(by_kind.items())},
    }


def load_run(run: RunInputs, records: tuple[dict, dict[int, dict]] | None = None) -> dict:
    """One pretraining seed: its curves, final metrics and fine-tuning results (``records``:
    what :func:`read_run` returned, when the caller has read it already)."""
    config, by_step = records or read_run(run)
    batch = config["batch"]["global_batch_size"]
    optimizer = config["optimizer"]["name"]
    steps = sorted(by_step)
    train = [(s, by_step[s]["loss"]) for s in steps if "loss" in by_step[s]]
    final_val = next((by_step[s] for s in reversed(steps) if "val_mlm_accuracy" in by_step[s]), {})
    counted = read_totals(run.pretrain_dir) or totals(by_step)
    switch = {
        key: [(s, by_step[s][key]) for s in steps if key in by_step[s]] for key in SWITCH_KEYS
    }
    final = {k: final_val.get(k) for k in PRETRAIN_METRICS[:3]}
    final["final_train_loss"] = train[-1][1] if train else None
    return {
        "name": run.name,
        "pretrain_dir": str(run.pretrain_dir),
        "seed": config.get("seed"),
        "pairing": pairing_identity(config),
        "optimizer": optimizer,
        "freeze_step": _freeze_step(config, optimizer, by_step),
        "freeze_auto": "onebit" in optimizer and config["optimizer"].get("freeze_step") == AUTO,
        "global_batch_size": batch,
        "steps": steps[-1] if steps else 0,
        "train_loss": train,
        "val_mlm_accuracy": by_samples(by_step, batch, "val_mlm_accuracy"),
        "val_mlm_loss": by_samples(by_step, batch, "val_mlm_loss"),
        "started": counted["started"],
        "max_samples": max_samples(config, by_step),
        "switch": switch,
        "final": final,
        "comm_bytes_total": counted["comm_bytes_total"],
        "comm_by_kind": counted["comm_by_kind"],
        "finetune": {}
        if run.finetune_dir is None
        else finetune_outputs.read_results(run.finetune_dir),
    }


def load_runs(run_specs: list[str]) -> list[dict]:
    """Every ``NAME=PRETRAIN_DIR[:FINETUNE_DIR]`` run of ``run_specs``, loaded."""
    return [load_run(parse_run(spec, finetune_optional=True)) for spec in run_specs]


def _freeze_step(config: dict, optimizer: str, by_step: dict[int, dict]) -> int | None:
    """A 1-bit run's last warmup step: its ``freeze_step``, or with ``freeze_step: auto``
    the step the detector chose (the last step logged in stage ``warmup``; None before
    it has chosen)."""
    if "onebit" not in optimizer:
        return None
    freeze = config["optimizer"].get("freeze_step")
    if freeze != AUTO:
        return freeze
    warmup = [s for s in sorted(by_step) if by_step[s].get("stage") == "warmup"]
    last = max(by_step, default=0)
    return warmup[-1] if warmup and warmup[-1] < last else None


PAIRING_FIELDS = ("seed", "model", "batch", "data.path", "schedule.max_steps")
"""What seed k of two arms must share to be twins: the seed, the model and batch sections,
the data and the run's length (initialisation and data order are functions of these)."""


def pairing_identity(config: dict) -> dict:
    """The fields of a run's resolved config that :data:`PAIRING_FIELDS` names."""
    out = {}
    for name in PAIRING_FIELDS:
        value = config
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[name] = value
    return out


def check_pairing(reference: dict, candidate: dict) -> None:
    """Refuse arms whose seed-k runs are not twins: a seed in one arm only, or a pair that
    differs in a :data:`PAIRING_FIELDS` field (one error listing them)."""
    ref = {r["seed"]: r for r in reference["seeds"]}
    cand = {r["seed"]: r for r in candidate["seeds"]}
    problems = []
    if set(ref) != set(cand):
        problems.append(
            f"seeds {sorted(ref)} against {sorted(cand)} (every seed must be in both arms)"
        )
    for seed in sorted(set(ref) & set(cand)):
        a, b = ref[seed].get("pairing") or {}, cand[seed].get("pairing") or {}
        differ = [k for k in PAIRING_FIELDS if a.get(k) != b.get(k)]
        if differ:
            problems.append(f"seed {seed} differs in {', '.join(differ)}")
    if problems:
        raise ValueError(
            f"{candidate['name']} is not seed-matched with {reference['name']}: "
            + "; ".join(problems)
        )


def group_arms(runs: list[dict]) -> list[dict]:
    """Runs with the same name are one arm's pretraining seeds (first-seen order)."""
    arms: dict[str, dict] = {}
    for run in runs:
        arm = arms.setdefault(run["name"], {"name": run["name"], "seeds": []})
        if arm["seeds"] and arm["seeds"][0]["optimizer"] != run["optimizer"]:
            raise ValueError(
                f"arm {run['name']!r} mixes optimizers "
                f"{arm['seeds'][0]['optimizer']} and {run['optimizer']}"
            )
        arm["seeds"].append(run)
    for arm in arms.values():
        arm["optimizer"] = arm["seeds"][0]["optimizer"]
    return list(arms.values())


def finetune_values(run: dict, task: str, metric: str) -> list[float]:
    """One pretraining seed's scores for a task and metric, one per fine-tuning seed (at the
    best grid point); only the mean when the results carry no per-seed scores."""
    result = run["finetune"][task]
    per_seed = result.get("per_seed")
    if per_seed:
        return [float(m[metric]) for m in per_seed.values() if metric in m]
    return [float(result[metric])]


def no_verdict(reason: str) -> dict:
    return {"verdict": reason, "p": None, "t": None, "df": None, "standard_error": None}


def welch_verdict(reference: list[float], other: list[float]) -> dict:
    """Compare per-pretraining-seed values of an arm with the reference arm's."""
    if len(reference) < 2 or len(other) < 2:
        return no_verdict(NO_VERDICT)
    if any(math.isnan(v) for v in (*reference, *other)):
        return no_verdict("no verdict (NaN)")
    test = welch_t_test(reference, other)
    return {
        "verdict": "differs" if test.p < ALPHA else "no significant difference",
        "p": test.p,
        "t": test.t,
        "df": test.df,
        "standard_error": test.standard_error,
    }


def verdict(reference: list[float], other: list[float]) -> dict:
    """Welch for two or more seeds on each side; the reference's prediction interval for
    a single seed."""
    if len(reference) < 2:
        return {"verdict": "reference has 1 seed: no verdict", "test": None}
    if any(math.isnan(v) for v in (*reference, *other)):
        return {"verdict": "no verdict (NaN)", "test": None}
    if len(other) >= 2:
        return {**welch_verdict(reference, other), "test": "welch"}
    mean, std = mean_std(reference)
    n = len(reference)
    half = t_quantile(0.975, n - 1) * std * math.sqrt(1 + 1 / n)
    (value,) = other
    inside = abs(value - mean) <= half
    return {
        "verdict": "within the reference's seed spread" if inside else "differs",
        "test": "prediction interval",
        "interval": [mean - half, mean + half],
    }


def final_metrics_table(arms: list[dict], metrics: tuple[str, ...], judge) -> dict:
    """Per final pretraining metric: each arm's :func:`~pipeline.reports.tables.summary`
    over its seeds, and against the first arm its difference and ``judge``'s verdict."""
    table = {}
    reference = arms[0]["name"]
    for metric in metrics:
        rows = {a["name"]: summary([r["final"][metric] for r in a["seeds"]]) for a in arms}
        for arm in arms[1:]:
            row = rows[arm["name"]]
            if row["n"] and rows[reference]["n"]:
                row["difference"] = row["mean"] - rows[reference]["mean"]
                row.update(judge(rows[reference]["values"], row["values"]))
        table[metric] = rows
    return table


def finetune_summary(arm: dict, task: str, metric: str) -> dict:
    """One arm's score on ``task``: mean ± std over pretraining × fine-tuning seeds, and each
    pretraining seed's mean over its fine-tuning seeds (what the verdicts compare)."""
    values = [finetune_values(r, task, metric) for r in arm["seeds"]]
    flat = [v for vs in values for v in vs]
    mean, std = mean_std(flat)
    return {
        "mean": mean,
        "std": std,
        "n": len(flat),
        "pretrain_seed_means": [sum(vs) / len(vs) for vs in values],
    }
