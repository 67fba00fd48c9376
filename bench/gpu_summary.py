"""The tables and the targets' verdicts of a GPU check, from what it wrote.

``bench/gpu_check.sh`` leaves ``test-gpu.log`` and one ``bench-<name>.json`` per bench.gpu
invocation (the JSON line it printed) in one folder. This reads them and prints Markdown:

- the CUDA tests' last line;
- per configuration (sequence length, eager or compiled), LAMB and 1-bit LAMB with the
  reference and the fused kernels: samples/s, MFU, the optimizer step's GPU time, its
  floor and their ratio, and 1-bit LAMB's samples/s over LAMB's per implementation (the
  ratios come from one invocation: ``comparisons``);
- the optimizer steps timed alone;
- the fused steps' effective bandwidth (the bytes their kernels were counted to move in
  Triton's interpreter over their measured time) and, for 1-bit LAMB, the bandwidth the
  0.95× samples/s target needs (:func:`bandwidth_table`);
- where a profiled step's time went (``profile``: shares of the wall time by category and
  the largest kernels);
- what a profiled step's MFU is made of (:func:`mfu_table`): the matrix products' share of
  the step times the rate they run at, and the milliseconds the rest takes;
- packed against padded rows;
- where one step made the host wait for the GPU (``host_sync_sites``), per configuration;
- the GPU-speed targets, each met, missed, or not measured:
  1-bit LAMB's compression-stage samples/s at least 0.95 × LAMB's (fused kernels; eager
  and compiled, lengths 128 and 512); the compression step's GPU time at most 2 × its
  bytes/bandwidth floor; LAMB compiled at length 128 at 45 % MFU or more.

    python -m bench.gpu_summary runs/gpu_check > summary.md

An invocation without its JSON summary is named in the output; the rows it wrote as each
configuration finished (``bench-<name>.rows.jsonl``) stand in for it, and the rest is
summarised: a check that ran out of time keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAMPLES_RATIO_TARGET = 0.95
FLOOR_RATIO_TARGET = 2.0
MFU_TARGET = 0.45
CATEGORIES = ("gemm", "attention", "communication", "optimizer", "other", "idle")
NAMES = {"lamb": "LAMB", "onebit_lamb": "1-bit LAMB", "adamw": "AdamW"}
STEP_KEYS = ("optimizer_step_ms", "optimizer_floor_ms", "optimizer_vs_floor")
RATIO_KEYS = (
    "onebit_over_lamb_samples_reference",
    "onebit_over_lamb_samples_fused",
    "lamb_fused_over_reference_samples",
    "onebit_lamb_fused_over_reference_samples",
    "onebit_lamb_in_update_over_separate_samples",
)


def _read_json(path: Path):
    try:
        text = path.read_text().strip()
        return json.loads(text) if text else None
    except (OSError, json.JSONDecodeError):
        return None


def _read_rows(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut off by a kill is left out)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def load(folder: Path) -> tuple[list[dict], list[str]]:
    """The bench.gpu summaries in ``folder`` (``bench-<name>.json``, by name), and a note
    for each invocation without one. Where the summary is missing, the rows the invocation
    wrote as it went (``bench-<name>.rows.jsonl``, ``--rows-out``) stand in for it, with
    the ratios of those rows."""
    from bench.yardstick import comparisons

    names = {p.name.removesuffix(".json") for p in folder.glob("bench-*.json")}
    names |= {p.name.removesuffix(".rows.jsonl") for p in folder.glob("bench-*.rows.jsonl")}
    names = {n for n in names if not n.endswith(".rows")}
    summaries, notes = [], []
    for name in sorted(names):
        summary = _read_json(folder / f"{name}.json")
        if isinstance(summary, dict) and "runs" in summary:
            summaries.append(summary)
            continue
        rows = _read_rows(folder / f"{name}.rows.jsonl")
        if not rows:
            why = "the invocation failed, timed out or was skipped"
            notes.append(f"`{name}.json` holds no result ({why})")
            continue
        notes.append(
            f"`{name}.json` holds no result (the invocation failed or timed out); the "
            f"{len(rows)} rows it finished are read from `{name}.rows.jsonl`"
        )
        summaries.append({"runs": rows, "comparisons": comparisons(rows, [])})
    return summaries, notes


def _mode(run: dict) -> str:
    if not run.get("compile"):
        return "eager"
    mode = run.get("compile_mode") or "default"
    return "compiled" if mode == "default" else f"compiled ({mode})"


def _number(value, digits: int = 1, percent: bool = False) -> str:
    if value is None:
        return "–"
    if percent:
        return f"{100 * value:.{digits}f} %"
    return f"{value:,.{digits}f}"


def _line(*cells) -> str:
    """One Markdown table row of ``cells``."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _config(run: dict) -> list[str]:
    """The cells that name a row of our loop: length, mode, optimizer, kernels."""
    name = NAMES.get(run["optimizer"], run["optimizer"])
    return [run["seq_length"], _mode(run), name, run.get("impl", "–")]


