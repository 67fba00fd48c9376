"""Pretraining strategies on an emulated low-bandwidth cluster (namespaces + tc).

Builds an N-host cluster on this machine: one network namespace per host, each joined to a
bridge by a veth pair (host side ``<tag>h<i>``, namespace side ``eth0``, addresses
198.18.0.0/24), with an htb rate limit on BOTH directions of every link (see
:mod:`bench.netem_cluster`). Then runs the real pretraining stage (``python -m pretrain``),
one gloo process per host, once per strategy of ``--strategies`` (default
``lamb,onebit_lamb``):

* lamb, adamw: the gradient all-reduce every step (medians after ``--warmup-steps``);
* onebit_lamb, onebit_adam: ``freeze_step`` full-precision warmup steps, then the
  compression stage (medians of each stage, its first step skipped);
* zero_one_adam: a shortened 0/1 Adam schedule that passes through all its kinds of step
  (full-precision variance steps, 1-bit gradient steps, local steps, 1-bit syncs;
  :data:`ZERO_ONE_ADAM_BENCH`): the medians of each kind, and the means over the measured
  steps;
* co2, slowmo, local_sgd: LAMB steps on each rank (LAMB's learning rate) and one parameter
  all-reduce every ``--outer-every`` (tau) steps; CO2's runs in the background during the
  next round. Means over whole rounds, the first two skipped (round 0 has nothing in
  flight, round 1's end is the first wait): a median would hide the one step per round
  that sends (:func:`round_summary`);
* decentlam, dmsgd: momentum SGD on each rank and every step one parameter vector sent to
  each neighbour of each graph of ``--topologies`` (default one-peer exponential and ring),
  point to point; a runs entry ``<strategy>/<topology>`` per graph (medians, as LAMB's);

and a compute-only run: the same per-rank work (model, micro-batch, a LAMB update) in N
independent single-process runs started together, so they share the CPU exactly as the N
ranks do but never communicate: the upper limit of samples/s.

Step times and bytes come from the stage's own metrics (rank 0): ``comm_bytes`` is what the
communicator handed to gloo (a background all-reduce counted in the step that launches it),
``net_rx_bytes`` what rank 0's eth0 received in the same step window (``logging.net_interface``;
bytes a background all-reduce sends between two step windows are in neither). Received, not
sent: a step cannot end before what it receives has arrived, while what it sent may still
sit in the emulated link's queue and be counted in the next window (point-to-point
exchanges end on the receive); every traffic pattern here is symmetric, each rank
receiving what it sends. The step
timer (``samples_per_s``) ends before the loop's per-step statistics all-reduce; every
summary also has ``wall_samples_per_s`` from the records' log times, which include it (and
the wait for the slowest rank it implies). Links are reshaped between bandwidths; the namespaces are
rebuilt per world size and removed on success, failure, Ctrl-C or SIGTERM.

Prints one JSON object as its last line and writes it, with a PNG plot, to ``--out``.
Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, prepare_wikipedia_seq128, pretrain_config, shared_data_error
from bench.netem_cluster import (
    Cluster,
    check_privileges,
    remove_stale_clusters,
    run_compute_only,
    run_distributed,
)
from pretrain.outputs import metrics_path

BERT_LARGE_PARAMS = 335_000_000  # BERT-Large with its MLM/NSP heads, about
DEFAULT_OUTER_EVERY = 8
"""tau of the local-step strategies. At 25 Mbit/s on 4 hosts bert-mini's parameter average
(a ring all-reduce of 45 MB) is in flight about 22 s, two compute steps of about 10 s on 2
cores: a round of 8 steps leaves CO2 nothing to wait for, with room for slower steps, and
sends LAMB's bytes per step / 8."""
WHY_COMM_BOUND = (
    "A LAMB step all-reduces every fp32 gradient: a ring moves 2(p-1)/p of the gradient "
    "through each rank's link per step. BERT-Large's ~1.34 GB gradient needs ~{large:.1f} s "
    "per step on a 10 Gbit/s link and ~{large_1g:.0f} s on 1 Gbit/s, many times the compute "
    "of a GPU's micro-batch, so on Ethernet the step is communication-bound. Here the model "
    "({model}, {params:.1f} M parameters, {grad_mb:.0f} MB gradient) and the per-rank batch "
    "({batch} sequences of {seq_length} tokens on {threads} CPU thread(s) per rank) put the same "
    "ratio in reach of emulated links: lamb_comm_fraction is the measured share of LAMB's "
    "step spent in communication, and the runs where it is >= 0.75 are the "
    "communication-bound regime the paper targets."
)


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

    def config(
        self,
        name: str,
        optimizer: str,
        steps: int,
        rank: int | None = None,
        strategy: dict | None = None,
        momentum: float | None = None,
        optimizer_fields: dict | None = None,
    ) -> Path:
        """Write the pretraining config ``<name>[rank].yaml`` and return its run folder. With
        ``rank``: a single-process run of one rank's batch; without: the distributed run of
        the global batch, with ``eth0``'s sent bytes logged. ``strategy``: the config's
        strategy section (default: the optimizer's own); ``momentum``: optimizer.betas[0]."""
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
                strategy=strategy,
                momentum=momentum,
                optimizer_fields=optimizer_fields,
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
        )


