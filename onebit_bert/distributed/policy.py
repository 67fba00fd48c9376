"""Which codec each kind of traffic travels with, and the node hierarchy.

The ``comm`` config section::

    comm:
      compression: {grad: int8, momentum: onebit, outer: bf16, neighbour: none, stats: none}
      hierarchy: node          # flat (default) or node

Kinds of traffic (the communicator's names in brackets):

- ``grad`` (``gradients``): the full-precision gradient average of LAMB/AdamW and of the
  warmup of 1-bit LAMB and 1-bit Adam (and 0/1 Adam's variance steps);
- ``momentum`` (``momentum``): the compressed momentum all-reduce of 1-bit LAMB and 1-bit
  Adam after ``freeze_step``;
- ``outer`` (``parameters``): the parameter average of CO2, SlowMo and local SGD (a lossy
  codec sends each rank's progress since the round's anchor, not the parameters);
- ``neighbour`` (``neighbour``): DecentLaM's and DmSGD's exchanges with neighbours;
- ``stats`` (``statistics``): losses, counters, stop flags: never compressed.

The defaults (``grad: none, momentum: onebit``, the rest ``none``, ``hierarchy: flat``)
are today's behaviour bit for bit. Seed 001 (arXiv 2409.02423) is the reason for the
split: compressing every collective at the same intensity hurt its loss, compressing each
kind at its own did not.

**Hierarchy** (``hierarchy: node``): ranks on one node average among themselves in full
precision first (reduce-scatter: each local rank ends with the node's mean of 1/L of the
buffer), then the ranks with the same local rank average their slice across nodes with
the kind's codec, then each node all-gathers its slices. Only the middle phase crosses the
network; it carries 1/L of the buffer per rank. Node membership comes from the launcher
(torchrun's ``LOCAL_WORLD_SIZE``, SLURM's tasks per node); ranks must be numbered node by
node (rank = node x L + local rank), as both launchers do by default. Bytes the
intra-node phases send are counted apart (``comm_bytes_intra_node``), so ``comm_bytes``
is what crosses node boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from onebit_bert.distributed.codecs import CODECS, Codec, accepted_codecs, build_codec
from onebit_bert.distributed.traffic import POLICY_KINDS

# Which kinds accept which codec is each codec's ``serves`` (:data:`CODECS`): powersgd needs
# gradient matrices; a parameter average in 1 bit means nothing; neighbour exchanges send
# whole parameter vectors with no error memory, so only the 16-bit formats; statistics are
# a few numbers that decide control flow.


@dataclass
class CompressionConfig:
    """The codec of each kind of traffic: any registered codec
    (:data:`~onebit_bert.distributed.codecs.CODECS`) that serves the kind."""

    grad: str = "none"
    """Full-precision gradient averages (LAMB, AdamW, the warmup of 1-bit LAMB/Adam): none,
    bf16, fp16, int8, int4, onebit (one scale per chunk of the bucket), onebit_tensor (1 bit
    with every tensor compressed on its own, DeepSpeed's scales) or powersgd."""
    momentum: str = "onebit"
    """1-bit LAMB's and 1-bit Adam's momentum all-reduce after freeze_step, and 0/1 Adam's
    1-bit gradient and momentum averages: onebit (the algorithm: one fused buffer whose
    layers are scaled by coefficients from the momentum), onebit_tensor (each layer
    compressed on its own with its own scales, as DeepSpeed does), or int8, bf16, fp16,
    none to study what 1 bit costs."""
    outer: str = "none"
    """CO2/SlowMo/local SGD/DiLoCo parameter averages (a lossy codec sends each rank's
    progress over the round, the pseudo-gradient): none, bf16, fp16, int8 or int4."""
    neighbour: str = "none"
    """DecentLaM/DmSGD neighbour exchanges: none, bf16 or fp16 (the neighbours' copies are
    rounded; each rank's own term stays exact)."""
    stats: str = "none"
    """Losses, counters and flags: always none."""

    def __post_init__(self):
        for key in POLICY_KINDS:
            value = getattr(self, key)
            allowed = accepted_codecs(key)
            if value not in CODECS:
                raise ValueError(
                    f"comm.compression.{key}: unknown codec {value!r}; choose one of "
                    f"{', '.join(allowed)}"
                )
            if value not in allowed:
                raise ValueError(
                    f"comm.compression.{key} cannot be {value!r}: {key} traffic takes "
                    f"{', '.join(allowed)}"
                )

    def is_default(self, key: str) -> bool:
        """Whether ``key`` keeps today's behaviour."""
        return getattr(self, key) == getattr(CompressionConfig, key)


@dataclass
class CommConfig:
    """How the ranks' traffic is compressed and routed."""

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    hierarchy: Literal["flat", "node"] = "flat"
    """flat: every collective spans all ranks; node: full precision inside a node,
    the kind's codec between nodes (module docstring); with co2, slowmo and local_sgd,
    each node is one worker (its ranks average gradients every step)."""
    int8_block: int = 1024
    """int8: elements per fp32 scale."""
    int4_block: int = 128
    """int4: elements per fp32 scale (even)."""
    powersgd_rank: int = 4
    """powersgd: rank of the gradient approximation."""
    powersgd_start_step: int = 10
    """powersgd: steps averaged in fp32 before compression starts (>= 2)."""
    overlap: bool = False
    """1-bit LAMB and 1-bit Adam after freeze_step: start each bucket's momentum update and
    compressed all-reduce during the last micro-batch's backward, as soon as the bucket's
    gradients are complete (same numbers as without, in the same buckets, except
    clipping: with clip_grad_norm > 0 each bucket is clipped by the norm estimated when it
    is sent, exact with one bucket)."""
    bucket_mb: float = 25.0
    """overlap: momentum buckets of about this many MB (fp32) where optimizer.bucket_numel
    does not set them (without overlap, that default is one bucket)."""

    def __post_init__(self):
        if self.int8_block < 1:
            raise ValueError(f"comm.int8_block must be >= 1, got {self.int8_block}")
        if self.int4_block < 2 or self.int4_block % 2:
            raise ValueError(f"comm.int4_block must be an even number >= 2, got {self.int4_block}")
        if self.powersgd_rank < 1:
            raise ValueError(f"comm.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_step < 2:
            raise ValueError(
                f"comm.powersgd_start_step must be >= 2, got {self.powersgd_start_step}"
            )
        if not self.bucket_mb > 0:
            raise ValueError(f"comm.bucket_mb must be > 0, got {self.bucket_mb}")
        overlapping = CODECS.names(lambda spec: spec.overlaps)
        if self.overlap and (
            self.hierarchy == "node" or self.compression.momentum not in overlapping
        ):
            raise ValueError(
                "comm.overlap overlaps the momentum codec's buckets with the backward pass: it "
                f"needs comm.compression.momentum {' or '.join(overlapping)} and "
                "comm.hierarchy flat"
            )
        if self.hierarchy == "node" and self.compression.grad == "powersgd":
            raise ValueError(
                "comm.compression.grad powersgd factorises whole gradient matrices and cannot "
                "run on the per-node slices of comm.hierarchy node; use hierarchy flat"
            )

    @property
    def is_default(self) -> bool:
        """Today's behaviour: default codecs, flat, no overlap."""
        return (
            all(self.compression.is_default(k) for k in POLICY_KINDS)
            and self.hierarchy == "flat"
            and not self.overlap
        )


def node_layout(rank: int, world_size: int, local_rank: int, local_world_size: int) -> int:
    """The number of nodes, after checking that ranks are numbered node by node."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"comm.hierarchy node: {world_size} ranks do not split into nodes of "
            f"{local_world_size} (LOCAL_WORLD_SIZE or SLURM's tasks per node); launch the "
            f"same number of ranks on every node"
        )
    if rank % local_world_size != local_rank:
        raise ValueError(
            f"comm.hierarchy node needs ranks numbered node by node (rank = node x "
            f"{local_world_size} + local rank), but rank {rank} has local rank {local_rank}; "
            f"use torchrun, or srun with --distribution=block"
        )
    return world_size // local_world_size


class NodeGroups:
    """The communicators of the hierarchy: ``intra`` over this node's ranks (its counts
    kept apart, in ``intra.stats``) and ``inter`` over the ranks with this local rank on
    every node (counted with the parent's stats). Collective: every rank builds it, in
    the same order."""

    def __init__(self, comm, local_rank: int, local_world_size: int):
        from onebit_bert.distributed.comm import Communicator

        nodes = node_layout(comm.rank, comm.world_size, local_rank, local_world_size)
        self.local_world_size = local_world_size
        self.nodes = nodes
        ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else [0]
        intra = inter = None
        # every rank creates every group, in the same order (new_group is collective)
        for node in range(nodes):
            members = [ranks[node * local_world_size + i] for i in range(local_world_size)]
            group = dist.new_group(members) if comm.group is not None else None
            if node == comm.rank // local_world_size:
                intra = group
        for local in range(local_world_size):
            members = [ranks[node * local_world_size + local] for node in range(nodes)]
            group = dist.new_group(members) if comm.group is not None else None
            if local == local_rank:
                inter = group
        self.intra = Communicator(intra if local_world_size > 1 else None, comm.device)
        self.intra.stats = comm.intra_stats
        self.inter = Communicator(inter if nodes > 1 else None, comm.device)
        self.inter.stats = comm.stats


class HierarchicalCodec(Codec):
    """A codec applied between nodes only (module docstring): full-precision
    reduce-scatter inside the node, ``inner`` (built over ``groups.inter``) on this local
    rank's slice, all-gather inside the node."""

    def __init__(self, comm, groups: NodeGroups, inner: Codec):
        super().__init__(comm)
        self.groups = groups
        self.inner = inner
        self.name = f"{inner.name}/node"

    overlaps_fused = False

    @property
    def lossy(self) -> bool:
        return self.inner.lossy

    def _padded_size(self, numel: int) -> int:
        """The elements averaged: ``numel`` zero-padded to a multiple of the node's ranks."""
        local = self.groups.intra.world_size
        return -(-numel // local) * local

    def all_reduce(self, tensors, key: str, last: bool = True) -> None:
        """Average ``tensors`` (module docstring); one contiguous fp32 tensor whose size
        the node's ranks divide (a DDP bucket's buffer, say) is averaged where it is,
        the others through a zero-padded copy of them all."""
        if self.comm.alone or not tensors:
            return
        if len(tensors) == 1:
            t = tensors[0]
            if (
                t.dtype == torch.float32
                and t.is_contiguous()
                and self._padded_size(t.numel()) == t.numel()
            ):
                self._average(t.view(-1), key, last)
                return
        flat = self._flatten(tensors)
        numel = flat.numel()
        padded = torch.zeros(self._padded_size(numel), dtype=torch.float32, device=flat.device)
        padded[:numel] = flat
        self._average(padded, key, last)
        self._unflatten(padded[:numel], tensors)

    def all_reduce_fused(
        self, buffer: torch.Tensor, numel: int, key: str, sizes=()
    ) -> torch.Tensor | None:
        """:meth:`all_reduce` of ``buffer[:numel]`` without its three copies of the whole
        buffer: the reduce-scatter reads the fused buffer where it is and the all-gather
        writes the average back there (the buffer's zero padding stands in for the
        copy's; it is zeroed again after). The same numbers; where the buffer is too short
        to hold the padding, :meth:`all_reduce` as before."""
        if self.comm.alone or numel == 0:
            return None
        size = self._padded_size(numel)
        if buffer.numel() < size or buffer.dtype != torch.float32 or not buffer.is_contiguous():
            return super().all_reduce_fused(buffer, numel, key, sizes)
        region = buffer[:size]
        region[numel:].zero_()
        self._average(region, key, last=True)
        region[numel:].zero_()  # the inner codec's average of the padding
        return None

    def _average(self, padded: torch.Tensor, key: str, last: bool) -> None:
        """In place: every rank's ``padded`` (flat fp32, a multiple of the node's ranks)
        replaced by its mean over all ranks: the node's mean of this rank's slice
        (reduce-scatter), that slice averaged across nodes by the inner codec, then the
        slices gathered inside the node."""
        intra = self.groups.intra
        mine = torch.empty(
            padded.numel() // intra.world_size, dtype=torch.float32, device=padded.device
        )
        kind = self.comm.kind  # the caller's kind of traffic, on all three communicators
        with intra.traffic(kind), self.inner.comm.traffic(kind):
            intra.reduce_scatter(mine, padded)
            self.inner.all_reduce([mine], key, last=last)
            intra.all_gather(padded, mine)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class CommPolicy:
    """The codec of every kind of traffic for one run (built once per communicator)."""

    def __init__(self, cfg: CommConfig, comm, local_rank: int = 0, local_world_size: int = 1):
        self.cfg = cfg
        self.comm = comm
        self.groups: NodeGroups | None = None
        if cfg.hierarchy == "node" and comm.world_size > 1:
            self.groups = NodeGroups(comm, local_rank, local_world_size)
        self._codecs: dict[str, Codec] = {}

    def codec_name(self, key: str) -> str:
        return getattr(self.cfg.compression, key)

    def codec(self, key: str, comm=None) -> Codec:
        """The codec for config key ``key`` (grad, momentum, outer, neighbour), over
        ``comm`` (default: the run's communicator), with the hierarchy applied."""
        cache_key = f"{key}@{id(comm)}"
        if cache_key not in self._codecs:
            comm = comm or self.comm
            name = self.codec_name(key)
            kwargs = dict(
                int8_block=self.cfg.int8_block,
                int4_block=self.cfg.int4_block,
                powersgd_rank=self.cfg.powersgd_rank,
                powersgd_start_step=self.cfg.powersgd_start_step,
            )
            if self.groups is not None and key in ("grad", "momentum"):
                inner = build_codec(name, self.groups.inter, **kwargs)
                codec = HierarchicalCodec(comm, self.groups, inner)
            else:
                codec = build_codec(name, comm, **kwargs)
            self._codecs[cache_key] = codec
        return self._codecs[cache_key]
