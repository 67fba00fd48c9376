"""The parity report's ``report.md``: its tables and verdict lines, rendered from what
:mod:`pipeline.reports.parity` computed."""

from __future__ import annotations

from pipeline.reports import gate as gating
from pipeline.reports.runs import (
    NO_SIGNAL,
    SIGNAL_FACTOR,
    TEST,
)
from pipeline.reports.tables import fmt as _fmt
from pipeline.reports.tables import table_header as _table_header


def _cell(row: dict) -> str:
    if not row.get("n"):
        return "–"
    return f"{_fmt(row['mean'])} ± {_fmt(row['std'])}"


def _verdict_cell(row: dict) -> str:
    if "verdict" not in row:
        return "–"
    if row["p"] is None:
        return row["verdict"]
    mark = f"**{row['verdict']}**" if row["verdict"] == "differs" else row["verdict"]
    return f"{mark} (p = {row['p']:.2f})"


def _arms_table(arms: list[dict]) -> list[str]:
    lines = [
        "| arm | optimizer | pretraining seeds | global batch | steps | bytes sent per rank |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for arm in arms:
        seeds = [r["seed"] for r in arm["seeds"]]
        comm = sum(r["comm_bytes_total"] for r in arm["seeds"]) / len(arm["seeds"])
        first = arm["seeds"][0]
        lines.append(
            f"| {arm['name']} | {arm['optimizer']} | {len(seeds)} ({', '.join(map(str, seeds))}) "
            f"| {first['global_batch_size']} | {first['steps']} | {comm:,.0f} |"
        )
    return lines


def _traffic_table(arms: list[dict]) -> list[str]:
    """Bytes and seconds per rank by kind of traffic (mean over each arm's seeds)."""
    kinds = sorted({k for a in arms for r in a["seeds"] for k in r.get("comm_by_kind", {})})
    if not kinds:
        return []
    lines = [
        "",
        "Traffic per rank over the run by kind (bytes; seconds spent in those collectives):",
        "",
        "| arm | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for arm in arms:
        cells = []
        for kind in kinds:
            entries = [r.get("comm_by_kind", {}).get(kind) for r in arm["seeds"]]
            if all(e is None for e in entries):
                cells.append("–")
                continue
            entries = [e or {"bytes": 0, "seconds": 0.0} for e in entries]
            nbytes = sum(e["bytes"] for e in entries) / len(entries)
            seconds = sum(e["seconds"] for e in entries) / len(entries)
            cells.append(f"{nbytes:,.0f} B; {seconds:.1f} s")
        lines.append(f"| {arm['name']} | " + " | ".join(cells) + " |")
    return lines


def _pretraining_section(arms: list[dict], pretraining: dict, has_switch: bool) -> list[str]:
    names = [a["name"] for a in arms]
    others = names[1:]
    lines = ["## Pretraining", "", *_arms_table(arms), *_traffic_table(arms)]
    lines += ["", "Final values, mean ± std over pretraining seeds:", ""]
    lines += _table_header(
        ["metric", *names, *(f"{n} vs {names[0]}" for n in others)], len(names), len(others)
    )
    for metric, rows in pretraining.items():
        cells = " | ".join(_cell(rows[n]) for n in names)
        verdicts = " | ".join(_verdict_cell(rows[n]) for n in others)
        lines.append(f"| {metric} | {cells} | {verdicts} |")
    lines += [
        "",
        "![pretraining loss](pretrain_loss.png)",
        "![validation MLM accuracy](val_mlm_accuracy.png)",
    ]
    if has_switch:
        lines += ["![1-bit switch: c·f, f, compression error](onebit_switch.png)"]
    return lines


def _finetuning_section(arms: list[dict], finetuning: dict, baseline: str | None) -> list[str]:
    tuned = [a for a in arms if any(r["finetune"] for r in a["seeds"])]
    untuned = [a["name"] for a in arms if a not in tuned]
    names = [a["name"] for a in tuned] + ([baseline] if baseline else [])
    others = [a["name"] for a in tuned[1:]]
    ref = tuned[0]["name"]
    lines = [
        "## Fine-tuning",
        "",
        "Mean ± std over pretraining × fine-tuning seeds. A difference's brackets hold its "
        "95 % Welch interval over the pretraining seeds' means (two or more on each side).",
        "",
    ]
    if untuned:
        lines += [f"Not fine-tuned, so not in this table: {', '.join(untuned)}.", ""]
    missing = [
        f"{a['name']} {sum(1 for r in a['seeds'] if r['finetune'])} of {len(a['seeds'])}"
        for a in tuned
        if not all(r["finetune"] for r in a["seeds"])
    ]
    if missing:
        lines += [
            "Not every pretraining seed is fine-tuned yet; the table rests on the fine-tuned "
            f"ones ({', '.join(missing)}).",
            "",
        ]
    columns = [
        "task",
        "metric",
        *names,
        *(f"{n} − {ref}" for n in others),
        *(f"{n} vs {ref}" for n in others),
    ]
    lines += _table_header(columns, len(names) + len(others), len(others))
    for task, info in finetuning.items():
        for metric, rows in info["metrics"].items():
            cells = " | ".join(_cell(rows.get(n, {})) for n in names)
            diffs = " | ".join(_difference_cell(rows[n]) for n in others)
            verdicts = " | ".join(_verdict_cell(rows[n]) for n in others)
            main = " (main)" if metric == info["main_metric"] else ""
            lines.append(f"| {task} | {metric}{main} | {cells} | {diffs} | {verdicts} |")
    lines += ["", "![fine-tuning scores](finetune_scores.png)", ""]
    return lines


def _difference_cell(row: dict) -> str:
    """The difference of the means, with its 95 % Welch interval over pretraining seeds."""
    text = f"{row['difference']:+.4f}"
    if row.get("interval"):
        low, high = row["interval"]
        text += f" [{low:+.4f}, {high:+.4f}]"
    return text


def _samples(value: float | None) -> str:
    return "not reached" if value is None else f"{value:,.0f}"


def _gate_section(gate: dict) -> list[str]:
    target, spread = gate["target"], gate["reference_spread"]
    ref = spread["arm"]
    lines = [
        "## Gate",
        "",
        f"Target: validation MLM loss **{target['value']:.4f}**, fixed "
        f"{target.get('fixed_at', '(time not recorded)')} ({gate['fixed_before']}), from "
        f"{target.get('source', 'rule')}: {target.get('rule', '')} (at "
        f"{target.get('at_samples', 0):,.0f} samples; worst: {target.get('worst', '?')}).",
        "",
        *_test_lines(gate),
        "",
        f"Reference spread: {ref}'s final validation MLM loss {spread['mean']:.4f} ± "
        f"{spread['std']:.4f} over {spread['seeds']} seeds = {spread['relative']:.2%} of its "
        f"mean ({'within' if spread['within_limit'] else '**above**'} the "
        f"{spread['limit']:.0%} the regime asks for).",
        "",
        "| arm | seed | samples to target | final val MLM loss |",
        "|---|---:|---:|---:|",
    ]
    for name, rows in gate["per_seed"].items():
        for row in rows:
            lines.append(
                f"| {name} | {row['seed']} | {_samples(row['samples_to_target'])} | "
                f"{_fmt(row['final_val_mlm_loss'])} |"
            )
    lines += _verdict_lines(gate, ref)
    lines += [
        "",
        "![validation loss and the target](val_loss_target.png)",
        "![samples to target per seed](samples_to_target.png)",
        "",
    ]
    return lines


def _test_lines(gate: dict) -> list[str]:
    """The primary test as fixed: its text, margin, alpha, seeds and when it was fixed."""
    if gate.get("test") != "paired":
        return [
            f"Test: {gating.TEST}; margin {gate['margin']:.0%}, alpha {gate['alpha']}, at "
            f"least {gate['min_seeds']} seeds per arm.",
        ]
    when = gate.get("preregistered")
    fixed = (
        f"pre-registered {when} ({gate['preregistered_before']})"
        if when
        else "**not pre-registered**"
    )
    lines = [
        f"Test: {gate.get('test_text', gating.PAIRED_TEST)}; margin {gate['margin']:.0%}, "
        f"alpha {gate['alpha']}, {gate['min_seeds']} seed pairs; {fixed}.",
    ]
    for name, added in (gate.get("arms_fixed") or {}).items():
        lines += ["", f"Arm {name} added under this test at {added['at']} ({added['before']})."]
    return lines


def _verdict_lines(gate: dict, ref: str) -> list[str]:
    """The verdict table: the primary test per arm, and for the paired test Welch's verdict
    and the olympic means as secondary lines."""
    paired = gate.get("test") == "paired"
    lines = [
        "",
        "| arm | verdict | samples to target vs " + ref + " | power | why | "
        "final loss − " + ref + " (95 % CI) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for name, result in gate["gates"].items():
        diff = gate["final_loss_difference"][name]
        interval = (
            f"{diff['difference']:+.4f} [{diff['low']:+.4f}, {diff['high']:+.4f}]"
            if diff["low"] is not None
            else f"{diff['difference']:+.4f}"
        )
        ratio, power = result.get("ratio"), result.get("power")
        if ratio is None:
            shown = "–"
        elif paired and result.get("ratio_low") is not None:
            level = 1 - 2 * gate["alpha"]
            shown = (
                f"×{ratio:.3f} [{result['ratio_low']:.3f}, {result['ratio_high']:.3f}] "
                f"({level:.0%}, paired)"
            )
        else:
            shown = f"{ratio - 1:+.2%}"
        lines.append(
            f"| {name} | **{result['verdict']}** | {shown} | "
            f"{'–' if power is None else f'{power:.0%}'} | {result['reason']} | {interval} |"
        )
    if paired:
        lines += [
            "",
            "Secondary lines (not the verdict): Welch's test on the arms' means, and the "
            "ratio of olympic means (each arm without its fastest and slowest seed), "
            "descriptive.",
            "",
            "| arm | Welch | mean ratio | olympic mean ratio | why (Welch) |",
            "|---|---|---:|---:|---|",
        ]
        for name, result in (gate.get("welch") or {}).items():
            olympic = gate.get("olympic_ratio", {}).get(name)
            ratio = result.get("ratio")
            lines.append(
                f"| {name} | {result['verdict']} | "
                f"{'–' if ratio is None else f'{ratio:.3f}'} | "
                f"{'–' if olympic is None else f'{olympic:.3f}'} | {result['reason']} |"
            )
        lines += [
            "",
            "Power: the chance to pass with these pairs if the arm truly needed the "
            "reference's samples (ratio 1.00) at the observed spread of the log ratios "
            "(noncentral t).",
        ]
    else:
        lines += [
            "",
            "Power: the chance to pass with these seeds if the arm truly needed the "
            "reference's samples, at the observed spreads (normal approximation).",
        ]
    return lines


def _sensitivity_section(rows: list[dict], reference_mean: float | None) -> list[str]:
    lines = [
        "## Sensitivity (not gated)",
        "",
        "One seed per setting; not used to choose the headline setting.",
        "",
        "| run | seed | freeze step | share of the run | final val MLM loss | samples to target |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        share = row["freeze_fraction"]
        freeze = "–" if row["freeze_step"] is None else str(row["freeze_step"])
        if row.get("freeze_rule") == "auto":
            freeze = f"auto: {freeze}"
        lines.append(
            f"| {row['name']} | {row['seed']} | {freeze} | "
            f"{'–' if share is None else f'{share:.0%}'} | {_fmt(row['final_val_mlm_loss'])} | "
            f"{_samples(row['samples_to_target'])} |"
        )
    if reference_mean is not None:
        lines += ["", f"Reference mean final val MLM loss: {reference_mean:.4f}."]
    lines += ["", "![sensitivity runs](sensitivity.png)", ""]
    return lines


def _signal_lines(finetuning: dict, baseline: str) -> list[str]:
    rows = [(t, i["signal"]) for t, i in finetuning.items() if "signal" in i]
    if not rows:
        return []
    lines = [
        "",
        f"Signal: the reference's pretrained score against a randomly initialised model "
        f"({baseline}) on the main metric; a task carries signal when the gap is at least "
        f"{SIGNAL_FACTOR:g} fine-tuning seed spreads. Tasks without it get no verdict.",
        "",
        "| task | metric | gap | spread | signal |",
        "|---|---|---:|---:|---|",
    ]
    for task, sig in rows:
        spread = "–" if sig["spread"] is None else f"{sig['spread']:.4f}"
        word = "yes" if sig["signal"] else f"**{NO_SIGNAL}**"
        lines.append(f"| {task} | {sig['metric']} | {sig['gap']:+.4f} | {spread} | {word} |")
    return lines


def render_markdown(
    arms: list[dict],
    pretraining: dict,
    finetuning: dict,
    has_switch: bool,
    gate: dict | None = None,
    sensitivity: list[dict] | None = None,
    baseline: str | None = None,
) -> str:
    """``report.md``: the gate (when a target is given), the arms, the pretraining and
    fine-tuning tables, the sensitivity runs and the figures."""
    head = ["# Parity report", "", f"Reference arm: **{arms[0]['name']}**. Verdicts: {TEST}", ""]
    lines = [*head, *(_gate_section(gate) if gate else [])]
    lines += [*_pretraining_section(arms, pretraining, has_switch), ""]
    if finetuning:
        lines += _finetuning_section(arms, finetuning, baseline)
        lines += _signal_lines(finetuning, baseline) if baseline else []
        lines.append("")
    if sensitivity:
        ref_mean = gate["reference_spread"]["mean"] if gate else None
        lines += _sensitivity_section(sensitivity, ref_mean)
    return "\n".join(lines)
