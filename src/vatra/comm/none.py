"""``none``: the gradient as it is (fp32), summed by an all-reduce — the baseline every ratio uses."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload


class NoCompression(Compressor):
    summable = True
    lossless = True

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        return [tensor.reshape(-1)], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0].view(ctx.shape)
