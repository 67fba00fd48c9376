"""BERT-Large training throughput and peak memory on one GPU at sequence lengths 128 and
512, ours vs HF Trainer.

For every sequence length, precision (bf16, fp16) and compile setting (eager, or
``torch.compile`` in ``--compile-mode``: for our loop, the BERT body compiled as a run with
``model.compile`` has it), in this one run on the same GPU, model, micro-batch and
precision:

- the project's training loop with LAMB, 1-bit LAMB and AdamW. The loop is
  ``pretrain.train.Trainer.train_step``, the step its ``run()`` repeats (batch assembly and
  masking, forward/backward under autocast, loss-scale check, clipping, optimizer,
  schedule) without the per-step log line, validation and checkpoints. 1-bit LAMB is
  measured in its compression stage: ``freeze_step=1`` and compression forced at world
  size 1 (``strategy.force_compression``), so every timed step packs, "exchanges" and
  unpacks the momentum — the compressor's cost on one GPU, with no network in it;
- HF ``Trainer`` (``bench/hf_trainer.py``) with torch's fused AdamW
  (``adamw_torch_fused``, the kernel our AdamW row runs on CUDA), so ``ratio_vs_hf_trainer``
  compares the loops; its MLM head runs on every position, ours on the masked ones only.

Old and new code in one invocation: ``--impl reference,fused`` runs LAMB's and 1-bit
LAMB's step with the reference (plain torch) and the fused kernels (``optimizer.kernels``,
:mod:`onebit_bert.kernels`) on one trainer per configuration, alternating: ``--repeats``
rounds of ``--steps`` timed steps per implementation, so that a speed-up is a ratio of
figures from one machine and one process (``comparisons``: fused over reference, and
1-bit LAMB over LAMB per implementation). ``fused-separate`` adds 1-bit LAMB's fused
kernels with the fold and the expansion in passes of their own, as they were before the
update read the 1-bit average from the messages (``comparisons``: fused over it; LAMB
has no such row). AdamW has one implementation (torch's fused kernel): its row says
``impl: torch``.

Each figure has its MFU (the FLOP formula is stated in the output: ``bench/yardstick.py``)
and the optimizer step's own time (CUDA events around ``optimizer.step``) beside its
floor: the bytes the step must move over the memory's bandwidth (``--bandwidth-gbs``, or
measured by a copy). ``optimizer_steps`` times the optimizers alone on the preset's
parameters (no model run), the two implementations alternating as well.

Each configuration runs ``--warmup-steps`` untimed steps (compilation, the 1-bit switch,
the fp16 loss scale settling; every implementation takes some), then the timed ones. The
clock is the device's: on CUDA every step is timed by two CUDA events on the current
stream (read after the GPU synchronised), on the CPU by ``time.perf_counter``; ``clock``
says which.
``samples_per_s`` is the micro-batch over the median step, ``peak_memory_gib``
``torch.cuda.max_memory_allocated`` over the configuration (counter reset before it). One
more, untimed step of our loop runs under torch's CUDA sync debug mode:
``host_syncs_per_step`` counts the times it made the host wait for the GPU
(``bench/host_syncs.py``), and ``host_sync_sites`` says where: each site (on CUDA the line
that waited, repository paths made relative; on the CPU the operation) with its count. With
``--profile-steps N``, N more steps per implementation run before that one under
``torch.profiler``: each row's ``profile`` says where a step's time went (matrix products,
attention, communication, the optimizer's step, the rest, the GPU idle) and names its
largest kernels (``bench/step_profile.py``). A configuration that fails (out of memory, a
compile error) is recorded with its error and the others go on; the exit status is 1 when
an eager configuration failed.

``--device cpu`` runs the same code on the CPU, in fp32, as a dry run of the benchmark's
plumbing (a small ``--model`` makes it quick): its figures measure nothing about a GPU.
There ``--impl`` is ``reference`` unless Triton's interpreter is on (``TRITON_INTERPRET=1``).

The data needs nothing outside the repository: by default (``--corpus generated``) the
smoke corpus that ``python -m smoke_data`` writes, prepared by the data stage at both
sequence lengths with a WordPiece vocabulary trained on it (``vocab_size`` in the output:
the model's embedding and MLM head are that wide). ``--corpus wikipedia`` prepares the
Wikipedia sample of ``--data-root`` with BERT's uncased vocabulary instead; ``--prepared``
reuses a folder the data stage already wrote. One JSON object is the last line of stdout;
``reference`` carries NVIDIA's published single-GPU figures for scale (another GPU, batch
and software stack: not a like-for-like comparison).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from itertools import product
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a file (python bench/gpu.py): make bench importable
    sys.path.insert(0, str(REPO))

from bench.gpu_options import build_parser, check_arguments  # noqa: E402  (the CLI)

NO_CUDA = "bench-gpu needs a CUDA GPU; none found (torch.cuda.is_available() is False)"
HF_OPTIMIZER = "adamw_torch_fused"
ADAMW_LR = 1e-4  # what bench.common.pretrain_config gives our AdamW

NVIDIA_REFERENCE = {
    "sequences_per_s_per_gpu": {"128": 580, "512": 210},
    "gpu": "A100 80GB",
    "precision": "mixed precision (fp16)",
    "setup": (
        "NVIDIA's BERT-Large pretraining (LAMB, fused kernels) on one A100 80GB, phase 1 "
        "(seq 128) and phase 2 (seq 512), with gradient accumulation"
    ),
    "source": "NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md",
    "measured_here": False,
}


def pin_one_gpu() -> None:
    """Keep only the first visible GPU, before CUDA starts: HF Trainer wraps the model in
    ``nn.DataParallel`` when it sees several, and this benchmark is about one."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0] if visible else "0"


