"""The runs of :mod:`bench.netem` at one sweep point: a config per strategy, the real
pretraining stage on the emulated hosts, and the summaries of its step records (medians,
means over whole rounds or periods); :func:`measure` gives one result row."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import pretrain_config
from bench.netem_cluster import Cluster, run_compute_only, run_distributed
from onebit_bert.recipes import RECIPES, get_recipe
from pretrain.outputs import metrics_path

# ----------------------------------------------------------------------------- the runs


def step_records(run_dir: Path) -> list[dict]:
    from onebit_bert.metrics_log import read_metrics

    return [r for r in read_metrics(metrics_path(run_dir)) if "step_seconds" in r]


def _wall_step_seconds(records: list[dict]) -> list[float]:
    """Seconds between consecutive records' log times: the whole loop per step, including
    what ``step_seconds`` leaves out (the per-step statistics all-reduce, logging)."""
    return [b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False)]


def summarize(records: list[dict], batch: int, average=statistics.median) -> dict:
    """Medians over the given step records (robust to a slow first step or a hiccup); with
    ``average=statistics.fmean``, means (for steps that differ by design, as the rounds of a
    time-varying graph)."""
    if not records:
        raise RuntimeError("no step records to summarize (increase --steps)")

    def avg(key):
        values = [r[key] for r in records if key in r]
        return average(values) if values else None

    step = avg("step_seconds")
    wall = _wall_step_seconds(records)
    return {
        "steps": len(records),
        "step_seconds": step,
        "samples_per_s": batch / step,
        "wall_samples_per_s": batch / average(wall) if wall else None,
        "forward_backward_seconds": avg("forward_backward_seconds"),
        "comm_seconds": avg("comm_seconds"),
        "comm_fraction": average([r["comm_seconds"] / r["step_seconds"] for r in records]),
        "counted_bytes_per_step": avg("comm_bytes"),
        "wire_bytes_per_step": avg("net_rx_bytes"),
    }


def round_window(records: list[dict], every: int) -> list[dict]:
    """The records of the whole rounds after the first two (``every`` steps per round):
    round 0 has nothing in flight and round 1's end is the first wait. Raises when a step
    of the window has no record or no whole round is left."""
    by_step = {r["step"]: r for r in records}
    last = max(by_step, default=0) // every * every
    steps = range(2 * every + 1, last + 1)
    if not steps:
        raise RuntimeError(
            f"no whole round of {every} steps after the first two (run has {len(records)} steps)"
        )
    missing = [s for s in steps if s not in by_step]
    if missing:
        raise RuntimeError(f"steps {missing[:5]} of the measured rounds have no record")
    return [by_step[s] for s in steps]


def round_summary(records: list[dict], batch: int, every: int) -> dict:
    """Means over whole rounds of a local-step run (see :func:`round_window`), not medians:
    a median would hide the one step per round that sends. Samples/s is batch x steps over
    the summed step seconds, bytes are per step over the window, comm_fraction is summed
    comm seconds over summed step seconds; the outer steps' blocked wait and in-flight
    time are averaged over the window's outer steps (None where the strategy never waits
    in the background)."""
    window = round_window(records, every)
    n = len(window)
    seconds = sum(r["step_seconds"] for r in window)
    outer = [r for r in window if r["step"] % every == 0]
    inner = [r for r in window if r["step"] % every]

    def total(key):
        values = [r[key] for r in window if key in r]
        return sum(values) if len(values) == n else None

    def mean(key, rows):
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else None

    before = next((r for r in records if r["step"] == window[0]["step"] - 1), None)
    wall = window[-1]["time"] - before["time"] if before and "time" in before else None
    wire = total("net_rx_bytes")
    return {
        "steps": n,
        "rounds": n // every,
        "outer_every": every,
        "step_seconds": seconds / n,
        "samples_per_s": batch * n / seconds,
        "wall_samples_per_s": batch * n / wall if wall else None,
        "forward_backward_seconds": mean("forward_backward_seconds", window),
        "comm_seconds": total("comm_seconds") / n,
        "comm_fraction": total("comm_seconds") / seconds,
        "counted_bytes_per_step": total("comm_bytes") / n,
        "wire_bytes_per_step": None if wire is None else wire / n,
        "inner_step_seconds": mean("step_seconds", inner),
        "outer_step_seconds": mean("step_seconds", outer),
        "outer_wait_seconds_mean": mean("outer_wait_seconds", outer),
        "outer_in_flight_seconds": mean("outer_in_flight_seconds", outer),
    }


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepPoint:
    """One point of the sweep: a cluster shaped to one bandwidth, the benchmark's arguments,
    and the folder that holds this point's configs, run folders and logs."""

    cluster: Cluster
    data: Path
    folder: Path
    args: argparse.Namespace
    threads: int
    batch: int
    ranks_per_host: int = 1

    @property
    def world(self) -> int:
        """Ranks: hosts x ranks per host."""
        return self.cluster.hosts * self.ranks_per_host

    def config(
        self, name: str, optimizer: str, steps: int, rank: int | None = None, **sections: Any
    ) -> Path:
        """Write the pretraining config ``<name>[rank].yaml`` and return its run folder. With
        ``rank``: a single-process run of one rank's batch; without: the distributed run of
        the global batch, with ``eth0``'s sent bytes logged. ``sections``: what
        :func:`~bench.common.pretrain_config` takes besides the sweep's settings
        (``strategy``, ``momentum``, ``optimizer_fields``, ``comm``)."""
        from onebit_bert.config import from_dict, save_config
        from pretrain.config import PretrainConfig

        per_rank = rank is not None
        suffix = str(rank) if per_rank else ""
        run_dir = self.folder / f"{name}{suffix}"
        args = self.args
        cfg = from_dict(
            PretrainConfig,
            pretrain_config(
                self.data,
                run_dir,
                optimizer,
                model=args.model,
                batch=args.batch if per_rank else self.batch,
                micro=min(args.micro_batch, args.batch),
                steps=steps,
                freeze_step=args.freeze_step,
                stop_after=steps,
                net_interface=None if per_rank else "eth0",
                **sections,
            ),
        )
        path = self.folder / f"{name}{suffix}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, path)
        return run_dir

    def run_distributed(self, name: str) -> None:
        """Run the distributed config ``<name>.yaml`` on every host."""
        run_distributed(
            self.cluster,
            self.folder / f"{name}.yaml",
            self.folder / f"logs_{name}",
            self.threads,
            self.args.run_timeout,
            self.ranks_per_host,
        )


