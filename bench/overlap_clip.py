"""What clipping an overlapped compression step bucket by bucket costs the backward pass.

An overlapped 1-bit step clips each momentum bucket, when it is ready, by a norm estimated
from the gradients complete by then and the previous step's norms for the rest
(:class:`~onebit_bert.optim.compressed.OverlapClip`). This times that bookkeeping for one
step of a model's parameter layout (default BERT-Large's, 25 MB buckets as
``comm.overlap`` cuts them, issued last bucket first): the clip's, which keeps the estimate
in one buffer, against the walk it replaced (each parameter's norm looked up in a
dictionary and all of them stacked, for every bucket). The gradients are one element per
parameter, so what is timed is the bookkeeping, not the norms' arithmetic.

Printed as JSON: parameters, buckets, and per way the median milliseconds per step over
``--repeats``, with the ratio.

    python -m bench.overlap_clip --preset bert-large --device cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _layout(preset: str, bucket_mb: float) -> tuple[list[int], list[list[int]]]:
    """Each parameter's size in the model's order, and each bucket's parameter indices."""
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    with torch.device("meta"):
        model = build_model(ModelConfig(preset=preset), vocab_size=30522)
    sizes = [p.numel() for p in model.parameters()]
    bucket = max(1, int(bucket_mb * (1 << 20)) // 4)
    total = sum(sizes)
    members: list[list[int]] = [[] for _ in range((total + bucket - 1) // bucket)]
    offset = 0
    for i, n in enumerate(sizes):
        for k in range(offset // bucket, (offset + n - 1) // bucket + 1):
            members[k].append(i)
        offset += n
    return sizes, members


def _walk_coefficient(max_norm, params, previous, current) -> torch.Tensor:
    """The replaced estimate: every parameter's norm looked up, then stacked, per bucket."""
    norms = []
    for p, before in zip(params, previous, strict=True):
        n = current.get(id(p), before)
        if n is not None:
            norms.append(n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _step_buffer(params, previous, members) -> None:
    from onebit_bert.optim.compressed import OverlapClip

    clip = OverlapClip(1.0, params, previous)
    for k in reversed(range(len(members))):
        clip.see([params[i] for i in members[k]])
        clip.coefficient()
    clip.norms()


def _step_walk(params, previous, members) -> None:
    current: dict[int, torch.Tensor] = {}
    for k in reversed(range(len(members))):
        bucket = [params[i] for i in members[k] if id(params[i]) not in current]
        if not bucket:
            _walk_coefficient(1.0, params, previous, current)
            continue
        for p, n in zip(bucket, torch._foreach_norm([p.grad for p in bucket]), strict=True):
            current[id(p)] = n
        _walk_coefficient(1.0, params, previous, current)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bert-large")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes, members = _layout(args.preset, args.bucket_mb)
    device = torch.device(args.device)
    params = [torch.zeros(1, device=device, requires_grad=True) for _ in sizes]
    for p in params:
        p.grad = torch.rand(1, device=device)
    previous = list(torch._foreach_norm([p.grad * 2 for p in params]))
    out = {
        "preset": args.preset,
        "parameters": len(params),
        "buckets": len(members),
        "device": str(device),
    }
    for name, step in (("buffer", _step_buffer), ("walk", _step_walk)):
        times = []
        for _ in range(args.repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(params, previous, members)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        out[f"{name}_ms_per_step"] = round(1e3 * statistics.median(times[2:]), 3)
    out["walk_over_buffer"] = round(out["walk_ms_per_step"] / out["buffer_ms_per_step"], 2)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
