"""What bench/gpu.py measures its figures against: the model's FLOPs per step (for MFU), the
bytes an optimizer step must move (its floor at the memory's bandwidth), that bandwidth,
and the optimizer step's own time, inside the loop and alone.

Model FLOPs per training step, stated in every result as ``flop_formula``::

    6 · N · T  +  12 · L · d · S · T

``N``: the encoder's parameters (every layer's matrices, biases and LayerNorms; not the
embeddings, which are lookups, nor the MLM head, which our loop runs on the masked
positions only); ``T = batch · S`` tokens (padding included: the model computes on it);
``L`` layers of width ``d``; the second term is attention's two ``S × S`` products, 4·S·d
FLOPs per token and layer forward, three times that with the backward pass.
MFU = FLOPs per step / step seconds / the device's peak (dense bf16/fp16 tensor-core peak
from the vendor's datasheet, or ``--peak-tflops``).

Bytes floor of one optimizer step, fp32 state, per parameter (the least each step must
read and write, with perfect fusion and no re-reading):

- LAMB and AdamW: read ``g, w, m, v``, write ``w, m, v``: 28 bytes;
- 1-bit LAMB's compression step at world size ``W``: read ``g, w, m, v``, the fresh second
  moment, the momentum kept from before the fold and the worker's error; write ``w, m``,
  the fresh moment, the kept momentum and the worker's error (48 bytes); the server's
  error, read and written on ``1/W`` of the elements (``8/W``); the packed signs, written
  and read by the worker and the server phase (about ``0.5``): ``56.5`` bytes at ``W = 1``.

The bandwidth is ``--bandwidth-gbs`` or measured here by the best of several copies of a
large buffer (bytes read plus bytes written, over the copy's time).
"""

from __future__ import annotations

import statistics
import time

FLOP_FORMULA = (
    "6*N*T + 12*L*d*S*T (N: encoder parameters; T: tokens per step, padding included; "
    "L layers of width d; S: sequence length; embeddings and the MLM head excluded)"
)

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
"""Dense bf16/fp16 tensor-core peak per GPU family (vendors' datasheets, SXM parts)."""

BYTES_PER_PARAMETER = {"lamb": 28.0, "adamw": 28.0}

COUNTED_BYTES_PER_PARAMETER = {
    ("lamb", "fused"): 40.07,
    ("onebit_lamb", "fused"): 68.62,
    ("onebit_lamb", "fused-separate"): 84.59,
}
"""What the fused kernels of one step move per fp32 parameter at one rank, by optimizer and
implementation (1-bit LAMB in its compression stage), counted load by load in Triton's
interpreter by ``python -m bench.kernel_bytes [--separate-passes]``
(docs/results/2026-12-01-errors-kept-as-values.md; a slow test holds these to the count):
over a step's measured time, the bandwidth the kernels reached."""


def optimizer_bytes_per_parameter(name: str, world_size: int = 1) -> float | None:
    """The floor's bytes per fp32 parameter of one step of ``name`` (None: not modelled);
    1-bit LAMB in its compression stage."""
    if name == "onebit_lamb":
        return 48.0 + 8.0 / world_size + 0.5
    return BYTES_PER_PARAMETER.get(name)


def peak_tflops(gpu_name: str | None, precision: str, override: float | None) -> float | None:
    """The peak MFU divides by: ``override``, else the table's for a bf16/fp16 run on a
    known GPU, else None (no MFU)."""
    if override is not None:
        return override
    if gpu_name is None or precision not in ("bf16", "fp16"):
        return None
    for family, peak in PEAK_TFLOPS.items():
        if family in gpu_name:
            return peak
    return None


def model_flops(model, batch: int, seq_length: int) -> dict:
    """FLOPs of one training step of a ``transformers`` BERT (:data:`FLOP_FORMULA`)."""
    config = model.config
    layers, width = config.num_hidden_layers, config.hidden_size
    encoder = sum(p.numel() for p in model.bert.encoder.parameters())
    tokens = batch * seq_length
    return {
        "model_flops_per_step": 6 * encoder * tokens + 12 * layers * width * seq_length * tokens,
        "encoder_params": encoder,
        "flop_formula": FLOP_FORMULA,
    }


