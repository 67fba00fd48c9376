"""A recipe's step on any link and cluster size, from what the netem sweeps measured.

**The step model.** Per recipe and stage (1-bit recipes: ``warmup``, ``compression``;
others one), a :class:`Profile` from a ``bench.netem`` row: the compute seconds per step
(the step time at the sweep's fastest link, less that link's modelled exposed traffic; in
units of the reference row's machine speed, so that sweeps run at other machine states
agree: each row's ``compute_only_samples_per_s``), the payload a rank exchanges per step
(the bytes its host's link received at the sweep's slowest link, divided by the
collective's factor below) and how much of the traffic can hide behind compute (CO2 and
Streaming DiLoCo send a round's average during the next steps: up to one step's compute per
step; every other recipe waits). On ``p`` ranks in nodes of ``g``, ``n = p / g`` nodes,
the bytes each node's link carries per step for a payload ``V``:

- ``ring`` (a ring all-reduce: LAMB, AdamW, PowerSGD's factors, the local-step averages per
  step of the round): ``2 (p - 1) / p · V``, the ring ordered by node;
- ``compressed`` (the 1-bit all-to-all, then the all-gather of the compressed chunks; also
  int8 warmups): ``g (p - g) / p · V + (p - 1) / p · V``: each rank sends ``V / p`` to every
  rank outside its node, and the all-gather's ring crosses into each node once;
- ``node_ring``, ``node_compressed`` (the node hierarchy: exact averages inside a node, the
  collective between nodes on each rank's ``1 / g`` shard): ``2 (n - 1) / n · V``;
- ``neighbours`` (DecentLaM, DmSGD): ``k · V`` for ``k`` neighbours per step.

A step then takes ``compute + max(0, bytes · 8 / B + latency · messages - hide · compute)``
on a link of ``B`` bit/s (:func:`step_seconds`). :mod:`pipeline.reports.crossover` turns steps into
times to the target; :mod:`pipeline.reports.crossover_check` sets the model against every netem
point in the repository.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from onebit_bert.recipes import RECIPES
from pipeline.reports.timing import combine_repeats

REPO = Path(__file__).resolve().parents[2]
HIDES = {"co2", "streaming_diloco"}
"""Strategies whose averages travel while the next steps compute."""


@dataclass(frozen=True)
class Profile:
    """One recipe stage's step, as the model needs it."""

    recipe: str
    stage: str
    pattern: str
    payload_bytes: float
    compute_s: float
    hide: float
    neighbours: int
    batch_per_rank: int
    source: str


def pattern_of(key: str, stage: str) -> tuple[str, int]:
    """(collective pattern, neighbours) of a recipe key's stage (``decentlam/ring``)."""
    name, _, topology = key.partition("/")
    recipe = RECIPES.get(name, None)
    node = recipe is not None and recipe.settings.get("comm.hierarchy") == "node"
    measure = recipe.measure if recipe else "data_parallel"
    if measure == "decentralized":
        return "neighbours", 2 if topology in ("ring", "") else 1
    if measure == "zero_one_adam":
        return "compressed", 0
    if measure == "onebit":
        compressed = stage == "compression" or "comm.compression.grad" in recipe.settings
        return ("node_" if node else "") + ("compressed" if compressed else "ring"), 0
    if measure == "data_parallel" and node:
        return "node_ring", 0
    return "ring", 0