def _measure_data_parallel(point: SweepPoint, name: str) -> dict:
    """LAMB or AdamW with the gradient all-reduce every step: medians after the warmup
    steps."""
    args = point.args
    warm = args.warmup_steps
    run_dir = point.config(name, name, warm + args.steps)
    point.run_distributed(name)
    return summarize(step_records(run_dir)[warm:], point.batch)


def _measure_onebit(point: SweepPoint, name: str = "onebit_lamb") -> dict:
    """1-bit LAMB or 1-bit Adam: the compression stage's summary, with the warmup stage's
    under ``warmup`` (first step of each skipped)."""
    args = point.args
    run = "onebit" if name == "onebit_lamb" else name
    onebit_dir = point.config(run, name, args.freeze_step + 1 + args.steps)
    point.run_distributed(run)
    records = step_records(onebit_dir)
    warmup_records = [r for r in records if r["stage"] == "warmup"][1:]
    compression_records = [r for r in records if r["stage"] == "compression"][1:]
    return {
        **summarize(compression_records, point.batch),
        "warmup": summarize(warmup_records, point.batch),
    }


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
    """co2, slowmo or local_sgd with inner LAMB, an outer step every ``--outer-every``
    steps: means over whole rounds (:func:`round_summary`)."""
    every = point.args.outer_every
    run_dir = point.config(
        name,
        "lamb",
        local_steps_total(point.args.steps, every),
        strategy={"name": name, "outer_every": every},
    )
    point.run_distributed(name)
    return round_summary(step_records(run_dir), point.batch, every)


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
    entries = {}
    for topology in args.topologies.split(","):
        run = f"{name}_{topology}"
        momentum = DECENTRALIZED_MOMENTUM
        if name == "decentlam":  # the graph may not take 0.9 (strategy build refuses it)
            momentum = min(momentum, largest_stable_momentum(topology, point.cluster.hosts))
        run_dir = point.config(
            run,
            "sgd",
            warm + args.steps,
            strategy={"name": name, "topology": topology, "consensus_every": 0},
            momentum=momentum,
        )
        point.run_distributed(run)
        records = step_records(run_dir)[warm:]
        rounds = period(topology, point.cluster.hosts)
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
    "lamb": _single(_measure_data_parallel),
    "onebit_lamb": _single(_measure_onebit),
    "adamw": _single(_measure_data_parallel),
    "onebit_adam": _single(_measure_onebit),
    "zero_one_adam": _single(_measure_zero_one_adam),
    "co2": _single(_measure_local_steps),
    "slowmo": _single(_measure_local_steps),
    "local_sgd": _single(_measure_local_steps),
    "decentlam": _measure_decentralized,
    "dmsgd": _measure_decentralized,
}
"""Strategy name -> measure(point, name) -> {runs entry name: summary}."""
STRATEGIES = tuple(MEASURE)
LOCAL_STEP_STRATEGIES = ("co2", "slowmo", "local_sgd")
DECENTRALIZED_STRATEGIES = ("decentlam", "dmsgd")
DEFAULT_TOPOLOGIES = "one_peer_exponential,ring"
DECENTRALIZED_MOMENTUM = 0.9
"""decentlam's and dmsgd's momentum; lower for DecentLaM where a graph cannot take it. It
changes no step's work or traffic, only whether the run diverges."""