def _measure_data_parallel(point: SweepPoint, name: str) -> dict:
    """A recipe with the gradient all-reduce every step (LAMB, AdamW, PowerSGD, ...):
    medians after the warmup steps."""
    args = point.args
    optimizer, comm = variant(name, args)
    # PowerSGD's first steps are full precision: measure from its first compressed one
    skip = max(args.warmup_steps, (comm or {}).get("powersgd_start_step", 0))
    run_dir = point.config(name, optimizer, skip + args.steps, comm=comm)
    point.run_distributed(name)
    return summarize(step_records(run_dir)[skip:], point.batch)


def _measure_onebit(point: SweepPoint, name: str = "onebit_lamb") -> dict:
    """A 1-bit LAMB or 1-bit Adam recipe: the compression stage's summary, with the
    warmup stage's under ``warmup`` (first step of each skipped)."""
    args = point.args
    run = "onebit" if name == "onebit_lamb" else name
    optimizer, comm = variant(name, args)
    onebit_dir = point.config(run, optimizer, args.freeze_step + 1 + args.steps, comm=comm)
    point.run_distributed(run)
    records = step_records(onebit_dir)
    warmup_records = [r for r in records if r["stage"] == "warmup"][1:]
    compression_records = [r for r in records if r["stage"] == "compression"][1:]
    return {
        **summarize(compression_records, point.batch),
        "warmup": summarize(warmup_records, point.batch),
    }