def _figures(row: dict, keys: tuple[str, ...], digits: int) -> list[str]:
    return [_number(row.get(key), digits) for key in keys]


def _packing(summary: dict) -> bool:
    """Whether ``summary`` is a packed-against-padded invocation."""
    return any(run.get("packing") for run in summary["runs"])


def _ours(summaries: list[dict]) -> list[dict]:
    """Our loop's rows, but those of packed-against-padded invocations."""
    return [
        run for s in summaries if not _packing(s) for run in s["runs"] if run.get("loop") == "ours"
    ]


def loop_table(summaries: list[dict]) -> list[str]:
    """Our loop's rows: samples/s, MFU and the optimizer step beside its floor."""
    lines = [
        "| length | mode | optimizer | kernels | samples/s | MFU | optimizer step (ms) "
        "| floor (ms) | step / floor |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in _ours(summaries):
        if "error" in run:
            lines.append(_line(*_config(run), f"failed: {run['error'][:80]}", *[""] * 4))
            continue
        rate, mfu = _number(run.get("samples_per_s")), _number(run.get("mfu"), percent=True)
        lines.append(_line(*_config(run), rate, mfu, *_figures(run, STEP_KEYS, 2)))
    return lines


def comparison_table(summaries: list[dict]) -> list[str]:
    """1-bit LAMB over LAMB and fused over reference, per configuration of one invocation."""
    lines = [
        "| length | mode | 1-bit LAMB / LAMB, reference | 1-bit LAMB / LAMB, fused "
        "| LAMB fused / reference | 1-bit LAMB fused / reference "
        "| 1-bit LAMB fused / fused-separate |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for summary in [s for s in summaries if not _packing(s)]:
        for row in summary.get("comparisons", []):
            if "seq_length" not in row:
                continue
            mode = "compiled" if row["compile"] else "eager"
            lines.append(_line(row["seq_length"], mode, *_figures(row, RATIO_KEYS, 3)))
    return lines


def alone_table(summaries: list[dict]) -> list[str]:
    rows = [r for s in summaries for r in s.get("optimizer_steps", [])]
    if not rows:
        return []
    lines = [
        "| optimizer | kernels | step (ms) | floor (ms) | step / floor |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(_line(NAMES.get(r["optimizer"]), r["impl"], *_figures(r, STEP_KEYS, 2)))
    return lines


def _allowance_gbs(summary: dict, run: dict) -> float | None:
    """For 1-bit LAMB's fused row ``run`` of our loop: the bandwidth at which the bytes its
    step was counted to move beyond LAMB's fused step fit in what the 0.95× target allows
    over LAMB's step of the same configuration and invocation (LAMB's step over 0.95, less
    LAMB's step), if both steps' kernels ran at it; None without LAMB's row."""
    lamb = next(
        (
            r
            for r in summary["runs"]
            if r.get("loop") == "ours"
            and r["optimizer"] == "lamb"
            and r.get("impl") == "fused"
            and (r["seq_length"], r.get("compile")) == (run["seq_length"], run.get("compile"))
            and r.get("step_seconds_median")
        ),
        None,
    )
    counted = lamb and lamb.get("optimizer_counted_bytes_per_parameter")
    if not counted or not run.get("optimizer_params"):
        return None
    extra = (run["optimizer_counted_bytes_per_parameter"] - counted) * run["optimizer_params"]
    allowed = lamb["step_seconds_median"] * (1 / SAMPLES_RATIO_TARGET - 1)
    return extra / allowed / 1e9


def bandwidth_table(summaries: list[dict]) -> list[str]:
    """The fused steps' effective bandwidth: the bytes their kernels were counted to move
    (``bench/kernel_bytes.py``) over the optimizer step's measured GPU time, and its share
    of the memory's bandwidth; for 1-bit LAMB in our loop, also the bandwidth its extra
    bytes over LAMB's step need for the 0.95× samples/s target (:func:`_allowance_gbs`)."""
    lines = [
        "| where | optimizer | kernels | step (ms) | counted bytes / parameter "
        "| effective GB/s | share of bandwidth | 0.95× target needs (GB/s) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for summary in summaries:
        rows = [(r, f"{r['seq_length']}, {_mode(r)}") for r in summary["runs"]
                if r.get("loop") == "ours" and not r.get("packing")]  # fmt: skip
        rows += [(r, "alone") for r in summary.get("optimizer_steps", [])]
        for row, where in rows:
            if "optimizer_effective_gbs" not in row:
                continue
            needs = None
            if where != "alone" and row["optimizer"] == "onebit_lamb" and row["impl"] == "fused":
                needs = _allowance_gbs(summary, row)
            lines.append(
                _line(
                    where,
                    NAMES.get(row["optimizer"], row["optimizer"]),
                    row["impl"],
                    _number(row.get("optimizer_step_ms"), 2),
                    _number(row["optimizer_counted_bytes_per_parameter"], 2),
                    _number(row["optimizer_effective_gbs"], 0),
                    _number(row.get("optimizer_bandwidth_share"), 1, percent=True),
                    _number(needs, 0),
                )
            )
    return lines


def profile_table(summaries: list[dict]) -> list[str]:
    """Shares of a profiled step's wall time by category, and its three largest kernels."""
    runs = [r for r in _ours(summaries) if isinstance(r.get("profile"), dict)]
    if not runs:
        return []
    header = " | ".join(CATEGORIES)
    lines = [
        f"| length | mode | optimizer | kernels | wall (ms) | {header} | largest kernels |",
        "|---:|---|---|---|---:|" + "---:|" * len(CATEGORIES) + "---|",
    ]
    for run in runs:
        profile = run["profile"]
        if "error" in profile:
            failed = f"failed: {profile['error'][:80]}"
            lines.append(_line(*_config(run), failed, *[""] * (len(CATEGORIES) + 1)))
            continue
        shares = [_number(profile["shares"][c], 1, percent=True) for c in CATEGORIES]
        top = "; ".join(
            f"{t['name'][:40]} ({t['category']}, {t['ms_per_step']:.2f} ms)"
            for t in profile["top"][:3]
        )
        wall = _number(profile["wall_ms_per_step"], 1)
        lines.append(_line(*_config(run), wall, *shares, top))
    return lines


PRODUCTS = ("gemm", "attention")


def mfu_parts(run: dict) -> dict | None:
    """A profiled row's MFU taken apart, from its profile (None: no profile, or no peak).

    The model's FLOPs (the bench's formula) over the profiled step's wall time and the peak
    give the step's MFU *in the profile* (the profiler lengthens a host-bound step); it is
    the products' share of the wall (gemm and attention kernels) times their rate: the
    FLOPs over the products' own time, as a fraction of the peak. The products' time also
    holds the heads' products, which the formula leaves out, so their rate reads a little
    low. Each other category's milliseconds per step are what a higher MFU would take
    away."""
    profile, peak = run.get("profile"), run.get("peak_tflops")
    flops = run.get("model_flops_per_step")
    if not isinstance(profile, dict) or "error" in profile or not peak or not flops:
        return None
    wall, categories = profile["wall_ms_per_step"], profile["categories"]
    products = sum(categories.get(c, 0.0) for c in PRODUCTS)
    if wall <= 0 or products <= 0:
        return None
    rest = {c: categories.get(c, 0.0) for c in CATEGORIES if c not in PRODUCTS}
    return {
        "wall_ms": wall,
        "products_ms": products,
        "products_share": products / wall,
        "products_rate": flops / (products * 1e-3) / 1e12 / peak,
        "mfu_in_profile": flops / (wall * 1e-3) / 1e12 / peak,
        "rest_ms": rest,
    }


def mfu_table(summaries: list[dict]) -> list[str]:
    """Per profiled row: MFU = the products' share of the step × the rate they run at."""
    rest = [c for c in CATEGORIES if c not in PRODUCTS]
    lines = [
        "| length | mode | optimizer | kernels | MFU in the profile | products' share "
        "| products' rate (of peak) | " + " | ".join(f"{c} (ms)" for c in rest) + " |",
        "|---:|---|---|---|---:|---:|---:|" + "---:|" * len(rest),
    ]
    for run in _ours(summaries):
        parts = mfu_parts(run)
        if parts is None:
            continue
        lines.append(
            _line(
                *_config(run),
                _number(parts["mfu_in_profile"], 1, percent=True),
                _number(parts["products_share"], 1, percent=True),
                _number(parts["products_rate"], 1, percent=True),
                *[_number(parts["rest_ms"][c], 2) for c in rest],
            )
        )
    return lines


def mfu_explanation(summaries: list[dict]) -> str | None:
    """One sentence on what holds LAMB's compiled MFU at length 128 below the target, from
    the profiled row of the best MFU (None: the target is met, or nothing was profiled)."""
    profiled = [
        (r, mfu_parts(r))
        for r in _ours(summaries)
        if r["optimizer"] == "lamb"
        and r.get("compile")
        and r["seq_length"] == 128
        and r.get("mfu") is not None
    ]
    profiled = [(r, parts) for r, parts in profiled if parts is not None]
    if not profiled:
        return None
    run, parts = max(profiled, key=lambda pair: pair[0]["mfu"])
    if run["mfu"] >= MFU_TARGET:
        return None
    rest = sorted(parts["rest_ms"].items(), key=lambda item: -item[1])
    others = ", ".join(f"{name} {ms:.1f} ms" for name, ms in rest if ms > 0)
    return (
        f"LAMB, compiled, length 128 ({run.get('impl')} kernels): {_number(run['mfu'], 1, True)} "
        f"MFU timed, {_number(parts['mfu_in_profile'], 1, True)} in the profile = the "
        f"matrix products' {_number(parts['products_share'], 1, True)} of the "
        f"{parts['wall_ms']:.1f} ms step × their {_number(parts['products_rate'], 1, True)} "
        f"of the peak. The rest of the step: {others}. With the rest free, the products "
        f"alone would give {_number(parts['products_rate'], 1, True)}; at their rate, "
        f"{_number(MFU_TARGET, 0, True)} needs them to fill "
        f"{_number(min(MFU_TARGET / parts['products_rate'], 9.99), 1, True)} of the step."
    )


def syncs_table(summaries: list[dict]) -> list[str]:
    """Per configuration (its implementations share one trainer and one count): the host's
    waits in one step and where they were."""
    lines = [
        "| length | mode | optimizer | waits per step | where (count) |",
        "|---:|---|---|---:|---|",
    ]
    seen = set()
    for run in _ours(summaries):
        key = (run["seq_length"], _mode(run), run["optimizer"])
        if key in seen or "host_sync_sites" not in run:
            continue
        seen.add(key)
        where = "; ".join(f"`{site}` ({n})" for site, n in run["host_sync_sites"].items())
        name = NAMES.get(run["optimizer"], run["optimizer"])
        lines.append(_line(run["seq_length"], _mode(run), name, run["host_syncs_per_step"], where))
    return lines


def packing_table(summaries: list[dict]) -> list[str]:
    runs = [r for s in summaries if _packing(s) for r in s["runs"] if r.get("loop") == "ours"]
    if not runs:
        return []
    lines = ["| length | optimizer | rows | samples/s |", "|---:|---|---|---:|"]
    for r in runs:
        rows = "packed" if r["packing"] else "padded"
        rate = _number(r.get("samples_per_s")) if "error" not in r else "failed"
        lines.append(_line(r["seq_length"], NAMES.get(r["optimizer"]), rows, rate))
    return lines


def targets(summaries: list[dict]) -> list[dict]:
    """Each target's figures and verdict: ``met``, ``missed`` or ``not measured``."""
    out = []
    comparisons = {
        (row["seq_length"], bool(row["compile"])): row
        for s in summaries
        if not _packing(s)
        for row in s.get("comparisons", [])
        if "seq_length" in row
    }
    for seq_length in (128, 512):
        for compiled in (False, True):
            row = comparisons.get((seq_length, compiled), {})
            value = row.get("onebit_over_lamb_samples_fused")
            mode = "compiled" if compiled else "eager"
            out.append(
                _verdict(
                    f"1-bit LAMB / LAMB samples/s, fused, {mode}, length {seq_length}",
                    value,
                    value is not None and value >= SAMPLES_RATIO_TARGET,
                    f">= {SAMPLES_RATIO_TARGET}",
                )
            )
    runs = _ours(summaries)
    floors = [
        r["optimizer_vs_floor"]
        for r in runs
        if r["optimizer"] == "onebit_lamb"
        and r.get("impl") == "fused"
        and "optimizer_vs_floor" in r
    ]
    floors += [
        r["optimizer_vs_floor"]
        for s in summaries
        for r in s.get("optimizer_steps", [])
        if r["optimizer"] == "onebit_lamb" and r["impl"] == "fused" and "optimizer_vs_floor" in r
    ]
    worst = max(floors) if floors else None
    out.append(
        _verdict(
            "1-bit LAMB's compression step / its floor, fused (the worst row)",
            worst,
            worst is not None and worst <= FLOOR_RATIO_TARGET,
            f"<= {FLOOR_RATIO_TARGET}",
        )
    )
    mfus = [
        r["mfu"]
        for r in runs
        if r["optimizer"] == "lamb"
        and r.get("compile")
        and r["seq_length"] == 128
        and r.get("mfu") is not None
    ]
    best = max(mfus) if mfus else None
    out.append(
        _verdict(
            "LAMB's MFU, compiled, length 128 (the better implementation)",
            best,
            best is not None and best >= MFU_TARGET,
            f">= {MFU_TARGET:.0%}",
        )
    )
    return out


def _verdict(name: str, value, met: bool, target: str) -> dict:
    verdict = "not measured" if value is None else ("met" if met else "missed")
    return {"target": name, "wanted": target, "value": value, "verdict": verdict}


def test_line(folder: Path) -> str:
    log = folder / "test-gpu.log"
    if not log.is_file():
        return "no `test-gpu.log`"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip("= ") if lines else "`test-gpu.log` is empty"


def render(folder: Path) -> str:
    summaries, notes = load(folder)
    out = [f"# GPU check: {folder}", ""]
    # the set-up from a whole summary (rows an invocation left without one carry none)
    first = next((s for s in summaries if "torch" in s), {})
    if first:
        out.append(
            f"GPU {first.get('gpu')}, torch {first.get('torch')}, CUDA {first.get('cuda')}, "
            f"model {first.get('model')}, bandwidth {first.get('bandwidth_gbs')} GB/s "
            f"({first.get('bandwidth_source')}); MFU: `{first.get('flop_formula')}`."
        )
        out.append("")
    out += [f"CUDA tests: {test_line(folder)}", ""]
    out += [f"- {note}" for note in notes] + ([""] if notes else [])
    sections = [
        ("Our loop", loop_table(summaries)),
        ("Ratios within one invocation", comparison_table(summaries)),
        ("Optimizer steps alone", alone_table(summaries)),
        ("The fused steps' bandwidth (counted bytes over GPU time)", bandwidth_table(summaries)),
        ("Where a step's time goes (shares of the wall time)", profile_table(summaries)),
        ("What the MFU is made of (profiled steps)", mfu_table(summaries)),
        ("Packed against padded rows (LAMB, eager)", packing_table(summaries)),
        ("Where one step makes the host wait", syncs_table(summaries)),
    ]
    for title, table in sections:
        if len(table) > 2:
            out += [f"## {title}", "", *table, ""]
    out += ["## Targets", "", "| target | wanted | measured | verdict |", "|---|---|---:|---|"]
    for t in targets(summaries):
        value = "–" if t["value"] is None else f"{t['value']:.3g}"
        out.append(f"| {t['target']} | {t['wanted']} | {value} | {t['verdict']} |")
    explanation = mfu_explanation(summaries)
    if explanation:
        out += ["", f"What holds the MFU back: {explanation}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_summary", description=__doc__)
    parser.add_argument("folder", type=Path, help="what bench/gpu_check.sh wrote ($OUT)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder: give the one bench/gpu_check.sh wrote")
    sys.stdout.write(render(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