def link_factor(pattern: str, p: int, g: int, neighbours: int = 0) -> float:
    """Bytes a node's link carries per byte of payload (see the module's note)."""
    n = max(p // g, 1)
    if pattern == "ring":
        return 2 * (p - 1) / p
    if pattern == "compressed":
        return g * (p - g) / p + (p - 1) / p
    if pattern in ("node_ring", "node_compressed"):
        return 2 * (n - 1) / n
    if pattern == "neighbours":
        return float(neighbours) if n > 1 else 0.0
    raise ValueError(f"unknown collective pattern {pattern!r}")


def messages(pattern: str, p: int, g: int, neighbours: int = 0) -> int:
    """Latency-bound rounds of the collective per step."""
    n = max(p // g, 1)
    return {"ring": 2 * (p - 1), "compressed": 2 * (p - 1), "node_ring": 2 * (n - 1),
            "node_compressed": 2 * (n - 1), "neighbours": neighbours}[pattern]  # fmt: skip


def step_seconds(profile: Profile, link_bps: float, p: int, g: int, latency_s: float = 0.0,
                 compute_scale: float = 1.0, payload_scale: float = 1.0) -> float:  # fmt: skip
    """One step of ``profile`` on ``p`` ranks in nodes of ``g`` over ``link_bps``."""
    compute = profile.compute_s * compute_scale
    bytes_ = link_factor(profile.pattern, p, g, profile.neighbours) * profile.payload_bytes
    comm = bytes_ * payload_scale * 8 / link_bps
    comm += latency_s * messages(profile.pattern, p, g, profile.neighbours)
    return compute + max(0.0, comm - profile.hide * compute)


def _stages(run: dict) -> list[tuple[str, dict]]:
    """(stage, its measurement) of one netem runs entry."""
    out = [("warmup", run["warmup"])] if "warmup" in run else []
    return [*out, ("compression" if out else "default", run)]


def _exposed(pattern, payload, neighbours, bw_mbit, p, g) -> float:
    return link_factor(pattern, p, g, neighbours) * payload * 8 / (bw_mbit * 1e6)


def profiles_of(rows: list[dict], source: str, key: str,
                reference_speed: float | None = None) -> dict:  # fmt: skip
    """Stage -> :class:`Profile` of recipe ``key`` from one sweep's rows (one world size):
    payload at the slowest link, compute at the fastest; in units of ``reference_speed``
    (compute-only samples/s of another machine state) when given, else as measured."""
    rows = sorted((r for r in rows if key in r.get("runs", {})), key=lambda r: r["bandwidth_mbit"])
    if not rows:
        return {}
    slow, fast = rows[0], rows[-1]
    needed = ("step_seconds", "wire_bytes_per_step")
    if any(
        k not in run for r in (slow, fast) for _, run in _stages(r["runs"][key]) for k in needed
    ):
        return {}  # a sweep from before the benchmark recorded them
    p, g = slow["world_size"], slow.get("ranks_per_host", 1)
    out = {}
    for (stage, s_run), (_, f_run) in zip(_stages(slow["runs"][key]), _stages(fast["runs"][key]),
                                          strict=True):  # fmt: skip
        pattern, k = pattern_of(key, stage)
        factor = link_factor(pattern, p, g, k) or 1.0
        payload = max(s_run["wire_bytes_per_step"], f_run["wire_bytes_per_step"]) / factor
        name = key.partition("/")[0]
        hide = 1.0 if name in RECIPES and RECIPES[name].strategy in HIDES else 0.0
        exposed = _exposed(pattern, payload, k, fast["bandwidth_mbit"], p, g)
        # a recipe that hides its traffic hides all of it on the fastest link
        compute = f_run["step_seconds"] - (0.0 if hide else exposed)
        if reference_speed and fast.get("compute_only_samples_per_s"):
            compute *= fast["compute_only_samples_per_s"] / reference_speed
        compute = max(compute, 1e-9)
        out[stage] = Profile(key, stage, pattern, payload, compute, hide, k,
                             int(fast["global_batch"] // fast["world_size"]), source)  # fmt: skip
    return out


def repeats_in(netem_paths: list[str]) -> int:
    """The most repeats any of the files measured its points (``bench.netem --repeats``)."""
    return max((json.loads(_resolve(p).read_text()).get("repeats") or 1 for p in netem_paths),
               default=1)  # fmt: skip


def load_profiles(netem_paths: list[str], repeat: int | None = None) -> tuple[dict, float]:
    """recipe key -> stage -> :class:`Profile`, each recipe from the file the report took its
    speeds from (the last that measured it), and the reference machine speed (compute-only
    samples/s of the first file's fastest row). A point measured several times is taken at
    its repeats combined (:func:`pipeline.reports.timing.combine_repeats`), or with
    ``repeat`` at that repeat alone (a file measured once is the same at every repeat)."""
    files = [(p, json.loads(_resolve(p).read_text())) for p in netem_paths]
    if repeat is None:
        files = [(p, {**f, "results": combine_repeats(f["results"])}) for p, f in files]
    else:
        files = [(p, {**f, "results": [r for r in f["results"]
                                       if r.get("repeat", repeat) == repeat]})
                 for p, f in files]  # fmt: skip
    first_rows = sorted(files[0][1]["results"], key=lambda r: r["bandwidth_mbit"])
    reference = first_rows[-1].get("compute_only_samples_per_s")
    out: dict[str, dict] = {}
    for path, netem in files:
        keys = {k for r in netem["results"] for k in r.get("runs", {})}
        for key in sorted(keys):
            out[key] = profiles_of(netem["results"], path, key, reference)
    return out, reference


def _resolve(path: str) -> Path:
    """A netem path as a report records it: relative to where the report was made, which is
    the repository root for every report in it."""
    return Path(path) if Path(path).is_file() else REPO / path


def profile_key(strategy: str | None) -> str | None:
    return None if strategy is None else strategy.partition(":")[0]
