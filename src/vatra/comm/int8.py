"""``int8``: symmetric int8 with one fp32 scale per row (amax / 127), deterministic rounding.

A matrix's rows are a linear layer's output units, as torchao's per-row weight scales; a 1-D tensor
is one row. 1 byte per element plus 4 per row: a (256, 64) weight travels in 17,408 bytes instead of
65,536 (3.8× smaller). Rounding to nearest is biased, so error feedback carries what it dropped.
"""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload

INT8_MAX = 127.0  # symmetric: -127..127, so a row's amax maps to ±127 exactly


def quantize_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values of ``tensor``'s shape, fp32 scale per row): row = the first dimension of a matrix."""
    rows = tensor.detach().float().reshape(tensor.shape[0] if tensor.dim() >= 2 else 1, -1)  # (R, n/R)
    scale = rows.abs().amax(dim=1) / INT8_MAX  # (R,)
    q = torch.round(rows / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8).view(tensor.shape), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 tensor of ``q``'s shape: each row's int8 values times its scale."""
    rows = q.float().reshape(scale.numel(), -1) * scale.float().unsqueeze(1)  # (R, n/R)
    return rows.view(q.shape)


class Int8(Compressor):
    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        q, scale = quantize_rows(tensor)
        return [q.reshape(-1), scale], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        q, scale = payload
        if q.numel() != ctx.numel or q.dtype != torch.int8:
            raise ValueError(f"int8 payload of {q.numel()} {q.dtype} values for a tensor of {ctx.numel}")
        rows = ctx.shape[0] if len(ctx.shape) >= 2 else 1
        if scale.numel() != rows:
            raise ValueError(f"int8 payload has {scale.numel()} scales for {rows} rows")
        return dequantize_rows(q.view(ctx.shape), scale).to(ctx.dtype)
