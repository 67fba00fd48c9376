"""Each strategy against the reference pretrained on the same data.

A comparison's reference (LAMB) may have been run on other data than some of the
strategies it is compared with: a data stage made again with another vocabulary gives
another token stream, and the losses move with it. ``--data-reference NAME=PRETRAIN``
gives runs of the reference's recipe on other data; each run's data is its
:func:`pipeline.tuning.data_identity` (the tokenizer's sha256 and one over the training
shards'), read from the data folder its config names, or, for a carried run, from the
tuning record whose evaluation produced it. For every data group of those runs the report
sets each strategy whose seeds all ran on that data against them: the same verdicts as
the main table (Welch's test on final validation MLM loss), plus the reference's own
shift between the data groups. Strategies whose data is not recorded stay against the
main reference only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from onebit_bert.shards import ShardFormatError
from pipeline.reports.stats import mean_std
from pipeline.tuning import data_identity, data_label

Verdict = Callable[[list[float], list[float]], dict]


def data_of_dir(path: str | Path | None) -> dict | None:
    """The data identity of a prepared corpus folder; None when it is gone or not one."""
    if not path or not Path(path).is_dir():
        return None
    try:
        return data_identity(Path(path))
    except (ShardFormatError, OSError, KeyError):
        return None


def assign_data(runs: list[dict], tuning: Mapping[str, dict]) -> None:
    """Give each run without a recorded ``data`` the identity of the tuning record whose
    evaluation produced it (same run directory), in place; None when no record says."""
    by_dir = {
        str(run["run_dir"]): record.get("data")
        for record in tuning.values()
        for run in record.get("evaluation") or []
    }
    for run in runs:
        if not run.get("data"):
            run["data"] = by_dir.get(str(run["pretrain_dir"]))


def _key(data: dict | None) -> tuple[str, str] | None:
    return None if not data else (data["tokenizer_sha256"], data["shards_sha256"])


def _finals(runs: list[dict]) -> list[float]:
    return [r["final"]["val_mlm_loss"] for r in runs]


def _reached(runs: list[dict]) -> dict:
    samples = [
        r["time_to_target"]["samples"]
        for r in runs
        if (r.get("time_to_target") or {}).get("reached")
    ]
    return {
        "reached": len(samples),
        "n": len(runs),
        "mean_samples": sum(samples) / len(samples) if samples else None,
    }


def same_data_groups(arms: list[dict], references: list[dict], verdict: Verdict) -> list[dict]:
    """Per data group of ``references``: the reference runs' summary, the main reference's
    (``arms[0]``) shift to them, and each other arm whose seeds all ran on that data
    against them."""
    if not references:
        return []
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in references:
        key = _key(run.get("data"))
        if key is None:
            raise ValueError(
                f"--data-reference {run['pretrain_dir']}: its data folder "
                f"({run.get('data_path') or 'not named'}) is not readable, so the data it ran "
                "on is unknown; give runs whose data folder is still there"
            )
        groups.setdefault(key, []).append(run)
    main = arms[0]
    out = []
    for refs in groups.values():
        finals = _finals(refs)
        mean, std = mean_std(finals)
        main_finals = _finals(main["seeds"])
        group = {
            "data": refs[0]["data"],
            "reference": refs[0]["name"],
            "seeds": sorted(r["seed"] for r in refs),
            "final_val_mlm_loss": {"mean": mean, "std": std, "values": finals},
            **_reached(refs),
            "main_reference_shift": {
                "difference": mean - mean_std(main_finals)[0],
                **verdict(main_finals, finals),
            },
            "arms": [],
        }
        for arm in arms[1:]:
            keys = {_key(r.get("data")) for r in arm["seeds"]}
            if keys != {_key(refs[0]["data"])}:
                continue
            values = _finals(arm["seeds"])
            arm_mean = mean_std(values)[0]
            group["arms"].append({
                "name": arm["name"],
                "final_val_mlm_loss": {"mean": arm_mean, "values": values},
                "difference": arm_mean - mean,
                **_reached(arm["seeds"]),
                **verdict(finals, values),
            })  # fmt: skip
        out.append(group)
    return out


def _p(row: dict) -> str:
    return f"{row['p']:.2g}" if row.get("p") is not None else "–"


def _samples(row: dict) -> str:
    if row["mean_samples"] is None:
        return f"0/{row['n']}"
    return f"{row['reached']}/{row['n']}, {row['mean_samples']:,.0f}"


def _reached_text(row: dict) -> str:
    text = f"{row['reached']} of {row['n']} seeds reached the target"
    if row["mean_samples"] is not None:
        text += f", after {row['mean_samples']:,.0f} samples on average"
    return text


def same_data_lines(groups: list[dict], main_name: str) -> list[str]:
    """The report's section for :func:`same_data_groups`."""
    if not groups:
        return []
    lines = ["## Against the reference on the same data", ""]
    for group in groups:
        final = group["final_val_mlm_loss"]
        shift = group["main_reference_shift"]
        lines += [
            f"**{group['reference']} on {data_label(group['data'])}** (seeds "
            f"{', '.join(map(str, group['seeds']))}): final validation MLM loss "
            f"{final['mean']:.4f} ± {final['std']:.4f}; {_reached_text(group)}. Against the "
            "main reference "
            f"({main_name}'s seeds in the table above): {shift['difference']:+.4f}, "
            f"{shift['verdict']} ({shift.get('test') or 'no test'}, p = {_p(shift)}). Below: "
            "the strategies whose seeds all ran on this data, against these runs; strategies "
            "whose data is not recorded stand against the main reference only.",
            "",
        ]
        if not group["arms"]:
            lines += ["No strategy in this report records this data for all its seeds.", ""]
            continue
        lines += [
            f"| strategy | final validation MLM loss | vs {group['reference']} on this data "
            "| test | p | verdict | reached the target (seeds, mean samples) |",
            "|---|---:|---:|---|---:|---|---|",
        ]
        for arm in group["arms"]:
            lines.append(
                f"| {arm['name']} | {arm['final_val_mlm_loss']['mean']:.4f} | "
                f"{arm['difference']:+.4f} | {arm.get('test') or '–'} | {_p(arm)} | "
                f"{arm['verdict']} | {_samples(arm)} |"
            )
        lines.append("")
    return lines