def variant(name: str, args: argparse.Namespace) -> tuple[str, dict | None]:
    """(optimizer, comm section) of recipe ``name`` as the benchmark runs it: the recipe's
    comm settings, with the command line's hybrid codec (``--hybrid-codec``, a recipe whose
    warmup-gradient codec is open), overlap buckets (``--bucket-mb``) and PowerSGD rank
    (``--powersgd-rank``, from its first step after ``--warmup-steps``)."""
    recipe = get_recipe(name)
    comm: dict = {}
    for key, value in recipe.settings.items():
        section, *path, last = key.split(".")
        if section != "comm":
            raise ValueError(f"recipe {name}: bench.netem sets only comm fields, not {key}")
        node = comm
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    compression = comm.get("compression", {})
    if "comm.compression.grad" in recipe.open_fields:
        compression["grad"] = args.hybrid_codec
    if comm.get("overlap"):
        comm["bucket_mb"] = args.bucket_mb
    if compression.get("grad") == "powersgd":
        comm.update(powersgd_rank=args.powersgd_rank, powersgd_start_step=max(2, args.warmup_steps))
    return recipe.optimizer, comm or None


ZERO_ONE_ADAM_BENCH = {
    "var_freeze_step": 6,
    "var_update_scaler": 2,
    "local_step_scaler": 2,
    "local_step_clipper": 4,
}
"""0/1 Adam's schedule in the benchmark: variance steps 1, 2, 4, 6 (two per interval,
the interval doubling), 1-bit gradient steps 3 and 5, then local steps with a 1-bit sync
every 1, 2, then 4 steps. A real run's mix of kinds follows its own schedule (e.g. BERT-Large's
config: variance updates to step 12,500, then syncs every 16 steps at most)."""
ZERO_ONE_ADAM_KINDS = ("variance", "compressed", "local", "sync")


def _measure_zero_one_adam(point: SweepPoint, name: str = "zero_one_adam") -> dict:
    """0/1 Adam on :data:`ZERO_ONE_ADAM_BENCH`'s schedule: the means over the steps after
    the first (``--warmup-steps`` does not apply: the schedule is the measurement), and under
    ``kinds`` the medians of each kind of step (by its logged ``stage``)."""
    steps = ZERO_ONE_ADAM_BENCH["var_freeze_step"] + max(point.args.steps, 12)
    run_dir = point.config(name, name, steps, optimizer_fields=ZERO_ONE_ADAM_BENCH)
    point.run_distributed(name)
    records = step_records(run_dir)[1:]
    kinds = {}
    for kind in ZERO_ONE_ADAM_KINDS:
        of_kind = [r for r in records if r.get("stage") == kind]
        if of_kind:
            kinds[kind] = summarize(of_kind, point.batch)
    return {
        **summarize(records, point.batch, statistics.fmean),
        "kinds": kinds,
        "schedule": dict(ZERO_ONE_ADAM_BENCH),
    }