class Device:
    """What the benchmark asks of its device: waiting for it, and its peak memory."""

    def __init__(self, kind: str):
        import torch

        self.torch = torch
        self.type = kind
        self.cuda = kind == "cuda"
        self.name = torch.cuda.get_device_name(0) if self.cuda else None

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def release(self) -> None:
        """Free what the previous configuration left, so each one's peak is its own."""
        gc.collect()
        self.torch._dynamo.reset()
        if self.cuda:
            self.torch.cuda.empty_cache()

    @property
    def clock(self) -> str:
        return "cuda_events" if self.cuda else "perf_counter"

    def time_step(self, step) -> float:
        """Seconds ``step()`` took on the device: between two CUDA events on the current
        stream (the GPU idle before the first), or by the host's clock on the CPU."""
        torch = self.torch
        if not self.cuda:
            start = time.perf_counter()
            step()
            return time.perf_counter() - start
        self.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        """Peak memory allocated since ``reset_peak`` (None on the CPU)."""
        if not self.cuda:
            return None
        return round(self.torch.cuda.max_memory_allocated() / 2**30, 3)


def measure(name: str, run, device: Device) -> dict:
    """``run()`` (a dict of results) with the peak-memory counter reset before it; a
    failure is recorded under ``error`` (its traceback on stderr) instead of raised."""
    device.release()
    device.reset_peak()
    print(f"bench-gpu: {name}", file=sys.stderr, flush=True)
    try:
        result = run()
        result["peak_memory_gib"] = device.peak_gib()
    except Exception as err:  # a configuration's failure is a result, not the end
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:500]}
    device.release()
    return result


def rate(step_seconds: list[float], batch: int) -> dict:
    median = statistics.median(step_seconds)
    return {
        "samples_per_s": round(batch / median, 2),
        "step_seconds_median": round(median, 5),
        "steps_timed": len(step_seconds),
    }


