"""Golden trajectories: short fixed pretraining runs whose losses and final weights must
not change by a single bit when the training loop or the strategies are refactored.

``python -m tests.helpers.golden --write`` records them (``tests/golden/trajectories.json``) from
the code as it is; ``tests/test_golden.py`` reruns every run and compares. Record again
only for a change that is meant to alter numerics (and say so in the commit), or on a
platform whose floating-point kernels differ from the one that recorded them.

Each run: bert-tiny on the generated test corpus, 2 gloo ranks, 2 micro-batches per rank
per step (accumulation), dropout on, validation every 4 steps.

CPU kernels round differently by instruction set: on an AVX-512 machine ATen's vectorised
kernels and MKL's sgemm take other code paths than on an AVX2 one, and the first forward
pass already differs in its last bits. The ranks therefore run with the instruction set
pinned (:data:`PINNED_ISA`: ATen's dispatch, MKL's conditional numerical reproducibility
branch, oneDNN's ISA cap). That gives the same bits on the AVX2 and AVX-512 machines the
trajectories were first checked on, but not on every x86-64 machine: on one with AVX-512
FP16 and AMX (a Xeon of the Sapphire Rapids generation) the first forward pass of the same
code, pinned, differs in one fp32 ulp. A machine kind whose bits differ therefore gets its
own recording, made from the same commit as the first (``829e777``) and named by its
instruction-set flags (:func:`cpu_kind`): ``trajectories-<kind>.json``, which the test
prefers when it exists (:func:`golden_path`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "trajectories.json"
KIND_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
"""The instruction-set flags that name a machine kind for the recordings."""


def cpu_kind(cpuinfo: str | None = None) -> str:
    """This CPU's :data:`KIND_FLAGS`, joined by "+" ("unknown" without /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return "+".join(f for f in KIND_FLAGS if f in flags) or "unknown"


def golden_path(kind: str | None = None) -> Path:
    """The recording for this machine kind when one exists, else the first recording."""
    own = GOLDEN.with_name(f"trajectories-{kind or cpu_kind()}.json")
    return own if own.is_file() else GOLDEN


STEPS = 8

# Read by each rank's fresh interpreter when it starts (the ranks are spawned).
PINNED_ISA = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def isa_supported() -> bool:
    """Whether this CPU runs the pinned instruction set (x86-64 with AVX2 and FMA)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


@contextlib.contextmanager
def pinned_isa():
    """Spawned ranks inherit the pinned instruction set; the caller's environment is
    restored afterwards."""
    saved = {k: os.environ.get(k) for k in PINNED_ISA}
    os.environ.update(PINNED_ISA)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# name -> overrides of tests.helpers.runs.tiny_config
AR, DDP = {"strategy.grad_sync": "allreduce"}, {"strategy.grad_sync": "ddp"}
RUNS: dict[str, dict] = {
    "lamb_allreduce": {"optimizer.name": "lamb", "strategy.grad_sync": "allreduce"},
    "lamb_ddp": {"optimizer.name": "lamb", "strategy.grad_sync": "ddp"},
    "adamw_allreduce": {
        "optimizer.name": "adamw",
        "optimizer.lr": 1e-3,
        "strategy.grad_sync": "allreduce",
    },
    "adamw_ddp": {"optimizer.name": "adamw", "optimizer.lr": 1e-3, "strategy.grad_sync": "ddp"},
    # freeze_step 4 of 8: four warmup steps, four compressed ones
    "onebit_lamb": {"optimizer.name": "onebit_lamb", "optimizer.freeze_step": 4},
}


def tensor_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def data_digest(corpus: Path) -> str:
    """sha256 of the prepared corpus' token arrays: a change of data, not of training,
    shows here."""
    h = hashlib.sha256()
    for path in sorted(corpus.rglob("*.npy")):
        h.update(str(path.relative_to(corpus)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _run(comm, cfg: dict) -> dict:
    from tests.helpers.runs import train_in_process

    result = train_in_process(comm, cfg)
    return {"model": tensor_digest(result["model"]), "state": result["summary"]["state"]}


def record(name: str, corpus: Path, workdir: Path) -> dict:
    """Run ``name`` on 2 ranks; its per-step losses (exact, as hex floats), validation
    losses and the final weights' digest on each rank."""
    from onebit_bert.metrics_log import read_metrics
    from tests.helpers.distributed_harness import run_ranks
    from tests.helpers.runs import tiny_config

    overrides = {
        "schedule.max_steps": STEPS,
        "data.validation_every": 4,
        "checkpoint.every": STEPS,
        **RUNS[name],
    }
    run_dir = workdir / name
    cfg = tiny_config(corpus, run_dir, **overrides)
    with pinned_isa():
        ranks = run_ranks(_run, 2, cfg, start_method="spawn")
    assert all(r["state"] == "complete" for r in ranks), ranks
    records = read_metrics(run_dir / "metrics.jsonl")
    return {
        "loss": [float(r["loss"]).hex() for r in records if "loss" in r],
        "grad_norm": [float(r["grad_norm"]).hex() for r in records if "grad_norm" in r],
        "val_mlm_loss": [float(r["val_mlm_loss"]).hex() for r in records if "val_mlm_loss" in r],
        "comm_bytes": [r["comm_bytes"] for r in records if "comm_bytes" in r],
        "model": [r["model"] for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record into {GOLDEN}")
    parser.add_argument(
        "--own-kind",
        action="store_true",
        help="with --write: record into this machine kind's own file (trajectories-KIND.json)",
    )
    args = parser.parse_args()
    from tests.helpers.corpus import prepare_corpus

    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepare_corpus(Path(tmp) / "corpus")
        out = {"data": data_digest(corpus), "runs": {}}
        for name in RUNS:
            out["runs"][name] = record(name, corpus, Path(tmp) / "runs")
            print(name, out["runs"][name]["loss"][-1], flush=True)
    if args.write:
        path = GOLDEN.with_name(f"trajectories-{cpu_kind()}.json") if args.own_kind else GOLDEN
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}")
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
