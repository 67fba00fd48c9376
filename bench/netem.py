"""LAMB vs 1-bit LAMB pretraining on an emulated low-bandwidth cluster (namespaces + tc).

Builds an N-host cluster on this machine: one network namespace per host, each joined to a
bridge by a veth pair (host side ``<tag>h<i>``, namespace side ``eth0``, addresses
198.18.0.0/24), with an htb rate limit on BOTH directions of every link (see
:mod:`bench.netem_cluster`). Then runs the real pretraining stage (``python -m pretrain``),
one gloo process per host, three ways:

* LAMB (the gradient all-reduce every step);
* 1-bit LAMB: ``freeze_step`` full-precision warmup steps, then the compression stage;
* compute-only: the same per-rank work (model, micro-batch, a LAMB update) in N independent
  single-process runs started together, so they share the CPU exactly as the N ranks do but
  never communicate: the upper limit of samples/s.

Step times and bytes come from the stage's own metrics (rank 0): ``comm_bytes`` is what the
communicator handed to gloo, ``net_tx_bytes`` what rank 0's eth0 sent in the same step window
(``logging.net_interface``). Links are reshaped between bandwidths; the namespaces are
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


def summarize(records: list[dict], batch: int) -> dict:
    """Medians over the given step records (robust to a slow first step or a hiccup)."""
    if not records:
        raise RuntimeError("no step records to summarize (increase --steps)")

    def med(key):
        values = [r[key] for r in records if key in r]
        return statistics.median(values) if values else None

    step = med("step_seconds")
    return {
        "steps": len(records),
        "step_seconds": step,
        "samples_per_s": batch / step,
        "forward_backward_seconds": med("forward_backward_seconds"),
        "comm_seconds": med("comm_seconds"),
        "comm_fraction": statistics.median(r["comm_seconds"] / r["step_seconds"] for r in records),
        "counted_bytes_per_step": med("comm_bytes"),
        "wire_bytes_per_step": med("net_tx_bytes"),
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

    def config(self, name: str, optimizer: str, steps: int, rank: int | None = None) -> Path:
        """Write the pretraining config ``<name>[rank].yaml`` and return its run folder. With
        ``rank``: a single-process run of one rank's batch; without: the distributed run of
        the global batch, with ``eth0``'s sent bytes logged."""
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


def _measure_lamb(point: SweepPoint) -> dict:
    args = point.args
    warm = args.warmup_steps
    lamb_dir = point.config("lamb", "lamb", warm + args.steps)
    point.run_distributed("lamb")
    return summarize(step_records(lamb_dir)[warm:], point.batch)


def _measure_onebit(point: SweepPoint) -> tuple[dict, dict]:
    """The warmup stage's and the compression stage's summaries (first step of each
    skipped)."""
    args = point.args
    onebit_dir = point.config("onebit", "onebit_lamb", args.freeze_step + 1 + args.steps)
    point.run_distributed("onebit")
    records = step_records(onebit_dir)
    warmup_records = [r for r in records if r["stage"] == "warmup"][1:]
    compression_records = [r for r in records if r["stage"] == "compression"][1:]
    return summarize(warmup_records, point.batch), summarize(compression_records, point.batch)


def _measure_compute_only(point: SweepPoint) -> float:
    """Samples/s of the compute-only runs, summed over the hosts."""
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
    return sum(p["samples_per_s"] for p in per_process)


def _bytes_per_step(run: dict) -> dict:
    """Wire and counted bytes per step, and their ratio (None when either is missing)."""
    wire, counted = run["wire_bytes_per_step"], run["counted_bytes_per_step"]
    return {
        "wire": wire,
        "counted": counted,
        "wire_over_counted": wire / counted if wire and counted else None,
    }


