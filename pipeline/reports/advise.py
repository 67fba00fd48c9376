"""Which recipes reach the target first on your cluster: the comparison's evidence, modelled
for your link and your number of nodes.

``python -m pipeline.reports.advise --nodes 16 --gpus-per-node 8 --link-gbps 10`` models every
recipe of the equal-budget comparison (``docs/results/compare/tuned/report.json``) on that cluster
with :mod:`pipeline.reports.linkmodel`'s step model: each recipe's compute per step, its bytes per
step through each node's link for that many ranks, and its overlap. It answers with the
groups of :mod:`pipeline.reports.ranking` (the leaders the seeds cannot tell apart, the recipes
clearly behind), each recipe's modelled time and the evidence behind it.

``--measure`` instead times a short all-reduce probe on the job's ranks (run it with
torchrun or srun inside the allocation, one process per GPU): each node's link bandwidth
and the per-message latency come from a fit of the probe's times, the nodes and GPUs per
node from the launcher, and rank 0 prints the advice.

``--compute-s-per-step`` (your step's compute without communication) and ``--params`` (your
model's parameters) rescale the benchmark's compute and bytes to your run. The samples to
the target stay the comparison's: the evidence comes from a small regime, and the answer
says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pipeline.reports import crossover, linkmodel, ranking

REPORT = "docs/results/compare/tuned/report.json"
PRESETS = {
    "benchmark": (None, None),
    "bert-large-h200": (0.0984, 335_000_000),
}
"""Compute seconds per step and parameters a run is rescaled to: ``benchmark`` keeps the
netem sweeps' own (bert-mini, about 8 s of CPU compute per step); ``bert-large-h200`` is
LAMB's BERT-Large step at sequence length 128, 64 sequences per GPU, bf16, on an H200
(98.4 ms, docs/results/2026-11-27-bench-gpu-h200.md) and BERT-Large's ~335 M parameters."""
PROBE_BYTES = (1 << 16, 1 << 20, 1 << 22, 1 << 24)
CAVEAT = (
    "The evidence comes from a small regime: bert-tiny pretrained on 4 gloo workers (CPU), "
    "{steps:,} steps of {batch} sequences, {seeds} fresh seeds per recipe; speeds "
    "of bert-mini measured on emulated links of 25 Mbit/s and 10 Gbit/s (2 hosts × 2 ranks). "
    "The model moves the link, the cluster size, the compute and the bytes; each recipe's "
    "compute relative to LAMB's stays the benchmark's (on an H200, 1-bit LAMB's compression "
    "step cost 1.54x LAMB's), and the samples to the target, with any large-batch penalty a "
    "bigger cluster brings, are not measured at your scale."
)


def advise(report: dict, profiles: dict, nodes: int, gpus_per_node: int, link_gbps: float,
           latency_us: float = 0.0, compute_s_per_step: float | None = None,
           params: int | None = None, netem_params: int | None = None) -> dict:  # fmt: skip
    """The advice as data: the cluster, the scales, per recipe its modelled time and
    evidence, the groups and the caveat."""
    if nodes < 1 or gpus_per_node < 1 or link_gbps <= 0 or latency_us < 0:
        raise ValueError(
            f"a cluster needs nodes >= 1, gpus per node >= 1, a link > 0 Gbit/s and a "
            f"latency >= 0 (got {nodes}, {gpus_per_node}, {link_gbps}, {latency_us})"
        )
    p, g = nodes * gpus_per_node, gpus_per_node
    scales = {"latency_s": latency_us * 1e-6}
    reference = (profiles.get("lamb") or {}).get("default")
    if compute_s_per_step is not None:
        if reference is None:
            raise ValueError("--compute-s-per-step needs LAMB's measured step to scale from")
        scales["compute_scale"] = compute_s_per_step / reference.compute_s
    if params is not None:
        if not netem_params:
            raise ValueError("--params needs the benchmark's parameter count (netem JSON)")
        scales["payload_scale"] = params / netem_params
    times = crossover.recipe_times(report, profiles, link_gbps * 1e9, p, g, **scales)
    key = f"{link_gbps * 1000:g}"
    arms = []
    for name, entry in times.items():
        seeds = []
        for seconds, censored, fields in zip(entry["seconds"], entry["censored"],
                                             entry["pairing"], strict=True):  # fmt: skip
            block = {"reached": not censored, "seconds": {key: seconds}}
            if censored:
                block = {"reached": False, "seconds": {}, "run_end": {"seconds": {key: seconds}}}
            # the fields ranking.pairing_key reads, so that seeds pair as in the report
            seeds.append({"time_to_target": block, **fields})
        arms.append({"name": name, "seeds": seeds})
    (groups,) = ranking.groups(arms, [link_gbps * 1000])
    return {
        "cluster": {
            "nodes": nodes,
            "gpus_per_node": g,
            "ranks": p,
            "link_gbps": link_gbps,
            "latency_us": latency_us,
        },  # fmt: skip
        "scales": scales,
        "recipes": {
            name: {
                **{k: v for k, v in entry.items() if k != "pairing"},
                "evidence": evidence(report, name, profiles),
            }
            for name, entry in times.items()
        },  # fmt: skip
        "groups": groups,
        "never_reached": sorted(
            {r["name"] for r in report["runs"]}
            - {r["name"] for r in report["runs"] if r["time_to_target"].get("reached")}
        ),
        "not_modelled": sorted(
            {r["name"] for r in report["runs"] if r["time_to_target"].get("reached")} - set(times)
        ),
        "caveat": caveat(report),
    }


