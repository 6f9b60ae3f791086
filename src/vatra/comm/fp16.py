"""``fp16``: half-precision values, summed in fp16 by the all-reduce (2× fewer bytes)."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload


class FP16(Compressor):
    summable = True
    wire_dtype = torch.float16

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        return [tensor.reshape(-1).to(self.wire_dtype)], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0].to(ctx.dtype).view(ctx.shape)
