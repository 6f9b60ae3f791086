"""``randomk``: ⌈ratio·n⌉ elements drawn uniformly without replacement, sent as they are.

Not rescaled by n/k: the unbiased variant multiplies the dropped mass by n/k and makes error
feedback diverge; unscaled random-k with error feedback delivers every element eventually.
"""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload, keep_count, register, scatter_sparse
from vatra.config._comm import CommConfig


@register
class RandomK(Compressor):
    name = "randomk"

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls(cfg.ratio)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = keep_count(n, self.ratio)
        indices = torch.randperm(n, device=flat.device)[:k]
        return [indices.to(torch.int32), flat[indices]], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        indices, values = payload
        return scatter_sparse(values, indices, ctx)