def evidence(report: dict, name: str, profiles: dict) -> dict:
    """The runs behind a recipe's time: seeds, how many reached the target, their data and
    the sweep its speeds come from."""
    runs = [r for r in report["runs"] if r["name"] == name]
    data = {(r.get("data") or {}).get("tokenizer_sha256", "")[:12] or "not recorded" for r in runs}
    key = linkmodel.profile_key(runs[0]["strategy"])
    source = sorted({p.source for p in (profiles.get(key) or {}).values()})
    return {
        "seeds": [r["seed"] for r in runs],
        "reached": sum(1 for r in runs if r["time_to_target"].get("reached")),
        "regime": f"{runs[0]['world_size']} workers, global batch {runs[0]['global_batch_size']}"
        f", {runs[0]['steps']:,} steps",
        "data": sorted(data),
        "speeds_from": source,
    }


def caveat(report: dict) -> str:
    first = report["runs"][0]
    counts: dict[str, int] = {}
    for run in report["runs"]:
        counts[run["name"]] = counts.get(run["name"], 0) + 1
    low, high = min(counts.values()), max(counts.values())
    seeds = f"{low}" if low == high else f"{low} to {high}"
    return CAVEAT.format(steps=first["steps"], batch=first["global_batch_size"], seeds=seeds)


