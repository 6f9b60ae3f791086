"""``onebit``: one sign bit per element (packed 8 to a byte) and fp32 scales, mean |x| (1-bit SGD)."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload, pack_bits, unpack_bits
from vatra.config._comm import CommConfig

__all__ = ["OneBit", "pack_bits", "unpack_bits"]


class OneBit(Compressor):
    """Sign bits and mean |x| as the magnitude: one scale per tensor (1-bit SGD, EF-SignSGD), or with
    ``scale = "row"`` one per row of a matrix (per output unit of a linear layer).

    Why rows: in a ReLU network a unit that was inactive on the batch has an all-zero gradient row. A
    per-tensor scale sends ±mean|x| there every step (error feedback then cancels it out over time,
    as noise the optimizer sees); a per-row scale sends exactly 0 for that row, and rows with larger
    gradients get larger steps. Costs 4 bytes per row (1.6 % on top of the bits of a 2048-wide row).
    """

    dense_share = 0.25  # with the LR warm-up only it ended 1.8 points behind (synthetic, gpt_text)

    def __init__(self, scale: str = "tensor") -> None:
        self.scale = scale

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls(cfg.onebit_scale)

    def _rows(self, shape: torch.Size) -> int:
        return shape[0] if self.scale == "row" and len(shape) >= 2 else 1

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        rows = tensor.reshape(self._rows(tensor.shape), -1)  # (R, n/R)
        scale = rows.abs().mean(dim=1).to(torch.float32)  # (R,)
        return [pack_bits(rows.reshape(-1) >= 0), scale], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scale = payload
        signs = unpack_bits(packed, ctx.numel).to(ctx.dtype) * 2 - 1  # {0, 1} → {-1, +1}
        rows = signs.view(scale.numel(), -1) * scale.to(ctx.dtype).unsqueeze(1)  # (R, n/R)
        return rows.view(ctx.shape)
