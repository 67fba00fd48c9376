"""What a 1-bit average of gradients loses per layer, by how its scales are chosen.

A two-layer toy on real gloo ranks (``--ranks`` processes on this machine): layer 0 has
large, noisy gradients, layer 1 small, low-noise ones (``--small-scale`` against 1, noise
``--noise`` of each layer's mean). Each step every rank's gradient is averaged three ways
with error feedback, as 0/1 Adam's phase A averages its gradients:

- ``fused_momentum_coeffs``: one fused buffer, each layer multiplied first by a coefficient
  taken from the momentum (:func:`~onebit_bert.optim.compressed.scaling_coefficients`, the
  optimizer's default; the momentum is the exact average's running mean here, as it is
  rank-identical in the optimizer);
- ``fused``: one fused buffer, no coefficients (the ``onebit`` codec on ``grad``: "1-bit
  everything");
- ``per_tensor``: every layer compressed on its own (the ``onebit_tensor`` codec,
  DeepSpeed's scales).

Printed as JSON: per way and layer, the mean over steps of ‖average − exact‖ / ‖exact‖.

    python -m bench.onebit_scales --steps 50
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from bench.common import at_least, init_gloo, run_gloo_ranks

SIZES = (4096, 512)


def _run(comm, steps: int, small_scale: float, noise: float) -> dict:
    from onebit_bert.distributed.codecs import OneBitCodec
    from onebit_bert.distributed.codecs.compression import padded_size
    from onebit_bert.optim.compressed import scaling_coefficients

    numel = sum(SIZES)
    ways = {"fused_momentum_coeffs": OneBitCodec(comm), "fused": OneBitCodec(comm),
            "per_tensor": OneBitCodec(comm, per_tensor=True)}  # fmt: skip
    shared = torch.Generator().manual_seed(0)
    means = [torch.randn(SIZES[0], generator=shared), small_scale * (1.0 + 0.1 * torch.randn(
        SIZES[1], generator=shared))]  # fmt: skip
    own = torch.Generator().manual_seed(100 + comm.rank)
    momentum = [torch.zeros(n) for n in SIZES]
    errors = {w: [[], []] for w in ways}
    for _ in range(steps):
        grads = [m + noise * m.abs().mean() * torch.randn(m.shape, generator=own) for m in means]
        exact = [g.clone() for g in grads]
        for g in exact:
            comm.all_reduce(g)
            g.div_(comm.world_size)
        for i in range(2):
            momentum[i].mul_(0.9).add_(exact[i], alpha=0.1)
        coeffs = scaling_coefficients(momentum) if momentum[0].any() else torch.ones(2)
        for way, codec in ways.items():
            scale = coeffs if way == "fused_momentum_coeffs" else torch.ones(2)
            buffer = torch.zeros(padded_size(numel, comm.world_size))
            buffer[:numel] = torch.cat([g * c for g, c in zip(grads, scale, strict=True)])
            codec.all_reduce_fused(buffer, numel, way, list(SIZES))
            parts = torch.split(buffer[:numel], list(SIZES))
            for i in range(2):
                got = parts[i] / scale[i]
                errors[way][i].append(float((got - exact[i]).norm() / exact[i].norm()))
    return {w: [sum(e) / len(e) for e in per_layer] for w, per_layer in errors.items()}


def _rank_main(rank, world_size, store, out_path, args) -> None:
    from onebit_bert.distributed import Communicator

    torch.set_num_threads(1)
    init_gloo(rank, world_size, store)
    try:
        result = _run(Communicator(dist.group.WORLD), *args)
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.onebit_scales")
    parser.add_argument("--ranks", type=at_least(2, "one rank averages nothing"), default=2)
    parser.add_argument("--steps", type=at_least(1), default=50)
    parser.add_argument("--small-scale", type=float, default=0.01)
    parser.add_argument("--noise", type=float, default=0.5)
    args = parser.parse_args(argv)
    result = run_gloo_ranks(_rank_main, args.ranks, (args.steps, args.small_scale, args.noise))
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "small_scale": args.small_scale,
                      "noise": args.noise, "layer_sizes": list(SIZES),
                      "relative_error": result}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