def measure_bandwidth(torch, device: str, megabytes: int | None = None, repeats: int = 10):
    """GB/s of a device-to-device copy (bytes read + written), the best of ``repeats``."""
    nbytes = (megabytes or (1024 if device == "cuda" else 64)) * 2**20
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del source, target
    return round(2 * nbytes / best / 1e9, 1)


class StepClock:
    """Times every call of an optimizer's ``step`` on the device (through torch's step
    hooks): CUDA events on the current stream (resolved by :meth:`take`), or the host's
    clock on the CPU."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.marks: list = []
        self._start = None

    def wrap(self, optimizer) -> None:
        def before(*_):
            self._start = self._mark()

        def after(*_):
            self.marks.append((self._start, self._mark()))

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> list[float]:
        """Seconds of every step since the last call (waits for the device)."""
        if self.cuda:
            self.torch.cuda.synchronize()
            seconds = [a.elapsed_time(b) / 1000 for a, b in self.marks]
        else:
            seconds = [b - a for a, b in self.marks]
        self.marks = []
        return seconds


def optimizer_figures(
    name: str,
    step_seconds: list[float],
    params: int,
    bandwidth_gbs: float | None,
    impl: str | None = None,
) -> dict:
    """The optimizer step's median time beside its floor (bytes / bandwidth); for an
    implementation whose traffic was counted (:data:`COUNTED_BYTES_PER_PARAMETER`), the
    bandwidth that traffic took: ``optimizer_effective_gbs`` and its share of
    ``bandwidth_gbs``."""
    per_parameter = optimizer_bytes_per_parameter(name)
    median = statistics.median(step_seconds)
    out = {"optimizer_step_ms": round(1000 * median, 3)}
    counted = COUNTED_BYTES_PER_PARAMETER.get((name, impl))
    if counted is not None and median > 0:
        effective = counted * params / median / 1e9
        out.update(
            optimizer_counted_bytes_per_parameter=counted,
            optimizer_effective_gbs=round(effective, 1),
        )
        if bandwidth_gbs:
            out["optimizer_bandwidth_share"] = round(effective / bandwidth_gbs, 3)
    if per_parameter is None or not bandwidth_gbs:
        return out
    floor = per_parameter * params / (bandwidth_gbs * 1e9)
    out.update(
        optimizer_bytes_floor=int(per_parameter * params),
        optimizer_bytes_per_parameter=per_parameter,
        optimizer_floor_ms=round(1000 * floor, 3),
        optimizer_vs_floor=round(out["optimizer_step_ms"] / (1000 * floor), 2),
    )
    return out


def optimizer_on_preset(name: str, preset: str, vocab_size: int, device: str, comm=None):
    """Optimizer ``name`` (5e-3, eps 1e-6, weight decay 0.01; 1-bit LAMB freezing at step 1)
    over a fresh ``preset`` model's parameters on ``device``, each with a fixed random
    gradient (scale 1e-3), and their count. ``comm``: its group (default: one rank)."""
    import torch

    from onebit_bert.distributed.comm import Communicator
    from onebit_bert.optim.build import OptimizerConfig, build_optimizer
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    model = build_model(ModelConfig(preset=preset), vocab_size).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
    cfg = OptimizerConfig(name=name, lr=5e-3, freeze_step=1, eps=1e-6, weight_decay=0.01)
    opt = build_optimizer(cfg, model, comm or Communicator(None, device=device))
    return opt, sum(p.numel() for group in opt.param_groups for p in group["params"])


SEPARATE = "fused-separate"
"""The implementation name of 1-bit LAMB's fused kernels with the fold and the expansion
in passes of their own (:attr:`onebit_bert.optim.OneBitLamb.expand_in_update` off): the
fused step as it was before those passes were folded into others."""


def use_implementation(opt, impl: str) -> None:
    """Take ``opt``'s later steps with implementation ``impl``: ``reference``, ``fused``
    or :data:`SEPARATE`."""
    opt.set_kernels("fused" if impl == SEPARATE else impl)
    if hasattr(opt, "expand_in_update"):
        opt.expand_in_update = impl != SEPARATE


def implementations(opt, impls: list[str]) -> list[str]:
    """The ones of ``impls`` that differ for ``opt``: :data:`SEPARATE` only where it has
    something to keep apart (1-bit LAMB)."""
    return [i for i in impls if i != SEPARATE or hasattr(opt, "expand_in_update")]


def standalone_optimizer_steps(args, device, impls: list[str], bandwidth_gbs) -> list[dict]:
    """Each of ``args.optimizers`` that has kernels to choose (LAMB, 1-bit LAMB) stepping
    the ``args.model`` preset's parameters alone, with fixed random gradients: ``args.steps``
    timed steps per implementation, ``args.repeats`` rounds, implementations alternating
    within each round. 1-bit LAMB freezes at step 1, so every timed step compresses."""
    rows = []
    for name in [n for n in args.optimizers if n in ("lamb", "onebit_lamb")]:
        opt, params = optimizer_on_preset(name, args.model, args.vocab_size, device.type)
        mine = implementations(opt, impls)
        for impl in mine * 2:  # the stage switch, compilation of the kernels
            use_implementation(opt, impl)
            opt.step()
        seconds: dict[str, list[float]] = {impl: [] for impl in mine}
        for _ in range(args.repeats):
            for impl in mine:
                use_implementation(opt, impl)
                seconds[impl] += [device.time_step(opt.step) for _ in range(args.steps)]
        for impl in mine:
            rows.append(
                {
                    "optimizer": name,
                    "impl": impl,
                    "params": params,
                    "steps_timed": len(seconds[impl]),
                    "stage": getattr(opt, "stage", None),
                    **optimizer_figures(name, seconds[impl], params, bandwidth_gbs, impl),
                }
            )
        del opt  # the model goes with it: only the optimizer holds its parameters
        device.release()
    return rows


def comparisons(runs: list[dict], steps: list[dict]) -> list[dict]:
    """Ratios of figures from this one invocation: per configuration, fused over reference
    (samples/s, and the optimizer step's time reference over fused) and 1-bit LAMB over
    LAMB per implementation (samples/s); per optimizer alone, reference over fused. Where
    1-bit LAMB ran :data:`SEPARATE` too, fused over it as well."""
    out = []
    ours = [r for r in runs if r["loop"] == "ours" and "samples_per_s" in r]
    configs = sorted({(r["seq_length"], r["precision"], r["compile"]) for r in ours})
    for seq_length, precision, compiled in configs:
        here = {
            (r["optimizer"], r["impl"]): r
            for r in ours
            if (r["seq_length"], r["precision"], r["compile"]) == (seq_length, precision, compiled)
        }
        row = {"seq_length": seq_length, "precision": precision, "compile": compiled}
        for optimizer in ("lamb", "onebit_lamb"):
            ref, new = here.get((optimizer, "reference")), here.get((optimizer, "fused"))
            if ref and new:
                row[f"{optimizer}_fused_over_reference_samples"] = round(
                    new["samples_per_s"] / ref["samples_per_s"], 3
                )
                row[f"{optimizer}_optimizer_step_speedup"] = round(
                    ref["optimizer_step_ms"] / new["optimizer_step_ms"], 2
                )
        old, new = here.get(("onebit_lamb", SEPARATE)), here.get(("onebit_lamb", "fused"))
        if old and new:
            row["onebit_lamb_in_update_over_separate_samples"] = round(
                new["samples_per_s"] / old["samples_per_s"], 3
            )
            row["onebit_lamb_in_update_step_speedup"] = round(
                old["optimizer_step_ms"] / new["optimizer_step_ms"], 2
            )
        for impl in ("reference", "fused"):
            lamb, onebit = here.get(("lamb", impl)), here.get(("onebit_lamb", impl))
            if lamb and onebit:
                row[f"onebit_over_lamb_samples_{impl}"] = round(
                    onebit["samples_per_s"] / lamb["samples_per_s"], 3
                )
        out.append(row)
    alone = {(r["optimizer"], r["impl"]): r for r in steps}
    old, new = alone.get(("onebit_lamb", SEPARATE)), alone.get(("onebit_lamb", "fused"))
    if old and new:
        out.append(
            {
                "optimizer_alone": "onebit_lamb",
                "step_speedup_in_update": round(
                    old["optimizer_step_ms"] / new["optimizer_step_ms"], 2
                ),
            }
        )
    for optimizer in ("lamb", "onebit_lamb"):
        ref, new = alone.get((optimizer, "reference")), alone.get((optimizer, "fused"))
        if ref and new:
            out.append(
                {
                    "optimizer_alone": optimizer,
                    "step_speedup_fused": round(
                        ref["optimizer_step_ms"] / new["optimizer_step_ms"], 2
                    ),
                }
            )
    return out
