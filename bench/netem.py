"""Pretraining strategies on an emulated low-bandwidth cluster (namespaces + tc).

Builds an N-host cluster on this machine: one network namespace per host, each joined to a
bridge by a veth pair (host side ``<tag>h<i>``, namespace side ``eth0``, addresses
198.18.0.0/24), with an htb rate limit on BOTH directions of every link (see
:mod:`bench.netem_cluster`). Then runs the real pretraining stage (``python -m pretrain``),
one gloo process per host, once per recipe of ``--strategies`` (registered recipes,
:mod:`onebit_bert.recipes`; default ``lamb,onebit_lamb``), by the recipe's ``measure``:

* lamb, adamw: the gradient all-reduce every step (medians after ``--warmup-steps``);
* onebit_lamb, onebit_adam: ``freeze_step`` full-precision warmup steps, then the
  compression stage (medians of each stage, its first step skipped);
* zero_one_adam: a shortened 0/1 Adam schedule that passes through all its kinds of step
  (full-precision variance steps, 1-bit gradient steps, local steps, 1-bit syncs;
  :data:`ZERO_ONE_ADAM_BENCH`): the medians of each kind, and the means over the measured
  steps;
* co2, slowmo, local_sgd (LAMB steps on each rank, LAMB's learning rate), diloco,
  streaming_diloco (AdamW steps): one parameter all-reduce every ``--outer-every`` (tau)
  steps, CO2's in the background during the next round, Streaming DiLoCo's one fragment
  at a time overlapped with the next inner step. Means over whole rounds, the first two
  skipped (round 0 has nothing in flight, round 1's end is the first wait): a median would
  hide the one step per round that sends (:func:`round_summary`);
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

``--repeats R`` measures the whole sweep R times over, interleaved: every repeat visits
every bandwidth and measures every recipe there, in the listed order on even repeats and in
reverse on odd ones, so a drift of the machine's speed during the sweep falls on every
recipe alike. Each result row carries its ``repeat`` (0, 1, ...); reports average a point's
repeats and keep their spread (:func:`pipeline.reports.timing.combine_repeats`). The
summary's ``sweep_id`` names this invocation, so a report can say that its speeds come from
one sweep.

A sweep resumes: after each measured (world size, repeat, bandwidth) row, the rows so far
are written to ``--out``/``netem.partial.json``. Run the same command again after a stop,
and it keeps those rows and their sweep id and measures only the rest (a partial sweep of
other settings is refused). Each row records when (``measured_at``, UTC) and on which host
it was measured, and the summary how many rows came from an earlier invocation
(``resumed_rows``): rows measured on another machine are not interleaved with the others.

Prints one JSON object as its last line and writes it, with a PNG plot, to ``--out``.
Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, add_data_root, prepare_wikipedia_seq128, shared_data_root
from bench.netem_cluster import Cluster, check_privileges, remove_stale_clusters
from bench.netem_runs import (  # noqa: F401 (re-exported: the benchmark's public pieces)
    DEFAULT_TOPOLOGIES,
    MEASURE,
    STRATEGIES,
    _bytes_per_step,
    local_steps_total,
    measure,
    result_row,
    round_summary,
    round_window,
    step_records,
    summarize,
)
from onebit_bert.distributed.codecs import CODECS, accepted_codecs
from onebit_bert.recipes import RECIPES, get_recipe

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


def hybrid_codecs() -> tuple[str, ...]:
    """The codecs ``--hybrid-codec`` accepts: every lossy codec gradients may travel with
    (the codec registry's entries)."""
    return tuple(name for name in accepted_codecs("grad") if CODECS[name].lossy)


def whole_run_steps(config: Path) -> tuple[int, int]:
    """``config``'s (max_steps, freeze_step): a BERT-Large 1-bit LAMB pretraining config."""
    from onebit_bert.config import load_config
    from pretrain.config import PretrainConfig

    cfg = load_config(PretrainConfig, config)
    return cfg.schedule.max_steps, cfg.optimizer.freeze_step


def whole_run_reduction(
    result: dict, config: Path, steps: int, freeze: int, onebit: str = "onebit_lamb"
) -> dict:
    """Communication of a whole run of ``steps`` steps with LAMB over that with ``onebit``
    (1-bit LAMB or hybrid 1-bit LAMB) frozen after ``freeze`` steps, from the measured wire
    bytes per step of each stage."""
    runs = result["runs"]
    lamb = runs["lamb"]["wire_bytes_per_step"]
    warm = runs[onebit]["warmup"]["wire_bytes_per_step"]
    comp = runs[onebit]["wire_bytes_per_step"]
    return {
        "config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
        "strategy": onebit,
        "max_steps": steps,
        "freeze_step": freeze,
        "lamb_bytes_per_step": lamb,
        "warmup_bytes_per_step": warm,
        "compression_bytes_per_step": comp,
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


TOPOLOGY_LABELS = {"one_peer_exponential": "one-peer exp.", "ring": "ring", "exponential": "exp."}


def plot_series(row: dict) -> list[tuple[str, tuple[str, ...]]]:
    """The bars of one row, in the order measured: (label, key path into the row); 1-bit
    LAMB as its warmup and its compression stage, compute-only last."""
    series = []
    for name, run in row["runs"].items():
        if "warmup" in run:
            label = f"{get_recipe(name).label} warmup"
            series.append((label, ("runs", name, "warmup", "samples_per_s")))
        strategy, _, topology = name.partition("/")
        recipe = get_recipe(strategy)
        label = recipe.label + (" compression" if recipe.measure == "onebit" else "")
        if topology:
            label += f" ({TOPOLOGY_LABELS.get(topology, topology)})"
        if "outer_every" in run:
            label += f" (tau {run['outer_every']})"
        if run.get("inner_optimizer", recipe.optimizer) != recipe.optimizer:
            label += f" ({run['inner_optimizer']} inside)"
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
    add_data_root(parser)
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
        default=str(DEFAULT_OUTER_EVERY),
        help="tau of the local-step strategies: local steps per round, one parameter "
        "all-reduce per round; TAU for all, or TAU,RECIPE=TAU,... to give recipes their "
        "own (each its tuned setting, e.g. 4,streaming_diloco_node=12)",
    )
    parser.add_argument(
        "--inner",
        default="",
        help="the inner optimizer of local-step recipes whose optimizer is open (co2_node, "
        "slowmo_node): RECIPE=OPTIMIZER,... to measure each with its tuned one (e.g. "
        "slowmo_node=adamw); default: the recipe's own",
    )
    parser.add_argument(
        "--topologies",
        default=DEFAULT_TOPOLOGIES,
        help="graphs of decentlam and dmsgd, comma list of one_peer_exponential, ring, "
        "exponential, full (one run of each strategy per graph)",
    )
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks in each emulated host (--world-sizes counts ranks); with more than one, "
        "ranks of a host talk over its loopback and only inter-host traffic is shaped",
    )
    parser.add_argument(
        "--hybrid-codec",
        default="int8",
        help="hybrid_onebit_lamb: the codec of its warmup gradients (a lossy gradient codec: "
        f"{', '.join(hybrid_codecs())})",
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=4.0, help="onebit_lamb_overlap: momentum buckets"
    )
    parser.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: its rank")
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--batch", type=int, default=64, help="sequences per rank per step")
    parser.add_argument(
        "--micro-batch", type=int, default=32, help="per forward/backward (accumulation)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the whole sweep this many times, interleaved (every repeat visits every "
        "bandwidth and recipe; odd repeats take the recipes in reverse order)",
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


def parse_outer_every(text: str) -> tuple[int, dict[str, int]]:
    """``TAU[,RECIPE=TAU,...]`` -> (the default tau, per-recipe taus); each tau >= 1."""
    default, by_recipe = None, {}
    for part in (p.strip() for p in str(text).split(",")):
        name, _, value = part.rpartition("=")
        try:
            tau = int(value)
        except ValueError:
            raise ValueError(f"{part!r} is not TAU or RECIPE=TAU") from None
        if tau < 1:
            raise ValueError("each tau must be >= 1")
        if not name:
            if default is not None:
                raise ValueError("one default TAU only")
            default = tau
        elif name in by_recipe:
            raise ValueError(f"{name} given twice")
        else:
            by_recipe[name] = tau
    return (DEFAULT_OUTER_EVERY if default is None else default), by_recipe


def parse_inner(text: str) -> dict[str, str]:
    """``RECIPE=OPTIMIZER[,...]`` -> {recipe: optimizer}; each recipe's optimizer must be
    open (``optimizer.name`` among its ``open_fields``) and one its search space offers."""
    inner: dict[str, str] = {}
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        name, sep, optimizer = part.partition("=")
        if not sep or not name or not optimizer:
            raise ValueError(f"{part!r} is not RECIPE=OPTIMIZER")
        if name in inner:
            raise ValueError(f"{name} given twice")
        recipe = RECIPES.get(name, None)
        if recipe is None or "optimizer.name" not in recipe.open_fields:
            open_ones = sorted(n for n, r in RECIPES.items() if "optimizer.name" in r.open_fields)
            raise ValueError(
                f"{name}: not a recipe whose inner optimizer is open (those are "
                f"{', '.join(open_ones)})"
            )
        offered = recipe.searched("optimizer.name")
        if optimizer not in offered:
            raise ValueError(f"{name}={optimizer}: its search space offers {', '.join(offered)}")
        inner[name] = optimizer
    return inner


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
    if any(RECIPES[n].node_hierarchy for n in names) and args.ranks_per_host < 2:
        parser.error("--strategies: the *_node strategies need --ranks-per-host 2 or more")
    if args.hybrid_codec not in hybrid_codecs():
        parser.error(f"--hybrid-codec: one of {', '.join(hybrid_codecs())}")
    try:
        args.outer_every, args.outer_every_by_recipe = parse_outer_every(args.outer_every)
    except ValueError as error:
        parser.error(f"--outer-every: {error}")
    unused = sorted(set(args.outer_every_by_recipe) - set(names))
    if unused:
        parser.error(f"--outer-every: {', '.join(unused)} not in --strategies")
    try:
        args.inner_by_recipe = parse_inner(args.inner)
    except ValueError as error:
        parser.error(f"--inner: {error}")
    unused = sorted(set(args.inner_by_recipe) - set(names))
    if unused:
        parser.error(f"--inner: {', '.join(unused)} not in --strategies")
    if any(RECIPES[n].measure == "decentralized" for n in names):
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
    if args.ranks_per_host < 1 or any(w % args.ranks_per_host for w in worlds):
        parser.error("--ranks-per-host must divide every world size")
    if any(RECIPES[n].measure == "decentralized" for n in strategies):
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
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.freeze_step < 2 or args.steps < 1 or args.warmup_steps < 0:
        parser.error("need --freeze-step >= 2 (one warmup step is skipped) and --steps >= 1")
    reason = check_privileges()
    if reason:
        parser.exit(2, f"bench.netem: {reason}\n")
    data_root = None
    if args.data is None:
        data_root = shared_data_root(parser, args)
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


def repeat_order(strategies: list[str], repeat: int) -> list[str]:
    """The order ``repeat`` measures the recipes in at each point: as listed on even
    repeats, reversed on odd ones."""
    return list(strategies) if repeat % 2 == 0 else list(reversed(strategies))


def new_sweep_id() -> str:
    """A name for one invocation: its UTC start time and a random suffix."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


PARTIAL = "netem.partial.json"
# what does not change a measurement: where it goes, and what the sweep is called
_NOT_SETTINGS = ("out", "keep", "sweep_id")


def sweep_settings(args: argparse.Namespace) -> dict:
    """The arguments that decide what a sweep measures (all but ``--out``/``--keep``), as
    JSON values: a partial sweep resumes only under the same ones."""
    return {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in sorted(vars(args).items())
        if k not in _NOT_SETTINGS
    }


def load_partial(args: argparse.Namespace) -> dict | None:
    """The rows an interrupted invocation with the same settings left in ``--out``
    (:data:`PARTIAL`, written after each measured row), with its sweep id; None when there
    is none. One left by other settings is refused: resuming it would mix two sweeps."""
    path = Path(args.out) / PARTIAL
    if not path.is_file():
        return None
    try:
        partial = json.loads(path.read_text())
        rows, sweep_id, settings = partial["rows"], partial["sweep_id"], partial["settings"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path}: unreadable partial sweep ({err}); delete it to start again"
        ) from err
    now = json.loads(json.dumps(sweep_settings(args)))
    if settings != now:
        differ = sorted(k for k in set(settings) | set(now) if settings.get(k) != now.get(k))
        raise ValueError(
            f"{path}: a partial sweep of other settings ({', '.join(differ)}); run it again "
            "with the same arguments to resume it, or give another --out (or delete the file) "
            "to start a new sweep"
        )
    return {"rows": rows, "sweep_id": sweep_id}


def _sweep(args: argparse.Namespace, plan: SweepPlan,
           done: list[dict] | None = None) -> tuple[list[dict], int, int]:  # fmt: skip
    """Measure every (world size, bandwidth) point ``--repeats`` times in a temporary folder;
    returns the result rows (with their ``repeat`` where there are several), the model's
    parameter count and the sequence length. ``done``: rows an interrupted invocation
    measured (:func:`load_partial`), kept and not measured again. After each row, every row
    so far is written to ``--out``/:data:`PARTIAL`, so that a stop loses one row at most."""
    from onebit_bert.io import atomic_write_json

    results = list(done or [])
    measured = {(r["world_size"], r.get("repeat", 0), r["bandwidth_mbit"]) for r in results}
    repeats = getattr(args, "repeats", 1)
    partial = Path(args.out) / PARTIAL
    with tempfile.TemporaryDirectory(prefix="bench_netem_") as tmp:
        work = Path(tmp)
        data = args.data or prepare_wikipedia_seq128(plan.data_root, work / "data")
        for world in plan.worlds:
            todo = [
                (repeat, bandwidth)
                for repeat in range(repeats)
                for bandwidth in plan.bandwidths
                if (world, repeat, bandwidth) not in measured
            ]
            if not todo:
                continue
            with Cluster(world // args.ranks_per_host, mtu=args.mtu) as cluster:
                for repeat, bandwidth in todo:
                    order = repeat_order(plan.strategies, repeat)
                    row = measure(cluster, data, work, args, bandwidth, order, repeat)
                    row["runs"] = {k: row["runs"][k] for k in _listed(row["runs"], plan)}
                    if repeats > 1:
                        row["repeat"] = repeat
                    row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                    row["host"] = os.uname().nodename
                    results.append(row)
                    partial.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write_json(partial, {"sweep_id": args.sweep_id,
                                                "settings": sweep_settings(args),
                                                "rows": results})  # fmt: skip
                    print(json.dumps({k: v for k, v in row.items() if k != "runs"}),
                          file=sys.stderr, flush=True)  # fmt: skip
        if args.keep:
            shutil.copytree(work, args.out / "work", dirs_exist_ok=True)
        params = _parameter_count(args.model, data)
        seq_length = _seq_length(data)
    return results, params, seq_length


def _listed(runs: dict, plan: SweepPlan) -> list[str]:
    """The keys of one row's ``runs`` in the order of ``--strategies`` (a recipe measured on
    several graphs keeps its graphs' order), whatever order they were measured in."""
    rank = {name: i for i, name in enumerate(plan.strategies)}
    return sorted(runs, key=lambda k: rank.get(k.partition("/")[0], len(rank)))


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
        "ranks_per_host": args.ranks_per_host,
        "hybrid_codec": args.hybrid_codec,
        "outer_every": args.outer_every,
        "outer_every_by_recipe": args.outer_every_by_recipe or None,
        "inner_by_recipe": getattr(args, "inner_by_recipe", None) or None,
        "topologies": args.topologies.split(","),
        "mtu": args.mtu,
        "sweep_id": args.sweep_id,
        "repeats": args.repeats,
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
    from pipeline.reports.timing import combine_repeats

    combined = combine_repeats(results)
    first = [r for r in combined if r["bandwidth_mbit"] == plan.bandwidths[0]]
    for name, key in (("onebit_lamb", "whole_run"), ("hybrid_onebit_lamb", "whole_run_hybrid")):
        if {"lamb", name} <= set(plan.strategies):
            summary[key] = {
                str(r["world_size"]): whole_run_reduction(
                    r, args.whole_run_config, *plan.run_steps, onebit=name
                )
                for r in first
            }
    summary["results"] = results
    return summary


def main(argv=None) -> dict:
    """``python -m bench.netem``: run the sweep, write ``netem.json`` and ``netem.png`` to
    ``--out`` and print the summary as the last line."""
    parser = _parser()
    args = parser.parse_args(argv)
    plan = _plan(parser, args)

    try:
        resumed = load_partial(args)
    except ValueError as err:
        parser.error(str(err))
    _terminate_on_sigterm()
    remove_stale_clusters()
    args.sweep_id = resumed["sweep_id"] if resumed else new_sweep_id()
    results, params, seq_length = _sweep(args, plan, resumed["rows"] if resumed else None)
    summary = _summary(args, plan, results, params, seq_length)
    summary["resumed_rows"] = len(resumed["rows"]) if resumed else 0
    args.out.mkdir(parents=True, exist_ok=True)
    from pipeline.reports.timing import combine_repeats

    plot(combine_repeats(results), args.out / "netem.png")
    summary["plot"] = str(args.out / "netem.png")
    from onebit_bert.io import atomic_write_json

    atomic_write_json(args.out / "netem.json", summary)
    (args.out / PARTIAL).unlink(missing_ok=True)
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
