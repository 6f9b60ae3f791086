"""``topk``: the ⌈ratio·n⌉ largest-magnitude elements as (int32 index, value) pairs."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload, keep_count, register, scatter_sparse
from vatra.config._comm import CommConfig


@register
class TopK(Compressor):
    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls(cfg.ratio)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1)
        k = keep_count(flat.numel(), self.ratio)
        _, indices = flat.abs().topk(k, sorted=False)
        return [indices.to(torch.int32), flat[indices]], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        indices, values = payload
        return scatter_sparse(values, indices, ctx)
