"""``qsgd``: stochastic rounding of |x|/‖x‖ to s levels, sent as signed int8 plus the fp32 norm (unbiased)."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload
from vatra.config._comm import CommConfig


class QSGD(Compressor):
    error_feedback = False  # unbiased; ‖x − Q(x)‖ can exceed ‖x‖ (d/s² > 1), so a residual would diverge
    stochastic = True

    def __init__(self, levels: int = 16) -> None:
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be in 1..127 (int8 on the wire), got {levels}")
        self.levels = levels

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls(cfg.levels)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1).float()
        norm = flat.norm().reshape(1)
        scaled = flat.abs() / norm.clamp_min(torch.finfo(torch.float32).tiny) * self.levels  # in [0, s]
        lower = scaled.floor()
        draw = torch.rand(scaled.shape, generator=self.generator, dtype=scaled.dtype, device=scaled.device)
        level = lower + (draw < scaled - lower).float()  # E[level] = scaled
        q = (level * flat.sign()).to(torch.int8)
        return [q, norm], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        q, norm = payload
        return (q.float() * (norm / self.levels)).to(ctx.dtype).view(ctx.shape)
