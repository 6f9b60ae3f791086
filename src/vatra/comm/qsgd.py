"""``qsgd``: stochastic rounding of |x|/‖x‖ to s levels, sent as signed int8 plus fp32 norms (unbiased).

One norm per bucket of ``comm.qsgd_bucket`` elements (Alistarh et al. 2017, §5: buckets of 512): the
variance of a quantised coordinate grows with the bucket's length d over s² (min(d/s², √d/s)·‖x‖²), so
one norm over a whole 65,536-element matrix rounds almost every coordinate to 0 or to a ±‖x‖/s spike.
A norm per 512 elements costs 4 bytes per 512 (0.8 % on top of the int8 levels).
"""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload
from vatra.config._comm import CommConfig


class QSGD(Compressor):
    error_feedback = False  # unbiased; ‖x − Q(x)‖ can exceed ‖x‖ (d/s² > 1), so a residual would diverge
    stochastic = True

    def __init__(self, levels: int = 127, bucket: int = 512) -> None:
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be in 1..127 (int8 on the wire), got {levels}")
        if bucket < 0:
            raise ValueError(f"qsgd bucket must be ≥ 0 elements (0 = one norm per tensor), got {bucket}")
        self.levels = levels
        self.bucket = bucket

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls(cfg.levels, cfg.qsgd_bucket)

    def _buckets(self, numel: int) -> tuple[int, int]:
        """(number of buckets, elements per bucket); the last one is zero-padded."""
        size = self.bucket if 0 < self.bucket < numel else max(numel, 1)
        return -(-numel // size), size

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1).float()
        count, size = self._buckets(flat.numel())
        padded = torch.zeros(count * size, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        rows = padded.view(count, size)  # (B, size)
        norms = rows.norm(dim=1)  # (B,)
        tiny = torch.finfo(torch.float32).tiny
        scaled = rows.abs() / norms.clamp_min(tiny).unsqueeze(1) * self.levels  # in [0, s]
        lower = scaled.floor()
        draw = torch.rand(scaled.shape, generator=self.generator, dtype=scaled.dtype, device=scaled.device)
        level = lower + (draw < scaled - lower).float()  # E[level] = scaled
        q = (level * rows.sign()).to(torch.int8).reshape(-1)[: flat.numel()]
        return [q, norms], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        q, norms = payload
        _, size = self._buckets(ctx.numel)
        per = (norms / self.levels).repeat_interleave(size)[: ctx.numel]  # (n,)
        return (q.float() * per).to(ctx.dtype).view(ctx.shape)
