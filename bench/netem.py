"""LAMB vs 1-bit LAMB pretraining on an emulated low-bandwidth cluster (namespaces + tc).

Builds an N-host cluster on this machine: one network namespace per host, each joined to a
bridge by a veth pair (host side ``<tag>h<i>``, namespace side ``eth0``, addresses
198.18.0.0/24), with an htb rate limit on BOTH directions of every link. Then runs the real
pretraining stage (``python -m pretrain``), one gloo process per host, three ways:

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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import prepare_wikipedia_seq128, pretrain_config, shared_data_error

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SUBNET = "198.18.0"
MASTER_PORT = 29500
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


# ----------------------------------------------------------------------------- the cluster


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_clusters(prefix: str = "obn") -> list[str]:
    """Delete namespaces and bridges left by a benchmark process that no longer exists
    (names carry the creating pid: ``obn<pid>...``)."""
    removed = []
    names = _ip("netns", "list", check=False).stdout.split()
    links = _ip("-o", "link", "show", check=False).stdout.splitlines()
    link_names = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
    for name in [n for n in names if n.startswith(prefix)] + [
        n for n in link_names if n.startswith(prefix) and n.endswith("br")
    ]:
        digits = name[len(prefix) :].split("h")[0].split("br")[0]
        if digits.isdigit() and not _pid_alive(int(digits)):
            if name.endswith("br"):
                _ip("link", "del", name, check=False)
            else:
                _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Cluster:
    """``hosts`` namespaces on one bridge; every link shaped in both directions."""

    hosts: int
    mtu: int = 9000
    prefix: str = "obn"

    def __post_init__(self):
        tag = f"{self.prefix}{os.getpid()}"
        self.bridge = f"{tag}br"
        self.namespaces = [f"{tag}h{i}" for i in range(self.hosts)]
        self.veths = [f"{tag}h{i}" for i in range(self.hosts)]  # host-side ends
        if any(len(v) > 15 for v in self.veths + [self.bridge]):
            raise ValueError("interface names too long; use a shorter prefix")
        self.rate_mbit: float | None = None

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Cluster:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "mtu", str(self.mtu), "up")
            for i, (ns, veth) in enumerate(zip(self.namespaces, self.veths, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", veth, "mtu", str(self.mtu), "type", "veth", "peer", "name",
                    "eth0", "mtu", str(self.mtu), "netns", ns)  # fmt: skip
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _links(self):
        for ns, veth in zip(self.namespaces, self.veths, strict=True):
            yield [], veth  # bridge -> host direction
            yield ["ip", "netns", "exec", ns], "eth0"  # host -> bridge direction

    def shape(self, rate_mbit: float) -> None:
        """Limit every link, both directions, to ``rate_mbit`` Mbit/s (htb)."""
        rate = f"{rate_mbit:g}mbit"
        for prefix, dev in self._links():
            if self.rate_mbit is None:  # htb cannot be replaced in place: add it once
                _run([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                      "default", "10"])  # fmt: skip
            _run([*prefix, "tc", "class", "replace", "dev", dev, "parent", "1:", "classid",
                  "1:10", "htb", "rate", rate, "ceil", rate, "burst", "512kb", "cburst", "512kb",
                  "quantum", "200000"])  # fmt: skip
        self.rate_mbit = rate_mbit

    def cleanup(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its veth pair with it
        _ip("link", "del", self.bridge, check=False)

    def prefix_for(self, i: int) -> list[str]:
        """Run in host ``i``'s namespace, pinned to core ``i mod cores`` (ranks of one run
        then share the cores evenly and do not migrate: steadier step times)."""
        cores = sorted(os.sched_getaffinity(0))
        pin = ["taskset", "-c", str(cores[i % len(cores)])] if shutil.which("taskset") else []
        return ["ip", "netns", "exec", self.namespaces[i], *pin]


def check_privileges() -> str | None:
    """Why the cluster cannot be built here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building network namespaces and tc rate limits needs root: run it as root"
    for tool in ("ip", "tc"):
        if _run(["sh", "-c", f"command -v {tool}"], check=False).returncode != 0:
            return f"`{tool}` is missing: install iproute2"
    probe = f"obnprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


# ----------------------------------------------------------------------------- the runs


