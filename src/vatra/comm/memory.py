"""Error feedback: what compression dropped this step is added to the next step's gradient."""

from __future__ import annotations

from collections.abc import Hashable

import torch


class Memory:
    """Residual accumulation (EF-SGD): ``e ← (g + e) − decompress(compress(g + e))``.

    Keyed by the caller (the DDP hook uses ``(bucket.index(), position)``). A residual whose shape
    no longer matches (DDP rebuilds its buckets after the first step) is dropped, not misapplied.
    """

    def __init__(self) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def compensate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape:
            return tensor.clone()
        return tensor + residual

    def update(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        self.residuals[key] = compensated - transmitted

    def residual_norm(self) -> float:
        return float(sum(r.float().norm() ** 2 for r in self.residuals.values()) ** 0.5)


class NoMemory(Memory):
    """Error feedback off: nothing is remembered."""

    def compensate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        return None
