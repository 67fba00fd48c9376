"""Sweep rows whose speeds are the step model's own (:mod:`pipeline.reports.linkmodel`): a
netem JSON the model must predict exactly."""

from __future__ import annotations

from pipeline.reports import linkmodel

V = 45e6  # bytes of payload per rank per step


def model_row(bw, lamb_compute, onebit_compute, compute_only=30.0):
    """A sweep row on 2 hosts of 2 ranks whose speeds are the model's own."""

    def run(compute, pattern, payload):
        step = compute + linkmodel.link_factor(pattern, 4, 2) * payload * 8 / (bw * 1e6)
        wire = linkmodel.link_factor(pattern, 4, 2) * payload
        return {"step_seconds": step, "samples_per_s": 256 / step, "wire_bytes_per_step": wire}

    onebit = run(onebit_compute, "compressed", V / 32)
    onebit["warmup"] = run(lamb_compute, "ring", V)
    return {"bandwidth_mbit": bw, "world_size": 4, "ranks_per_host": 2, "global_batch": 256,
            "compute_only_samples_per_s": compute_only,
            "runs": {"lamb": run(lamb_compute, "ring", V), "onebit_lamb": onebit}}  # fmt: skip


def two_seed_report() -> dict:
    """A comparison report of LAMB and 1-bit LAMB, two seeds each, that both reached the
    target (steps per stage only: what the crossover reads)."""

    def run(name, seed, stages):
        return {"name": name, "strategy": name, "seed": seed, "global_batch_size": 128,
                "time_to_target": {"reached": True, "stage_steps": stages}}  # fmt: skip

    return {"runs": [run("lamb", 1, {"default": 2000}), run("lamb", 2, {"default": 2200}),
                     run("onebit_lamb", 1, {"warmup": 400, "compression": 2000}),
                     run("onebit_lamb", 2, {"warmup": 400, "compression": 2200})]}  # fmt: skip