def _launch(cmds: list[list[str]], envs: list[dict], logs: Path, timeout: float) -> None:
    """Start every command, wait for all; on a failure stop the others and raise."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            out = open(logs / f"proc{i}.log", "wb")  # noqa: SIM115 (closed below)
            procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out), out))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in procs):
            failed = [i for i, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                i = failed[0]
                tail = (logs / f"proc{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"process {i} ({' '.join(cmds[i][-4:])}) failed:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run did not finish within {timeout:.0f} s (logs: {logs})")
            time.sleep(0.2)
        for i, (p, _) in enumerate(procs):
            if p.returncode != 0:
                tail = (logs / f"proc{i}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"process {i} failed:\n{tail}")
    finally:
        for p, out in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()


def _env(threads: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_distributed(cluster: Cluster, cfg_path: Path, logs: Path, threads: int, timeout: float):
    world = cluster.hosts
    cmds, envs = [], []
    for i in range(world):
        cmds.append([*cluster.prefix_for(i), sys.executable, "-m", "pretrain", "--config",
                     str(cfg_path)])  # fmt: skip
        envs.append(
            _env(
                threads,
                RANK=str(i),
                WORLD_SIZE=str(world),
                LOCAL_RANK="0",
                MASTER_ADDR=cluster.address(0),
                MASTER_PORT=str(MASTER_PORT),
                GLOO_SOCKET_IFNAME="eth0",
            )
        )
    _launch(cmds, envs, logs, timeout)


def run_compute_only(cluster: Cluster, cfg_paths: list[Path], logs: Path, threads: int, timeout):
    cmds = [
        [*cluster.prefix_for(i), sys.executable, "-m", "pretrain", "--config", str(path)]
        for i, path in enumerate(cfg_paths)
    ]
    _launch(cmds, [_env(threads) for _ in cmds], logs, timeout)


def step_records(run_dir: Path) -> list[dict]:
    from onebit_bert.metrics_log import read_metrics

    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "step_seconds" in r]


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


def measure(
    cluster: Cluster,
    data: Path,
    work: Path,
    args: argparse.Namespace,
    bandwidth: float,
) -> dict:
    world = cluster.hosts
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    batch = args.batch * world
    tag = f"{bandwidth:g}mbit_p{world}"
    cluster.shape(bandwidth)
    timeout = args.run_timeout

    def config(name: str, optimizer: str, steps: int, per_rank: bool = False, i: int = 0) -> Path:
        from onebit_bert.config import from_dict, save_config
        from pretrain.config import PretrainConfig

        run_dir = work / tag / (f"{name}{i}" if per_rank else name)
        cfg = from_dict(
            PretrainConfig,
            pretrain_config(
                data,
                run_dir,
                optimizer,
                model=args.model,
                batch=args.batch if per_rank else batch,
                micro=min(args.micro_batch, args.batch),
                steps=steps,
                freeze_step=args.freeze_step,
                stop_after=steps,
                net_interface=None if per_rank else "eth0",
            ),
        )
        path = work / tag / f"{name}{i if per_rank else ''}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, path)
        return run_dir

    warm = args.warmup_steps
    lamb_dir = config("lamb", "lamb", warm + args.steps)
    run_distributed(cluster, work / tag / "lamb.yaml", work / tag / "logs_lamb", threads, timeout)
    lamb = summarize(step_records(lamb_dir)[warm:], batch)

    onebit_steps = args.freeze_step + 1 + args.steps
    onebit_dir = config("onebit", "onebit_lamb", onebit_steps)
    run_distributed(
        cluster, work / tag / "onebit.yaml", work / tag / "logs_onebit", threads, timeout
    )
    records = step_records(onebit_dir)
    warmup_records = [r for r in records if r["stage"] == "warmup"][1:]
    compression_records = [r for r in records if r["stage"] == "compression"][1:]
    onebit_warmup = summarize(warmup_records, batch)
    onebit = summarize(compression_records, batch)

    compute_dirs = [config("compute", "lamb", warm + args.steps, True, i) for i in range(world)]
    run_compute_only(
        cluster,
        [work / tag / f"compute{i}.yaml" for i in range(world)],
        work / tag / "logs_compute",
        threads,
        timeout,
    )
    per_process = [summarize(step_records(d)[warm:], args.batch) for d in compute_dirs]
    compute_only = sum(p["samples_per_s"] for p in per_process)

    def agreement(run: dict) -> float | None:
        if not run["wire_bytes_per_step"] or not run["counted_bytes_per_step"]:
            return None
        return run["wire_bytes_per_step"] / run["counted_bytes_per_step"]

    return {
        "bandwidth_mbit": bandwidth,
        "world_size": world,
        "threads_per_rank": threads,
        "global_batch": batch,
        "lamb_samples_per_s": lamb["samples_per_s"],
        "onebit_warmup_samples_per_s": onebit_warmup["samples_per_s"],
        "onebit_samples_per_s": onebit["samples_per_s"],
        "compute_only_samples_per_s": compute_only,
        "lamb_comm_fraction": lamb["comm_fraction"],
        "onebit_comm_fraction": onebit["comm_fraction"],
        "speedup": onebit["samples_per_s"] / lamb["samples_per_s"],
        "onebit_vs_compute_only": onebit["samples_per_s"] / compute_only,
        "lamb_bytes_per_step": {
            "wire": lamb["wire_bytes_per_step"],
            "counted": lamb["counted_bytes_per_step"],
            "wire_over_counted": agreement(lamb),
        },
        "onebit_warmup_bytes_per_step": {
            "wire": onebit_warmup["wire_bytes_per_step"],
            "counted": onebit_warmup["counted_bytes_per_step"],
            "wire_over_counted": agreement(onebit_warmup),
        },
        "onebit_bytes_per_step": {
            "wire": onebit["wire_bytes_per_step"],
            "counted": onebit["counted_bytes_per_step"],
            "wire_over_counted": agreement(onebit),
        },
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


def main(argv=None) -> dict:
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
    args = parser.parse_args(argv)
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

    _terminate_on_sigterm()
    remove_stale_clusters()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_netem_") as tmp:
        work = Path(tmp)
        data = args.data or prepare_wikipedia_seq128(data_root, work / "data")
        for world in worlds:
            with Cluster(world, mtu=args.mtu) as cluster:
                for bandwidth in bandwidths:
                    results.append(measure(cluster, data, work, args, bandwidth))
                    print(json.dumps({k: v for k, v in results[-1].items() if k != "runs"}),
                          file=sys.stderr, flush=True)  # fmt: skip
        if args.keep:
            shutil.copytree(work, args.out / "work", dirs_exist_ok=True)
        params = _parameter_count(args.model, data)
        seq_length = _seq_length(data)

    threads = results[0]["threads_per_rank"]
    large = 2 * BERT_LARGE_PARAMS * 4 * 8 / 10e9  # seconds of ring all-reduce at 10 Gbit/s
    summary = {
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
            str(r["world_size"]): whole_run_reduction(r, args.whole_run_config, *run_steps)
            for r in results
            if r["bandwidth_mbit"] == bandwidths[0]
        },
        "results": results,
    }
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