def measure(
    cluster: Cluster,
    data: Path,
    work: Path,
    args: argparse.Namespace,
    bandwidth: float,
) -> dict:
    """Shape ``cluster`` to ``bandwidth`` Mbit/s and measure LAMB, 1-bit LAMB and the
    compute-only runs there: one result row."""
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
    lamb = _measure_lamb(point)
    onebit_warmup, onebit = _measure_onebit(point)
    compute_only = _measure_compute_only(point)
    return {
        "bandwidth_mbit": bandwidth,
        "world_size": world,
        "threads_per_rank": point.threads,
        "global_batch": point.batch,
        "lamb_samples_per_s": lamb["samples_per_s"],
        "onebit_warmup_samples_per_s": onebit_warmup["samples_per_s"],
        "onebit_samples_per_s": onebit["samples_per_s"],
        "compute_only_samples_per_s": compute_only,
        "lamb_comm_fraction": lamb["comm_fraction"],
        "onebit_comm_fraction": onebit["comm_fraction"],
        "speedup": onebit["samples_per_s"] / lamb["samples_per_s"],
        "onebit_vs_compute_only": onebit["samples_per_s"] / compute_only,
        "lamb_bytes_per_step": _bytes_per_step(lamb),
        "onebit_warmup_bytes_per_step": _bytes_per_step(onebit_warmup),
        "onebit_bytes_per_step": _bytes_per_step(onebit),
        "bytes_ratio": lamb["wire_bytes_per_step"] / onebit["wire_bytes_per_step"],
        "counted_bytes_ratio": lamb["counted_bytes_per_step"] / onebit["counted_bytes_per_step"],
        "runs": {"lamb": lamb, "onebit_warmup": onebit_warmup, "onebit": onebit},
    }


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
    mbit = row["bandwidth_mbit"]
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world_size"] for r in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4.8), squeeze=False)
    series = [
        ("lamb_samples_per_s", "LAMB"),
        ("onebit_warmup_samples_per_s", "1-bit LAMB warmup"),
        ("onebit_samples_per_s", "1-bit LAMB compression"),
        ("compute_only_samples_per_s", "compute only"),
    ]
    for ax, world in zip(axes[0], worlds, strict=True):
        rows = sorted((r for r in results if r["world_size"] == world),
                      key=lambda r: r["bandwidth_mbit"])  # fmt: skip
        width = 0.8 / len(series)
        for k, (key, label) in enumerate(series):
            xs = [i + (k - 1.5) * width for i in range(len(rows))]
            ax.bar(xs, [r[key] for r in rows], width, label=label)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(
            [
                _bandwidth_label(r) + f"\nLAMB comm {r['lamb_comm_fraction']:.0%}"
                f"\n1-bit {r['speedup']:.1f}x"
                for r in rows
            ],  # fmt: skip
            fontsize=8,
        )
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
    data_root: Path | None  # None when --data names prepared shards
    run_steps: tuple[int, int]


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SweepPlan:
    """Check the arguments, root and the data; exits through ``parser`` on a problem."""
    bandwidths = [float(b) for b in args.bandwidths.split(",")]
    worlds = [int(w) for w in args.world_sizes.split(",")]
    if min(worlds) < 2 or max(worlds) > 250:
        parser.error("--world-sizes: each between 2 and 250")
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
    return SweepPlan(bandwidths, worlds, data_root, run_steps)


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
                    results.append(measure(cluster, data, work, args, bandwidth))
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
    threads = results[0]["threads_per_rank"]
    large = 2 * BERT_LARGE_PARAMS * 4 * 8 / 10e9  # seconds of ring all-reduce at 10 Gbit/s
    return {
        "model": args.model,
        "parameters": params,
        "seq_length": seq_length,
        "batch_per_rank": args.batch,
        "micro_batch": min(args.micro_batch, args.batch),
        "freeze_step": args.freeze_step,
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
        "whole_run": {
            str(r["world_size"]): whole_run_reduction(r, args.whole_run_config, *plan.run_steps)
            for r in results
            if r["bandwidth_mbit"] == plan.bandwidths[0]
        },
        "results": results,
    }


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
