"""The comparison's ``report.md``: the strategies table, the groups per bandwidth, the
carried runs, fine-tuning and the figures' captions, rendered from what
:mod:`pipeline.reports.compare` computed."""

from __future__ import annotations

from pipeline.reports import ranking
from pipeline.reports.runs import VERDICT_TEST
from pipeline.reports.tables import mean_std_cell as _mean_std

NO_RECIPE = "no registered recipe"
"""How tables name the recipe of a run whose settings no registered recipe describes."""
PLOT_BANDWIDTHS = (25.0, 10_000.0)
"""Mbit/s of the modelled-time plots (when the netem JSON measured them)."""


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _human_seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 3600:
        return f"{value / 3600:.2f} h"
    if value >= 60:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


def _mean_of(runs: list[dict], get) -> float | None:
    values = [get(r) for r in runs]
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def _with_censored(seeds: list[dict], get) -> tuple[float | None, bool]:
    """Mean over every seed of a to-target figure (``get(block)``), a seed that missed the
    target counting with its run's end (``run_end``); and whether that makes the mean a
    lower bound. None when a seed has no value."""
    values, censored = [], False
    for run in seeds:
        block = run["time_to_target"]
        if not block.get("reached"):
            censored = True
            block = block.get("run_end") or {}
        value = get(block)
        if value is None:
            return None, censored
        values.append(value)
    return (sum(values) / len(values) if values else None), censored


def strategy_rows(data: dict, bandwidths: list[float]) -> list[dict]:
    """One row per strategy for the markdown table: means over its seeds. Samples and
    times to the target are means over every seed, one that missed the target counting
    with its run's end (a lower bound: ``censored``); bytes to the target over the seeds
    that reached it (``reached`` says how many)."""
    rows = []
    for arm in data["arms"]:
        seeds = arm["seeds"]
        hit = [r for r in seeds if r["time_to_target"]["reached"]]
        kinds = sorted({k for r in seeds for k in r["comm_bytes_by_kind"]})
        rows.append(
            {
                "name": arm["name"],
                "strategy": seeds[0]["strategy"],
                "seeds": [r["seed"] for r in seeds],
                "loss": data["pretraining"]["val_mlm_loss"][arm["name"]],
                "accuracy": data["pretraining"]["val_mlm_accuracy"][arm["name"]],
                "bytes": _mean_of(seeds, lambda r: r["comm_bytes_total"]),
                "bytes_by_kind": {
                    k: _mean_of(seeds, lambda r, k=k: r["comm_bytes_by_kind"].get(k, 0))
                    for k in kinds
                },
                "reached": f"{len(hit)}/{len(seeds)}",
                "samples": _with_censored(seeds, lambda b: b.get("samples")),
                "bytes_to_target": _mean_of(hit, lambda r: r["time_to_target"]["bytes"]),
                "seconds": {
                    bw: _with_censored(
                        seeds, lambda b, bw=bw: (b.get("seconds") or {}).get(f"{bw:g}")
                    )
                    for bw in bandwidths
                },
            }
        )
    return rows


def _bounded(value: tuple[float | None, bool], text) -> str:
    mean, censored = value
    if mean is None:
        return "–"
    return ("≥ " if censored else "") + text(mean)


def winners(data: dict) -> list[dict]:
    """Per measured bandwidth, the recipes that reach the target first, as groups
    (:func:`pipeline.reports.ranking.groups`: the leaders the seeds cannot tell apart, the recipes
    clearly behind, seeds that missed the target counted with a lower bound)."""
    bandwidths = sorted(
        {bw for r in data["runs"] for bw in r["time_to_target"]["measured_bandwidths"]}
    )
    return ranking.groups(data["arms"], bandwidths)


