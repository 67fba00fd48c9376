"""PowerSGD (Vogels et al., 2019) through PyTorch's own DDP hook, as a codec."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from onebit_bert.distributed.codecs.base import Codec

HOOK_SETTINGS = {"use_error_feedback": True, "warm_start": True, "random_seed": 0}
"""How every run sets up PyTorch's hook: error feedback and warm start on, one seed on
every rank (the hook's random projections must agree)."""


class _Bucket:
    """What PyTorch's PowerSGD hook reads from a DDP ``GradBucket``, for a list of
    gradient tensors outside DDP: a flat buffer and per-tensor views of it."""

    def __init__(self, index: int, tensors: Sequence[torch.Tensor], is_last: bool):
        self._index = index
        self._is_last = is_last
        self._buffer = torch.cat([t.reshape(-1) for t in tensors])
        self._grads = []
        offset = 0
        for t in tensors:
            self._grads.append(self._buffer[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)


class PowerSGDCodec(Codec):
    """PowerSGD (Vogels et al., 2019) by PyTorch's own DDP hook
    (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``): every gradient
    matrix worth it (``_should_compress``: compressed size x ``min_compression_rate`` <
    its size) travels as rank-``rank`` factors, the rest in fp32; error feedback and warm
    start on. The hook all-reduces through ``torch.distributed`` itself, so its bytes are
    counted here from the same decision the hook makes (the hook's own ``_should_compress``
    on each tensor): 2 (p - 1) / p x 4 bytes x (uncompressed elements + P + Q elements),
    and the whole buffer before ``start_step``. Gradients only: it needs each tensor's
    shape, and is a biased compressor meant for gradients."""

    name = "powersgd"

    def __init__(self, comm, rank: int = 4, start_step: int = 10, min_compression_rate=2.0):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

        super().__init__(comm)
        if rank < 1:
            raise ValueError(f"comm.powersgd_rank must be >= 1, got {rank}")
        if comm.device.type == "cpu" and torch.cuda.is_available():
            # torch's hook synchronises CUDA on the tensors' device whenever CUDA exists
            raise RuntimeError(
                "comm.compression.grad=powersgd on CPU tensors fails inside PyTorch's "
                "PowerSGD hook on a machine with CUDA: train on the GPU, or hide it with "
                "CUDA_VISIBLE_DEVICES="
            )
        if start_step < 2:
            raise ValueError(
                f"comm.powersgd_start_step must be >= 2 (the hook's error feedback and warm "
                f"start need a full-precision first step), got {start_step}"
            )
        self.hook = hook
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.state = (
            hook.PowerSGDState(
                process_group=comm.group,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=start_step,
                min_compression_rate=min_compression_rate,
                **HOOK_SETTINGS,
            )
            if not comm.alone
            else None
        )
        self._buckets: dict[str, int] = {}

    def _wire_elements(self, tensors: Sequence[torch.Tensor]) -> int:
        if self.state.iter < self.state.start_powerSGD_iter:
            return sum(t.numel() for t in tensors)
        total = 0
        for t in tensors:
            n = t.shape[0] if t.dim() else 1
            m = t.numel() // max(n, 1)
            r = min(n, m, self.rank)
            compress, plain, packed = self.hook._should_compress(n, m, r, self.min_compression_rate)
            total += packed if compress else plain
        return total

    def all_reduce(self, tensors: Sequence[torch.Tensor], key: str, last: bool = True) -> None:
        if self.comm.alone or not tensors:
            return
        index = self._buckets.setdefault(key, len(self._buckets))
        bucket = _Bucket(index, tensors, last)
        result = self.run_hook(bucket)
        self._unflatten(result, tensors)

    def average_bucket(self, bucket) -> None:
        """DDP's own bucket through the hook (it needs each gradient's shape)."""
        bucket.buffer().copy_(self.run_hook(bucket))

    def run_hook(self, bucket) -> torch.Tensor:
        """PyTorch's hook on one bucket (a DDP ``GradBucket`` or :class:`_Bucket`), waited,
        with its bytes counted; returns the averaged flat buffer."""
        p = self.comm.world_size
        nbytes = 2 * (p - 1) * 4 * self._wire_elements(bucket.gradients()) // p
        with self.comm.external(nbytes):
            result = self.hook.powerSGD_hook(self.state, bucket).wait()
        return result[0] if isinstance(result, list) else result

    def state_dict(self) -> dict:
        if self.state is None:
            return {}
        st = self.state
        kind, keys, pos, has_gauss, cached = st.rng.get_state()
        return {
            "iter": st.iter,
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            "error": {int(k): v.clone() for k, v in st.error_dict.items()},
            "p": {int(k): v.clone() for k, v in st.p_memory_dict.items()},
            "q": {int(k): v.clone() for k, v in st.q_memory_dict.items()},
            "buckets": dict(self._buckets),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.state is None or not state:
            return
        st = self.state
        st.iter = int(state["iter"])
        rng = state["rng"]
        st.rng.set_state(
            (
                "MT19937",
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["cached"],
            )
        )
        device = self.comm.device
        st.error_dict = {k: v.to(device) for k, v in state["error"].items()}
        st.p_memory_dict = {k: v.to(device) for k, v in state["p"].items()}
        st.q_memory_dict = {k: v.to(device) for k, v in state["q"].items()}
        self._buckets = dict(state["buckets"])