def local_steps_total(steps: int, every: int) -> int:
    """Steps a local-step run takes: two unmeasured rounds, then ``steps`` rounded up to
    whole rounds of ``every``."""
    return 2 * every + -(-steps // every) * every


def _measure_local_steps(point: SweepPoint, name: str) -> dict:
    """A local-step recipe (co2, slowmo, local_sgd: inner LAMB; diloco, streaming_diloco:
    inner AdamW; ``--inner`` names another for a recipe whose optimizer is open), an outer
    step every ``--outer-every`` steps, the recipe's own where it names one
    (streaming_diloco: a multiple of its 4 fragments): means over whole rounds
    (:func:`round_summary`)."""
    every = getattr(point.args, "outer_every_by_recipe", {}).get(name, point.args.outer_every)
    recipe = get_recipe(name)
    optimizer, comm = variant(name, point.args)
    optimizer = (getattr(point.args, "inner_by_recipe", None) or {}).get(name, optimizer)
    run_dir = point.config(
        name,
        optimizer,
        local_steps_total(point.args.steps, every),
        strategy={"name": recipe.strategy, "outer_every": every},
        comm=comm,
    )
    point.run_distributed(name)
    summary = round_summary(step_records(run_dir), point.batch, every)
    return {**summary, "inner_optimizer": optimizer}


def _measure_decentralized(point: SweepPoint, name: str) -> dict[str, dict]:
    """decentlam or dmsgd (momentum SGD, no layerwise scaling) on each graph of
    ``--topologies``: one entry ``<name>/<topology>`` each, after the warmup steps: medians
    on a static graph (every step sends the same), means over whole periods on a
    time-varying one (the one-peer graph's rounds talk to different peers, and a pair that
    swaps vectors both ways is slower than a chain of one-way sends). The consensus
    distance is not measured (it costs one parameter all-reduce per ``consensus_every``
    steps, a diagnostic, not the method)."""
    from onebit_bert.distributed.topology import largest_stable_momentum, period

    args = point.args
    warm = args.warmup_steps
    strategy = get_recipe(name).strategy
    entries = {}
    for topology in args.topologies.split(","):
        run = f"{name}_{topology}"
        momentum = DECENTRALIZED_MOMENTUM
        if strategy == "decentlam":  # the graph may not take 0.9 (strategy build refuses it)
            momentum = min(momentum, largest_stable_momentum(topology, point.world))
        run_dir = point.config(
            run,
            get_recipe(name).optimizer,
            warm + args.steps,
            strategy={"name": strategy, "topology": topology, "consensus_every": 0},
            momentum=momentum,
        )
        point.run_distributed(run)
        records = step_records(run_dir)[warm:]
        rounds = period(topology, point.world)
        if rounds > 1:
            if len(records) < rounds:
                raise RuntimeError(f"{run}: --steps must cover one period ({rounds} steps)")
            records = records[: len(records) // rounds * rounds]
        entries[f"{name}/{topology}"] = {
            **summarize(
                records, point.batch, statistics.median if rounds == 1 else statistics.fmean
            ),
            "topology": topology,
            "period": rounds,
            "momentum": momentum,
        }
    return entries


def _single(measure):
    """A measure of one runs entry, named as its strategy."""
    return lambda point, name: {name: measure(point, name)}


MEASURE = {
    "data_parallel": _single(_measure_data_parallel),
    "onebit": _single(_measure_onebit),
    "zero_one_adam": _single(_measure_zero_one_adam),
    "local_steps": _single(_measure_local_steps),
    "decentralized": _measure_decentralized,
}
"""A recipe's ``measure`` -> measure(point, name) -> {runs entry name: summary}."""
STRATEGIES = tuple(RECIPES)
"""The recipes the benchmark measures: every registered one."""
DEFAULT_TOPOLOGIES = "one_peer_exponential,ring"
DECENTRALIZED_MOMENTUM = 0.9
"""decentlam's and dmsgd's momentum; lower for DecentLaM where a graph cannot take it. It
changes no step's work or traffic, only whether the run diverges."""


def _measure_compute_only(point: SweepPoint) -> dict:
    """Samples/s of the compute-only runs, summed over the hosts: from the step timer
    (``samples_per_s``) and from the log times (``wall_samples_per_s``)."""
    args = point.args
    world = point.world
    warm = args.warmup_steps
    dirs = [point.config("compute", "lamb", warm + args.steps, i) for i in range(world)]
    run_compute_only(
        point.cluster,
        [point.folder / f"compute{i}.yaml" for i in range(world)],
        point.folder / "logs_compute",
        point.threads,
        args.run_timeout,
        point.ranks_per_host,
    )
    per_process = [summarize(step_records(d)[warm:], args.batch) for d in dirs]
    walls = [p["wall_samples_per_s"] for p in per_process]
    return {
        "samples_per_s": sum(p["samples_per_s"] for p in per_process),
        "wall_samples_per_s": sum(walls) if all(walls) else None,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _bytes_per_step(run: dict) -> dict:
    """Wire and counted bytes per step, and their ratio (None when either is missing)."""
    wire, counted = run["wire_bytes_per_step"], run["counted_bytes_per_step"]
    return {"wire": wire, "counted": counted, "wire_over_counted": _ratio(wire, counted)}


def _lamb_onebit_keys(runs: dict[str, dict], compute_only: float) -> dict:
    """The row's LAMB and 1-bit LAMB keys, for the strategies that were measured."""
    keys = {}
    lamb, onebit = runs.get("lamb"), runs.get("onebit_lamb")
    if lamb:
        keys.update(
            lamb_samples_per_s=lamb["samples_per_s"],
            lamb_comm_fraction=lamb["comm_fraction"],
            lamb_bytes_per_step=_bytes_per_step(lamb),
        )
    if onebit:
        keys.update(
            onebit_warmup_samples_per_s=onebit["warmup"]["samples_per_s"],
            onebit_samples_per_s=onebit["samples_per_s"],
            onebit_comm_fraction=onebit["comm_fraction"],
            onebit_vs_compute_only=onebit["samples_per_s"] / compute_only,
            onebit_warmup_bytes_per_step=_bytes_per_step(onebit["warmup"]),
            onebit_bytes_per_step=_bytes_per_step(onebit),
        )
    if lamb and onebit:
        keys.update(
            speedup=onebit["samples_per_s"] / lamb["samples_per_s"],
            bytes_ratio=_ratio(lamb["wire_bytes_per_step"], onebit["wire_bytes_per_step"]),
            counted_bytes_ratio=_ratio(
                lamb["counted_bytes_per_step"], onebit["counted_bytes_per_step"]
            ),
        )
    return keys


def result_row(point: dict, runs: dict[str, dict], compute_only: dict) -> dict:
    """One sweep point's row: ``point`` (bandwidth, world size, ...), the compute-only
    samples/s, the LAMB/1-bit LAMB keys, and ``runs`` (one summary per strategy) with each
    strategy's samples/s over compute-only (``vs_compute_only``; ``wall_vs_compute_only``
    from the log times) and, where LAMB was measured, LAMB's counted bytes per step over the
    strategy's (``counted_bytes_vs_lamb``)."""
    lamb_bytes = runs["lamb"]["counted_bytes_per_step"] if "lamb" in runs else None
    for run in runs.values():
        run["vs_compute_only"] = run["samples_per_s"] / compute_only["samples_per_s"]
        run["wall_vs_compute_only"] = _ratio(
            run.get("wall_samples_per_s"), compute_only["wall_samples_per_s"]
        )
        if lamb_bytes is not None:
            run["counted_bytes_vs_lamb"] = _ratio(lamb_bytes, run["counted_bytes_per_step"])
    return {
        **point,
        "compute_only_samples_per_s": compute_only["samples_per_s"],
        "compute_only_wall_samples_per_s": compute_only["wall_samples_per_s"],
        **_lamb_onebit_keys(runs, compute_only["samples_per_s"]),
        "runs": runs,
    }


def measure(
    cluster: Cluster,
    data: Path,
    work: Path,
    args: argparse.Namespace,
    bandwidth: float,
    strategies: list[str],
    repeat: int = 0,
) -> dict:
    """Shape ``cluster`` to ``bandwidth`` Mbit/s and measure each of ``strategies``, then
    the compute-only runs there: one result row. Each ``repeat`` of a point runs in its own
    folder."""
    ranks_per_host = getattr(args, "ranks_per_host", 1)
    world = cluster.hosts * ranks_per_host
    point = SweepPoint(
        cluster,
        data,
        work / (f"{bandwidth:g}mbit_p{world}" + (f"_r{repeat}" if repeat else "")),
        args,
        threads=args.threads or max(1, (os.cpu_count() or 1) // world),
        batch=args.batch * world,
        ranks_per_host=ranks_per_host,
    )
    cluster.shape(bandwidth)
    runs = {}
    for name in strategies:
        runs.update(MEASURE[get_recipe(name).measure](point, name))
    compute_only = _measure_compute_only(point)
    info = {
        "bandwidth_mbit": bandwidth,
        "world_size": world,
        "hosts": cluster.hosts,
        "ranks_per_host": ranks_per_host,
        "threads_per_rank": point.threads,
        "global_batch": point.batch,
    }
    return result_row(info, runs, compute_only)