def _bandwidth_label(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def strategy_table_lines(rows: list[dict], bandwidths: list[float]) -> list[str]:
    """The strategies table of ``report.md`` (:func:`strategy_rows`)."""
    head = ["strategy", "seeds", "val MLM loss", "val MLM accuracy", "bytes/rank",
            "seeds at target", "samples to target", "bytes to target"]  # fmt: skip
    head += [f"time to target @ {_bandwidth_label(bw)}" for bw in bandwidths]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in rows:
        loss, acc = row["loss"], row["accuracy"]
        loss_cell = _mean_std(loss["mean"], loss["std"], len(row["seeds"]))
        if "verdict" in loss:
            loss_cell += f" ({loss['verdict']})"
        cells = [
            f"{row['name']} (`{row['strategy'] or NO_RECIPE}`)",
            ", ".join(map(str, row["seeds"])),
            loss_cell,
            _mean_std(acc["mean"], acc["std"], len(row["seeds"])),
            _human_bytes(row["bytes"]),
            row["reached"],
            _bounded(row["samples"], lambda v: f"{v:,.0f}"),
            _human_bytes(row["bytes_to_target"]),
            *(_bounded(row["seconds"][bw], _human_seconds) for bw in bandwidths),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(data: dict, netem_paths: list[str], netem: dict | None) -> str:
    """``report.md``: the target, the strategy table, the plots, the fine-tuning table."""
    bandwidths = sorted(
        {bw for r in data["runs"] for bw in r["time_to_target"]["measured_bandwidths"]}
    )
    rows = strategy_rows(data, bandwidths)
    ref = data["arms"][0]["name"]
    target = data["target"]
    lines = [
        "# Comparison report",
        "",
        f"Reference: **{ref}**. Target validation MLM loss **{target['val_mlm_loss']:.4f}** "
        f"({target['from']}). Verdicts: {VERDICT_TEST}",
        "",
        "## Strategies",
        "",
    ]
    lines += strategy_table_lines(rows, bandwidths)
    kinds = sorted({k for row in rows for k in row["bytes_by_kind"]})
    lines += [
        "",
        "Samples and times to the target are means over every seed: a seed that never "
        "reached the target counts with its run's end, a lower bound, and the mean is then "
        "one too (≥). Bytes to the target are means over the seeds that reached it. Bytes "
        "are what rank 0's communicator counted.",
        "",
        *_prior_lines(data, netem),
        "Bytes sent per rank over the whole run, by kind of traffic:",
        "",
    ]
    lines += ["| strategy | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for row in rows:
        cells = [_human_bytes(row["bytes_by_kind"].get(k)) for k in kinds]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    lines += ["", "### How the time is modelled", ""]
    if netem is None:
        lines.append(
            "No netem benchmark JSON was given (`--netem`): no modelled times. Run "
            '`make bench-netem ARGS="--strategies ..."` and pass its netem.json.'
        )
    else:
        lines.append(
            f"Speeds: {' + '.join(f'`{p}`' for p in netem_paths)} ({netem.get('model')}, "
            f"sequence length "
            f"{netem.get('seq_length')}, {netem.get('batch_per_rank')} sequences per rank per "
            "step, measured on emulated links). Samples and stages: this report's runs. "
            "Time to target = sum over the steps up to the crossing of global batch / the "
            "strategy's measured samples/s in that step's stage at that bandwidth on the same "
            "number of ranks. A strategy the benchmark did not measure has no time."
        )
        named = [s for s in netem.get("sweeps") or [] if s.get("sweep_id")]
        if named:
            lines += ["", "Sweeps: " + "; ".join(
                f"`{s['sweep_id']}` ({s['repeats']} repeat{'s' if s['repeats'] > 1 else ''} of "
                "every point, interleaved)" for s in named) + ". A point measured more than "
                "once is timed at its mean step time; the intervals of the groups below span "
                "every repeat's speeds."]  # fmt: skip
        by_file: dict[str, list[str]] = {}
        for recipe, files in (netem.get("runs_from") or {}).items():
            for path in files:
                by_file.setdefault(path, []).append(recipe)
        if len(by_file) > 1:
            lines += [
                "",
                "The speeds come from separate runs of the benchmark ("
                + "; ".join(f"`{p}`: {', '.join(rs)}" for p, rs in by_file.items())
                + "), so ratios between them also carry the machine's run-to-run variation.",
            ]
        missing = sorted(
            {
                r["strategy"] or NO_RECIPE
                for r in data["runs"]
                if not r["time_to_target"]["measured_bandwidths"]
            }  # fmt: skip
        )
        if missing:
            lines.append(f"Not in the netem JSON: {', '.join(missing)}.")
    lines += [
        "",
        "![validation loss against samples](val_loss_samples.png)",
        "![validation loss against bytes](val_loss_bytes.png)",
    ]
    for bw in PLOT_BANDWIDTHS:
        if bw in bandwidths:
            lines.append(f"![validation loss against modelled time at {_bandwidth_label(bw)}]"
                         f"(val_loss_time_{bw:g}mbit.png)")  # fmt: skip
    lines += ["", *_finetune_lines(data), ""]
    return "\n".join(lines)


def _prior_lines(data: dict, netem: dict | None) -> list[str]:
    """Which runs come from earlier reports rather than from run directories."""
    if not data["prior"]:
        return []
    carried = "; ".join(f"`{p['path']}`: {', '.join(p['names'])}" for p in data["prior"])
    same = (
        "against the same target, except their modelled times, which are re-timed with this "
        "report's netem files (each record's steps per stage, stored or recovered from the "
        "times it was given by its own netem files, at the new speeds)"
        if data.get("retimed")
        else "against the same target and netem files"
    )
    dropped = [n for p in data["prior"] for n in p.get("dropped", [])]
    promoted = [p["promoted"] for p in data["prior"] if p.get("promoted")]
    left_out = ""
    if dropped:
        names = ", ".join(dropped)
        left_out = f" Left out of them, to be replaced by this report's runs and tuning: {names}."
        measured = [
            f"{', '.join(r)} in `{f}`" for f, r in ((netem or {}).get("ignored") or {}).items()
        ]
        if measured:
            left_out += f" Their netem measurements are left out too: {'; '.join(measured)}."
    if promoted:
        left_out += (
            f" The reference {promoted[0]} is now its carried runs on other data (they were "
            "its data references), with its tuning record."
        )
    lines = [
        f"Carried from earlier reports ({carried}): their figures are as those reports "
        f"measured them, {same}; their run directories were not read, and they carry no "
        f"fine-tuning.{left_out}"
    ]
    lost = sorted({r["name"] for r in data["runs"] if r.get("retimed") is False})
    if lost:
        lines[0] += (
            f" Records whose steps per stage could not be recovered ({', '.join(lost)}) "
            "have no modelled time."
        )
    flat = sorted({r["name"] for r in data["runs"] if "carried_from" in r and not r.get("curve")})
    if flat:
        lines[0] += (
            f" Records without a stored curve ({', '.join(flat)}) appear in the plot against "
            "samples only."
        )
    return [*lines, ""]


def _finetune_lines(data: dict) -> list[str]:
    names = [a["name"] for a in data["arms"]]
    if not data["finetune"]:
        return [
            "## Fine-tuning",
            "",
            "No task was fine-tuned from every run (runs given as NAME=PRETRAIN_DIR, and runs "
            "carried from an earlier report, have no fine-tuning results): no fine-tuning "
            "verdicts.",
        ]
    lines = [
        "## Fine-tuning",
        "",
        "Main metric per task, mean ± std over pretraining × fine-tuning seeds; verdict "
        f"against {names[0]}.",
        "",
        "| task | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for task, info in data["finetune"].items():
        cells = []
        for name in names:
            row = info["strategies"][name]
            cell = _mean_std(row["mean"], row["std"], row["n"])
            if "verdict" in row:
                mark = f"**{row['verdict']}**" if row["verdict"] == "differs" else row["verdict"]
                cell += f" ({mark})"
            cells.append(cell)
        lines.append(f"| {task} | {info['main_metric']} | " + " | ".join(cells) + " |")
    return lines