def _measure_compute_only(point: SweepPoint) -> dict:
    """Samples/s of the compute-only runs, summed over the hosts: from the step timer
    (``samples_per_s``) and from the log times (``wall_samples_per_s``)."""
    args = point.args
    world = point.cluster.hosts
    warm = args.warmup_steps
    dirs = [point.config("compute", "lamb", warm + args.steps, i) for i in range(world)]
    run_compute_only(
        point.cluster,
        [point.folder / f"compute{i}.yaml" for i in range(world)],
        point.folder / "logs_compute",
        point.threads,
        args.run_timeout,
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
) -> dict:
    """Shape ``cluster`` to ``bandwidth`` Mbit/s and measure each of ``strategies``, then
    the compute-only runs there: one result row."""
    world = cluster.hosts
    point = SweepPoint(
        cluster,
        data,
        work / f"{bandwidth:g}mbit_p{world}",
        args,
        threads=args.threads or max(1, (os.cpu_count() or 1) // world),
        batch=args.batch * world,
    )
    cluster.shape(bandwidth)
    runs = {}
    for name in strategies:
        runs.update(MEASURE[name](point, name))
    compute_only = _measure_compute_only(point)
    info = {
        "bandwidth_mbit": bandwidth,
        "world_size": world,
        "threads_per_rank": point.threads,
        "global_batch": point.batch,
    }
    return result_row(info, runs, compute_only)


def whole_run_steps(config: Path) -> tuple[int, int]:
    """``config``'s (max_steps, freeze_step): a BERT-Large 1-bit LAMB pretraining config."""
    from onebit_bert.config import load_config
    from pretrain.config import PretrainConfig

    cfg = load_config(PretrainConfig, config)
    return cfg.schedule.max_steps, cfg.optimizer.freeze_step


def whole_run_reduction(result: dict, config: Path, steps: int, freeze: int) -> dict:
    """Communication of a whole run of ``steps`` steps with LAMB over that with 1-bit LAMB
    frozen after ``freeze`` steps, from the measured wire bytes per step."""
    lamb = result["lamb_bytes_per_step"]["wire"]
    warm = result["onebit_warmup_bytes_per_step"]["wire"]
    comp = result["onebit_bytes_per_step"]["wire"]
    return {
        "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
        "max_steps": steps,
        "freeze_step": freeze,
        "reduction": steps * lamb / (freeze * warm + (steps - freeze) * comp),
    }


def _bandwidth_label(row: dict) -> str:
    """The bandwidth, LAMB's share of the step spent communicating and 1-bit LAMB's speedup
    (where measured): one x tick label."""
    mbit = row["bandwidth_mbit"]
    label = f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"
    if "lamb_comm_fraction" in row:
        label += f"\nLAMB comm {row['lamb_comm_fraction']:.0%}"
    if "speedup" in row:
        label += f"\n1-bit {row['speedup']:.1f}x"
    return label


STRATEGY_LABELS = {
    "lamb": "LAMB",
    "onebit_lamb": "1-bit LAMB compression",
    "adamw": "AdamW",
    "onebit_adam": "1-bit Adam compression",
    "zero_one_adam": "0/1 Adam",
    "co2": "CO2",
    "slowmo": "SlowMo",
    "local_sgd": "local SGD",
    "decentlam": "DecentLaM",
    "dmsgd": "DmSGD",
}
TOPOLOGY_LABELS = {"one_peer_exponential": "one-peer exp.", "ring": "ring", "exponential": "exp."}


def plot_series(row: dict) -> list[tuple[str, tuple[str, ...]]]:
    """The bars of one row, in the order measured: (label, key path into the row); 1-bit
    LAMB as its warmup and its compression stage, compute-only last."""
    series = []
    for name, run in row["runs"].items():
        if name in ("onebit_lamb", "onebit_adam"):
            label = STRATEGY_LABELS[name].replace("compression", "warmup")
            series.append((label, ("runs", name, "warmup", "samples_per_s")))
        strategy, _, topology = name.partition("/")
        label = STRATEGY_LABELS[strategy]
        if topology:
            label += f" ({TOPOLOGY_LABELS.get(topology, topology)})"
        if "outer_every" in run:
            label += f" (tau {run['outer_every']})"
        series.append((label, ("runs", name, "samples_per_s")))
    series.append(("compute only", ("compute_only_samples_per_s",)))
    return series


def _lookup(row: dict, keys: tuple[str, ...]) -> float:
    for key in keys:
        row = row[key]
    return row


def plot(results: list[dict], path: Path) -> None:
    """Bars of samples/s per strategy per bandwidth, one panel per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.8), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        rows = sorted((r for r in results if r["world_size"] == world),
                      key=lambda r: r["bandwidth_mbit"])  # fmt: skip
        series = plot_series(rows[0])
        width = 0.8 / len(series)
        for k, (label, keys) in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [_lookup(r, keys) for r in rows], width, label=label)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([_bandwidth_label(r) for r in rows], fontsize=8)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{world} hosts: samples/s by link bandwidth")
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _terminate_on_sigterm() -> None:
    def handler(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-root", default=os.environ.get("DATA_ROOT", REPO.parent / "shared" / "data")
    )
    parser.add_argument("--data", type=Path, help="prepared shard folder (skips preparation)")
    parser.add_argument("--bandwidths", default="25,40,100,1000,10000", help="Mbit/s, comma list")
    parser.add_argument("--world-sizes", default="2,4", help="hosts, comma list")
    parser.add_argument(
        "--strategies",
        default="lamb,onebit_lamb",
        help=f"comma list of {', '.join(STRATEGIES)} (co2, slowmo and local_sgd step LAMB "
        "locally with LAMB's learning rate; decentlam and dmsgd step momentum SGD, once per "
        "graph of --topologies; zero_one_adam runs a short schedule with every kind of step)",
    )
    parser.add_argument(
        "--outer-every",
        type=int,
        default=DEFAULT_OUTER_EVERY,
        help="tau of co2, slowmo and local_sgd: local steps per round, one parameter "
        "all-reduce per round",
    )
    parser.add_argument(
        "--topologies",
        default=DEFAULT_TOPOLOGIES,
        help="graphs of decentlam and dmsgd, comma list of one_peer_exponential, ring, "
        "exponential, full (one run of each strategy per graph)",
    )
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--batch", type=int, default=64, help="sequences per rank per step")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="per forward/backward (accumulation)"
    )
    parser.add_argument("--steps", type=int, default=4, help="measured steps per stage")
    parser.add_argument("--warmup-steps", type=int, default=2, help="unmeasured first steps")
    parser.add_argument("--freeze-step", type=int, default=3, help="1-bit LAMB warmup steps")
    parser.add_argument("--threads", type=int, default=0, help="per rank; 0: cores / hosts")
    parser.add_argument("--mtu", type=int, default=9000)
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--whole-run-config",
        type=Path,
        default=REPO / "configs/pretrain/bert_large_seq128_64k_onebit.yaml",
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_netem")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    return parser


@dataclass
class SweepPlan:
    """The checked command line: the points to measure, where the data comes from, and the
    (max_steps, freeze_step) of the whole-run config."""

    bandwidths: list[float]
    worlds: list[int]
    strategies: list[str]
    data_root: Path | None  # None when --data names prepared shards
    run_steps: tuple[int, int]


def _strategies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The checked ``--strategies`` (and ``--outer-every``); exits through ``parser``."""
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        parser.error(
            f"--strategies: unknown {', '.join(map(repr, unknown)) or '(empty list)'}; "
            f"choose from {', '.join(STRATEGIES)}"
        )
    if len(set(names)) < len(names):
        parser.error(f"--strategies: each name once (got {args.strategies})")
    if args.outer_every < 1:
        parser.error("--outer-every must be >= 1")
    if set(names) & set(DECENTRALIZED_STRATEGIES):
        from onebit_bert.distributed.topology import TOPOLOGIES

        graphs = [t.strip() for t in args.topologies.split(",") if t.strip()]
        bad = [t for t in graphs if t not in TOPOLOGIES]
        if bad or not graphs or len(set(graphs)) < len(graphs):
            parser.error(
                f"--topologies: {args.topologies!r}; a comma list of distinct names from "
                f"{', '.join(TOPOLOGIES)}"
            )
        args.topologies = ",".join(graphs)
    return names


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SweepPlan:
    """Check the arguments, root and the data; exits through ``parser`` on a problem."""
    bandwidths = [float(b) for b in args.bandwidths.split(",")]
    worlds = [int(w) for w in args.world_sizes.split(",")]
    strategies = _strategies(parser, args)
    if min(worlds) < 2 or max(worlds) > 250:
        parser.error("--world-sizes: each between 2 and 250")
    if set(strategies) & set(DECENTRALIZED_STRATEGIES):
        from onebit_bert.distributed.topology import check_topology

        for topology in args.topologies.split(","):
            for world in worlds:
                try:
                    check_topology(topology, world)
                except ValueError as exc:
                    parser.error(f"--topologies {topology} on {world} hosts: {exc}")
    if min(bandwidths) <= 0:
        parser.error("--bandwidths must be positive")
    if args.batch % min(args.micro_batch, args.batch):
        parser.error("--batch must be a multiple of --micro-batch")
    if args.freeze_step < 2 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("need --freeze-step >= 2 (one warmup step is skipped) and --steps >= 1")
    reason = check_privileges()
    if reason:
        parser.exit(2, f"bench.netem: {reason}\n")
    data_root = None
    if args.data is None:
        data_root = Path(args.data_root).resolve()
        error = shared_data_error(data_root)
        if error:
            parser.error(error)
    else:
        try:
            _seq_length(args.data)
        except (OSError, ValueError) as exc:
            parser.error(f"--data {args.data}: not a prepared shard folder ({exc})")
    try:
        run_steps = whole_run_steps(args.whole_run_config)
    except (OSError, ValueError) as exc:
        parser.error(f"--whole-run-config {args.whole_run_config}: {exc}")
    return SweepPlan(bandwidths, worlds, strategies, data_root, run_steps)


def _sweep(args: argparse.Namespace, plan: SweepPlan) -> tuple[list[dict], int, int]:
    """Measure every (world size, bandwidth) point in a temporary folder; returns the result
    rows, the model's parameter count and the sequence length."""
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_netem_") as tmp:
        work = Path(tmp)
        data = args.data or prepare_wikipedia_seq128(plan.data_root, work / "data")
        for world in plan.worlds:
            with Cluster(world, mtu=args.mtu) as cluster:
                for bandwidth in plan.bandwidths:
                    results.append(measure(cluster, data, work, args, bandwidth, plan.strategies))
                    print(json.dumps({k: v for k, v in results[-1].items() if k != "runs"}),
                          file=sys.stderr, flush=True)  # fmt: skip
        if args.keep:
            shutil.copytree(work, args.out / "work", dirs_exist_ok=True)
        params = _parameter_count(args.model, data)
        seq_length = _seq_length(data)
    return results, params, seq_length


def _summary(
    args: argparse.Namespace, plan: SweepPlan, results: list[dict], params: int, seq_length: int
) -> dict:
    """The benchmark's JSON: settings, the why-communication-bound note, the whole-run
    reduction (when LAMB and 1-bit LAMB were both measured) and the result rows."""
    threads = results[0]["threads_per_rank"]
    large = 2 * BERT_LARGE_PARAMS * 4 * 8 / 10e9  # seconds of ring all-reduce at 10 Gbit/s
    summary = {
        "model": args.model,
        "parameters": params,
        "seq_length": seq_length,
        "batch_per_rank": args.batch,
        "micro_batch": min(args.micro_batch, args.batch),
        "freeze_step": args.freeze_step,
        "strategies": plan.strategies,
        "outer_every": args.outer_every,
        "topologies": args.topologies.split(","),
        "mtu": args.mtu,
        "why_communication_bound": WHY_COMM_BOUND.format(
            large=large,
            large_1g=large * 10,
            model=args.model,
            params=params / 1e6,
            grad_mb=params * 4 / 1e6,
            batch=args.batch,
            seq_length=seq_length,
            threads=threads,
        ),
    }
    if {"lamb", "onebit_lamb"} <= set(plan.strategies):
        summary["whole_run"] = {
            str(r["world_size"]): whole_run_reduction(r, args.whole_run_config, *plan.run_steps)
            for r in results
            if r["bandwidth_mbit"] == plan.bandwidths[0]
        }
    summary["results"] = results
    return summary


def main(argv=None) -> dict:
    """``python -m bench.netem``: run the sweep, write ``netem.json`` and ``netem.png`` to
    ``--out`` and print the summary as the last line."""
    parser = _parser()
    args = parser.parse_args(argv)
    plan = _plan(parser, args)

    _terminate_on_sigterm()
    remove_stale_clusters()
    results, params, seq_length = _sweep(args, plan)
    summary = _summary(args, plan, results, params, seq_length)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "netem.png")
    summary["plot"] = str(args.out / "netem.png")
    from onebit_bert.io import atomic_write_json

    atomic_write_json(args.out / "netem.json", summary)
    print(json.dumps(summary))
    return summary


def _seq_length(data: Path) -> int:
    from onebit_bert.shards import PretrainingShards

    return PretrainingShards(data, "train").seq_length


def _parameter_count(preset: str, data: Path) -> int:
    from transformers import AutoTokenizer

    from onebit_bert.shards import PretrainingShards
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    tokenizer = AutoTokenizer.from_pretrained(PretrainingShards(data, "train").tokenizer_dir)
    model = build_model(ModelConfig(preset=preset), len(tokenizer), tokenizer.pad_token_id)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