def our_loop(
    data: Path,
    run_dir: Path,
    optimizer: str,
    precision: str,
    compiled: bool,
    batch,
    args,
    device,
    packing: bool = False,
) -> dict:
    """Samples/s of the project's loop on the device (see the module docstring), per
    implementation: ``{"impls": {impl: figures}, ...}``; with ``packing``, the micro-batch's
    sequences packed into as few rows as fit (``data.packing``)."""
    from bench.common import pretrain_config
    from bench.host_syncs import find_host_syncs, sites_by_count
    from bench.step_profile import profile_steps
    from bench.yardstick import (
        StepClock,
        implementations,
        model_flops,
        optimizer_figures,
        use_implementation,
    )
    from onebit_bert.config import from_dict
    from onebit_bert.distributed import init_distributed
    from pretrain.config import PretrainConfig
    from pretrain.train import Trainer

    rounds = args.repeats * len(args.impl)
    total = args.warmup_steps + rounds * args.steps + len(args.impl) * args.profile_steps
    settings = pretrain_config(
        data,
        run_dir,
        optimizer,
        steps=total + 1,
        batch=batch,
        micro=batch,
        freeze_step=1,
        model=args.model,
        vocab_size=args.vocab_size,
        strategy={"force_compression": True} if optimizer == "onebit_lamb" else None,
    )
    settings["precision"] = precision
    # compiled as a run with model.compile compiles: the BERT body, the heads eager
    settings["model"]["compile"] = args.compile_mode if compiled else "off"
    settings["data"]["packing"] = packing
    ctx = init_distributed(backend=None if device.cuda else "gloo", env={})
    trainer = Trainer(from_dict(PretrainConfig, settings), ctx)
    try:
        opt = trainer.strategy.optimizer
        chooses = hasattr(opt, "set_kernels")
        impls = implementations(opt, args.impl) if chooses else ["torch"]
        switch = partial(use_implementation, opt) if chooses else None
        clock = StepClock(device.torch, device.cuda)
        clock.wrap(opt)
        for step in range(1, args.warmup_steps + 1):
            if switch is not None:
                switch(impls[step % len(impls)])
            trainer.train_step(step)
        clock.take()
        seconds = {impl: [] for impl in impls}
        optimizer_seconds = {impl: [] for impl in impls}
        paths = {}  # the kernels each implementation's steps took (1-bit LAMB says)
        step = args.warmup_steps
        for _ in range(args.repeats if switch is not None else rounds):
            for impl in impls:
                if switch is not None:
                    switch(impl)
                for _ in range(args.steps):
                    step += 1
                    seconds[impl].append(device.time_step(partial(trainer.train_step, step)))
                optimizer_seconds[impl] += clock.take()
                paths[impl] = getattr(opt, "last_step_kernels", None)
        profiles = {}
        for impl in impls if args.profile_steps else []:
            if switch is not None:
                switch(impl)
            try:
                profiles[impl] = profile_steps(
                    lambda i, first=step + 1: trainer.train_step(first + i),
                    args.profile_steps,
                    device.cuda,
                )
            except Exception as err:  # a failed profile leaves the timed figures standing
                traceback.print_exc()
                profiles[impl] = {"error": f"{type(err).__name__}: {err}"[:500]}
            step += args.profile_steps
        _, sites = find_host_syncs(lambda: trainer.train_step(step + 1), ctx.device)
        flops = model_flops(trainer.model, batch, trainer.seq_length)
        params = sum(p.numel() for group in opt.param_groups for p in group["params"])
        figures = {}
        for impl in impls:
            figures[impl] = {
                **rate(seconds[impl], batch),
                **optimizer_figures(
                    optimizer, optimizer_seconds[impl], params, args.bandwidth, impl
                ),
            }
            step_seconds = figures[impl]["step_seconds_median"]
            tflops = flops["model_flops_per_step"] / step_seconds / 1e12
            figures[impl]["model_tflops_per_s"] = float(f"{tflops:.4g}")
            if paths.get(impl) is not None:
                figures[impl]["kernels_path"] = paths[impl]
            if impl in profiles:
                figures[impl]["profile"] = profiles[impl]
        return {
            "impls": figures,
            **flops,
            "optimizer_params": params,
            "clock": device.clock,
            "host_syncs_per_step": len(sites),
            "host_sync_sites": sites_by_count(sites),
            "stage": getattr(opt, "stage", None),
            "skipped_steps": trainer.scaler.skipped_steps,
        }
    finally:
        trainer.logger.close()
        trainer.release()