def render(advice: dict) -> str:
    """The advice as a user reads it."""
    c = advice["cluster"]
    row = advice["groups"]
    sc = advice["scales"]
    lines = [
        f"{c['nodes']} nodes × {c['gpus_per_node']} GPUs ({c['ranks']} ranks), "
        f"{c['link_gbps']:g} Gbit/s per node, {c['latency_us']:g} µs per message; compute "
        f"per step × {sc.get('compute_scale', 1):.3g} and bytes × "
        f"{sc.get('payload_scale', 1):.3g} of the benchmark's",
        "",
        f"Answer: {ranking.answer(row)}.",
    ]
    by_name = {e["name"]: e for e in row["ranking"]}
    if row["behind"]:
        lines.append("Clearly behind: " + ", ".join(ranking.entry_text(by_name[n])
                                                    for n in row["behind"]) + ".")  # fmt: skip
    if advice["never_reached"]:
        lines.append("Never reached the target in the comparison: "
                     + ", ".join(advice["never_reached"]) + ".")  # fmt: skip
    if advice["not_modelled"]:
        lines.append("Reached the target, but no speed was measured to model: "
                     + ", ".join(advice["not_modelled"]) + ".")  # fmt: skip
    lines += ["", "recipe | modelled time to target | seeds at target | evidence"]
    for entry in row["ranking"]:
        ev = advice["recipes"][entry["name"]]["evidence"]
        std = advice["recipes"][entry["name"]]["std"]
        lines.append(
            f"{entry['name']} | {'≥ ' if entry['lower_bound'] else ''}"
            f"{ranking.human_seconds(entry['mean'])} ± {ranking.human_seconds(std)} | "
            f"{ev['reached']}/{len(ev['seeds'])} | seeds {', '.join(map(str, ev['seeds']))}; "
            f"{ev['regime']}; data {', '.join(ev['data'])}; speeds {', '.join(ev['speeds_from'])}"
        )
    lines += [
        "",
        "Times are for the comparison's target (its samples to the target, a few hundred "
        "thousand sequences): read them as ratios between recipes.",
        f"Test: {row['test']}.",
        "",
        "Caveat: " + advice["caveat"],
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- --measure


def measure_link(comm, gpus_per_node: int, sizes=PROBE_BYTES, repeats: int = 3) -> dict:
    """Time all-reduces of ``sizes`` bytes on ``comm``'s ranks and fit each node's link:
    a ring all-reduce of ``n`` bytes takes ``2 (p - 1) · latency + factor · n · 8 / B``
    (``factor``: :func:`pipeline.reports.linkmodel.link_factor` of a ring on ``p`` ranks in nodes
    of ``gpus_per_node``). Every rank returns the same fit (the slowest rank's times)."""
    import torch

    p = comm.world_size
    points = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=comm.device)
        comm.all_reduce(tensor)  # warm the connection and the buffers
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            comm.all_reduce(tensor)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64)
        comm.all_reduce(elapsed.to(comm.device), op="max")
        points.append((size, float(elapsed.item())))
    factor = linkmodel.link_factor("ring", p, gpus_per_node)
    xs = [factor * n * 8 for n, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return {
        "link_gbps": 1 / slope / 1e9,
        "latency_us": intercept / max(2 * (p - 1), 1) * 1e6,
        "probe": [{"bytes": n, "seconds": t} for n, t in points],
        "ranks": p,
        "gpus_per_node": gpus_per_node,
    }


def _measured() -> dict | None:
    """Run the probe on the job's ranks; rank 0 gets the fit, the others None."""
    import torch.distributed as dist

    from onebit_bert.distributed.env import destroy_distributed, init_distributed

    joined = dist.is_available() and dist.is_initialized()  # a group this process already has
    ctx = init_distributed()
    try:
        g = max(ctx.launch.local_world_size, 1)
        if ctx.world_size < 2 or ctx.world_size % g:
            raise ValueError(
                f"--measure runs on the job's ranks: launch it with torchrun or srun on two or "
                f"more ranks (got a world of {ctx.world_size}, {g} per node)"
            )
        link = measure_link(ctx.comm, g)
        return link if ctx.is_main else None
    finally:
        if not joined:
            destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    """``python -m pipeline.reports.advise``: print the advice for a described or measured
    cluster."""
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.reports.advise",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, help="nodes in the job")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--link-gbps", type=float, help="each node's link, Gbit/s")
    parser.add_argument("--latency-us", type=float, default=0.0, help="per message (default 0)")
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time an all-reduce probe on this job's ranks (torchrun/srun)",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bert-large-h200",
                        help="the compute per step and parameters to rescale to (default: "
                        "BERT-Large on an H200; benchmark: the netem sweeps' own)")  # fmt: skip
    parser.add_argument("--compute-s-per-step", type=float,
                        help="your step's compute without communication, seconds (overrides "
                        "the preset)")  # fmt: skip
    parser.add_argument("--params", type=int, help="your model's parameters (overrides the preset)")
    parser.add_argument("--report", default=REPORT, help="a pipeline.reports.compare report.json")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    if not args.measure and (args.nodes is None or args.link_gbps is None):
        parser.error("describe the cluster (--nodes N --link-gbps B [--gpus-per-node G]) or "
                     "run inside it with --measure")  # fmt: skip
    compute, params = PRESETS[args.preset]
    args.compute_s_per_step = args.compute_s_per_step or compute
    args.params = args.params or params
    report_path = linkmodel.REPO / args.report
    if not report_path.is_file():
        parser.error(
            f"--report {args.report}: no such report.json (python -m pipeline.reports.compare)"
        )
    try:
        if args.measure:
            link = _measured()
            if link is None:
                return 0
            args.nodes = link["ranks"] // link["gpus_per_node"]
            args.gpus_per_node = link["gpus_per_node"]
            args.link_gbps, args.latency_us = link["link_gbps"], link["latency_us"]
        report = json.loads(report_path.read_text())
        profiles, _ = linkmodel.load_profiles(report["time_model"]["netem"])
        netem_params = json.loads(
            (linkmodel.REPO / report["time_model"]["netem"][0]).read_text()
        ).get("parameters")
        advice = advise(report, profiles, args.nodes, args.gpus_per_node, args.link_gbps,
                        args.latency_us, args.compute_s_per_step, args.params,
                        netem_params)  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.measure:
        advice["measured"] = link
    print(json.dumps(advice) if args.json else render(advice), end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
