"""The trained parameters as one flat fp32 vector, for strategies that send, average or
update the whole model at once (local steps, decentralised training)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class FlatParams:
    """The trained parameters as one flat fp32 vector: copies in and out, and per-tensor
    views of any vector of the same layout."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.device = params[0].device

    def empty(self) -> torch.Tensor:
        """An uninitialised flat fp32 vector of this layout."""
        return torch.empty(self.numel, dtype=torch.float32, device=self.device)

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' current values (into ``out`` if given)."""
        out = self.empty() if out is None else out
        torch.cat([p.detach().reshape(-1).float() for p in self.params], out=out)
        return out

    def read_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' gradients (zero where a parameter has none), into ``out`` if
        given."""
        out = self.empty() if out is None else out
        for p, view in zip(self.params, self.views(out), strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        return out

    def write(self, flat: torch.Tensor, params: list[torch.Tensor] | None = None) -> None:
        """Set ``params`` (default: the trained parameters) from ``flat``."""
        with torch.no_grad():
            for p, view in zip(params or self.params, self.views(flat), strict=True):
                p.copy_(view.view_as(p))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor's part of ``flat`` (views, in parameter order)."""
        return list(torch.split(flat, self.sizes))

    def norms(self, flat: torch.Tensor) -> torch.Tensor:
        """The L2 norm of every tensor's part of ``flat``."""
        return torch.stack(torch._foreach_norm(self.views(flat)))

    def expand(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """A per-tensor value repeated over that tensor's elements."""
        sizes = torch.tensor(self.sizes, device=per_tensor.device)
        return per_tensor.repeat_interleave(sizes)


class AverageModel:
    """A frozen copy of a model whose trained parameters are set from a flat vector (the
    ranks' average), kept until the key it was made for changes."""

    def __init__(self, model: nn.Module, flat: FlatParams):
        self.model = model
        self.flat = flat
        self.copy: nn.Module | None = None
        self.key: int | None = None

    def current(self, key: int) -> nn.Module | None:
        """The copy made for ``key``, or None."""
        return self.copy if self.copy is not None and self.key == key else None

    def set(self, mean: torch.Tensor, key: int) -> nn.Module:
        """The copy with its trained parameters set from ``mean``, made for ``key``."""
        if self.copy is None:
            self.copy = copy.deepcopy(self.model)
            self.copy.requires_grad_(False)
        pairs = zip(self.copy.parameters(), self.model.parameters(), strict=True)
        self.flat.write(mean, [c for c, p in pairs if p.requires_grad])
        self.key = key
        return self.copy

    def forget(self) -> None:
        """Make the next :meth:`current` miss (after a state change)."""
        self.key = None