def hf_loop(data: Path, out_dir: Path, precision: str, compiled: bool, batch, args, device) -> dict:
    """Samples/s of HF Trainer with AdamW on the device."""
    from bench.hf_trainer import hf_trainer_step_seconds

    seconds = hf_trainer_step_seconds(
        data,
        out_dir,
        preset=args.model,
        vocab_size=args.vocab_size,
        steps=args.warmup_steps + args.steps,
        batch=batch,
        learning_rate=ADAMW_LR,
        weight_decay=0.01,
        adam_epsilon=1e-6,
        optim=HF_OPTIMIZER,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        torch_compile=compiled,
        **({"torch_compile_mode": args.compile_mode} if compiled else {}),
        use_cpu=not device.cuda,
    )
    # seconds[i] is step i + 2's: the first timed step is warmup_steps + 1
    # its clock: the host's, read at each step's end after the GPU synchronised
    return {**rate(seconds[args.warmup_steps - 1 :], batch), "clock": "perf_counter"}


def batch_for(seq_length: int, batch_size: int) -> int:
    """The micro-batch at ``seq_length``: ``batch_size`` at 128, as many tokens longer."""
    return max(1, batch_size * 128 // seq_length)


def run_all(data: dict[int, Path], tmp: Path, args, device: Device, done=None) -> list[dict]:
    """Every configuration on ``data`` (sequence length -> the data stage's shard folder);
    one row per loop, optimizer and implementation. Sets ``args.bandwidth`` (GB/s: given
    or measured) for the optimizer's floor. ``done(rows)``, if given, is called with each
    configuration's rows as soon as it has run."""
    done = done or (lambda rows: None)
    from bench.yardstick import measure_bandwidth, peak_tflops

    args.bandwidth = args.bandwidth_gbs or measure_bandwidth(device.torch, device.type)
    compile_settings = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    packings = {"off": [False], "on": [True], "both": [False, True]}[args.packing]
    runs = []
    for seq_length, shards in data.items():
        batch = batch_for(seq_length, args.batch_size)
        for compiled in compile_settings:
            for precision in args.precisions:
                mode = "compiled" if compiled else "eager"
                common = {"seq_length": seq_length, "batch_size": batch, "precision": precision}
                common["compile"] = compiled
                common["compile_mode"] = args.compile_mode if compiled else None
                peak = peak_tflops(device.name, precision, args.peak_tflops)
                hf = None
                if args.hf_baseline:
                    name = f"hf_trainer_{seq_length}_{precision}_{mode}"
                    run = partial(
                        hf_loop, shards, tmp / name, precision, compiled, batch, args, device
                    )
                    hf = measure(name, run, device)
                    runs.append({"loop": "hf_trainer", "optimizer": "adamw", **common, **hf})
                    done(runs[-1:])
                for optimizer, packing in product(args.optimizers, packings):
                    name = f"ours_{optimizer}_{seq_length}_{precision}_{mode}"
                    name += "_packed" if packing else ""
                    run = partial(
                        our_loop,
                        shards,
                        tmp / name,
                        optimizer,
                        precision,
                        compiled,
                        batch,
                        args,
                        device,
                        packing,
                    )
                    result = measure(name, run, device)
                    first = len(runs)
                    for impl, figures in result.pop("impls", {"-": {}}).items():
                        row = {"loop": "ours", "optimizer": optimizer, "impl": impl, **common}
                        row["packing"] = packing
                        row.update(result, **figures)
                        if "model_tflops_per_s" in row and peak:
                            row["peak_tflops"] = peak
                            row["mfu"] = float(f"{row['model_tflops_per_s'] / peak:.4g}")
                        if hf and "samples_per_s" in hf and "samples_per_s" in row:
                            row["ratio_vs_hf_trainer"] = round(
                                row["samples_per_s"] / hf["samples_per_s"], 3
                            )
                        runs.append(row)
                    done(runs[first:])
    return runs


def append_rows(path: Path | None, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as JSON lines, flushed at once (``--rows-out``): what
    ran is kept if the invocation is stopped before its summary."""
    if path is None:
        return
    with open(path, "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def prepared_vocab_size(out: Path) -> int:
    """The vocabulary the data stage's tokenizer under ``out`` has (the model's width)."""
    from tokenizers import Tokenizer

    from data_prep.outputs import tokenizer_dir

    return Tokenizer.from_file(str(tokenizer_dir(out) / "tokenizer.json")).get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    pin_one_gpu()
    import torch  # the one import needed to know whether there is anything to measure

    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 1
    from bench.common import prepare_generated, prepare_wikipedia, shared_data_root
    from data_prep.outputs import seq_dir

    seq_lengths = [int(n) for n in args.seq_lengths]
    wikipedia = args.prepared is None and args.corpus == "wikipedia"
    data_root = shared_data_root(parser, args) if wikipedia else None
    import transformers

    device = Device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.prepared is not None:
            out = args.prepared.resolve()
        elif data_root is not None:
            out = prepare_wikipedia(data_root, tmp / "data", seq_lengths, args.max_documents)
        else:
            out = prepare_generated(tmp / "data", seq_lengths)
        data = {n: seq_dir(out, n) for n in seq_lengths}
        missing = [str(path) for path in data.values() if not path.is_dir()]
        if missing:
            parser.error(f"no prepared shards at {', '.join(missing)}: prepare those lengths")
        vocab_size = prepared_vocab_size(out)
        runs = run_all(data, tmp, args, device, partial(append_rows, args.rows_out))
        steps = []
        if args.optimizer_steps:
            from bench.yardstick import standalone_optimizer_steps

            alone = partial(standalone_optimizer_steps, args, device, args.impl, args.bandwidth)
            steps = measure("optimizer_steps", lambda: {"rows": alone()}, device).get("rows", [])
    from bench.yardstick import FLOP_FORMULA, comparisons

    eager_failures = [r for r in runs if "error" in r and not r["compile"]]
    if device.cuda:
        properties = torch.cuda.get_device_properties(0)
        gpu = {"gpu": properties.name, "gpu_memory_gib": round(properties.total_memory / 2**30, 1)}
    else:
        gpu = {"gpu": None, "dry_run": "on the CPU: the plumbing checked, no GPU measured"}
    summary = {
        "benchmark": "gpu",
        "device": device.type,
        **gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "model": args.model,
        "corpus": "prepared" if args.prepared is not None else args.corpus,
        "tokenizer_vocab_size": vocab_size,
        "model_vocab_size": args.vocab_size,
        "seq_lengths": seq_lengths,
        "batch_size_at_128": args.batch_size,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "hf_trainer_optimizer": HF_OPTIMIZER,
        "clock": device.clock,
        "impls": args.impl,
        "repeats": args.repeats,
        "bandwidth_gbs": args.bandwidth,
        "bandwidth_source": "given" if args.bandwidth_gbs else "measured (device copy)",
        "flop_formula": FLOP_FORMULA,
        "runs": runs,
        "optimizer_steps": steps,
        "comparisons": comparisons(runs, steps),
        "failures": sum("error" in r for r in runs),
        "reference": NVIDIA_REFERENCE,
    }
    print(json.dumps(summary))
    return 1 if eager_failures else 0


if __name__ == "__main__":
    sys.exit(main())