def data_identities(runs: list[dict], mixed_allowed: bool) -> dict:
    """The data identities of the ranked records: ``identities`` (each with its names;
    ``data`` None where no record says) and ``mixed``. Records of more than one identity
    (an unknown one counts as its own) are refused unless ``mixed_allowed``: their losses
    and samples to the target come from different token streams, and one ranking of them
    would set those against each other."""
    groups: dict[tuple[str, str] | None, dict] = {}
    for run in runs:
        key = _key(run.get("data"))
        group = groups.setdefault(key, {"data": run.get("data") or None, "names": []})
        if run["name"] not in group["names"]:
            group["names"].append(run["name"])
    identities = list(groups.values())
    if len(identities) > 1 and not mixed_allowed:
        listed = "; ".join(
            f"{data_label(g['data']) if g['data'] else 'not recorded'}: {', '.join(g['names'])}"
            for g in identities
        )
        raise ValueError(
            f"the runs were pretrained on {len(identities)} different data identities "
            f"({listed}); rank runs of one data stage together (rerun the others on it), or "
            "pass --mixed-data to rank them anyway (the report then says so)"
        )
    return {"identities": identities, "mixed": len(identities) > 1}


def mixed_data_lines(summary: dict) -> list[str]:
    """The report's warning when :func:`data_identities` ranked mixed data (``--mixed-data``)."""
    if not summary["mixed"]:
        return []
    listed = "; ".join(
        f"{data_label(g['data']) if g['data'] else 'not recorded'}: {', '.join(g['names'])}"
        for g in summary["identities"]
    )
    return [
        f"**Mixed data: these records were pretrained on {len(summary['identities'])} data "
        f"identities, ranked together as asked (--mixed-data)** ({listed}). Their losses and "
        "samples to the target come from different token streams; read the rankings below "
        "as provisional until every recipe runs on one data stage.",
        "",
    ]
