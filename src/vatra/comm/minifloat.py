"""Minifloat compressors for 1-bit Adam's warm-up (``comm.warmup_precision``): the gradients'
average in float8 with a scale per row (:class:`Fp8Rows`) or float4 with a scale per block of 32
(:class:`Fp4Blocks`), sent through the two-sided exchange without error feedback."""

from __future__ import annotations

import torch

from vatra.comm._base import FP8_MAX, Compressor, Ctx, Payload

__all__ = ["FP4_BLOCK", "FP4_LEVELS", "Fp4Blocks", "Fp8Rows"]


class Fp8Rows(Compressor):
    """float8 (e4m3) with an fp32 scale per row (amax / 448): the warm-up's gradients. One byte a
    value like int8, but a value keeps ~6 % relative precision down to ~10⁻⁵ of its row's largest,
    where int8 rounds everything under 1/254 of it to 0: Adam's v of a coordinate whose gradients
    stay small would be 0, and its update after the freeze clipped to Adam's largest."""

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        rows = tensor.detach().float().reshape(tensor.shape[0] if tensor.dim() >= 2 else 1, -1)  # (R, n/R)
        scale = rows.abs().amax(dim=1) / FP8_MAX  # (R,)
        scaled = (rows / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)).clamp(
            -FP8_MAX, FP8_MAX
        )
        return [scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1), scale], Ctx(
            tensor.shape, tensor.dtype
        )

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        q, scale = payload
        rows = ctx.shape[0] if len(ctx.shape) >= 2 else 1
        if q.numel() != ctx.numel or q.dtype != torch.uint8 or scale.numel() != rows:
            raise ValueError(f"fp8 payload of {q.numel()} {q.dtype} values and {scale.numel()} scales "
                             f"for a tensor of {ctx.numel} in {rows} rows")  # fmt: skip
        values = q.view(torch.float8_e4m3fn).float().reshape(rows, -1) * scale.float().unsqueeze(1)
        return values.view(ctx.shape).to(ctx.dtype)


FP4_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # float4 e2m1's magnitudes
FP4_BLOCK = 32  # values per scale (as OCP's MXFP4)


class Fp4Blocks(Compressor):
    """float4 (e2m1: ±0, 0.5, 1, 1.5, 2, 3, 4, 6) with a bf16 scale per block of 32 values, two
    values a byte: ~0.56 bytes a value, 56 % of :class:`Fp8Rows`'s. Rounding is stochastic (up with
    the probability that makes it unbiased), so a coordinate whose gradients stay under its block's
    smallest step still reaches Adam's v, overestimated rather than 0 (with round-to-nearest its v̂
    would be 0 and its update after the freeze clipped to Adam's largest). Draws from
    :attr:`generator` (one per rank, seeded per tensor and step by the hook)."""

    stochastic = True

    def __init__(self) -> None:
        self.levels = torch.tensor(FP4_LEVELS)

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.detach().float().reshape(-1)
        n = flat.numel()
        blocks = torch.nn.functional.pad(flat, (0, -n % FP4_BLOCK)).view(-1, FP4_BLOCK)  # (B, 32)
        # bf16 rounds to within 2⁻⁸: scaled up by 2⁻⁷ first, every |value| / scale stays ≤ 6
        scale = (blocks.abs().amax(dim=1) * ((1 + 2**-7) / FP4_LEVELS[-1])).to(torch.bfloat16)  # (B,)
        safe = scale.float().clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
        mag = (blocks.abs() / safe).clamp_(max=FP4_LEVELS[-1]).reshape(-1)  # (B·32,)
        levels = self.levels.to(mag.device)
        low = torch.bucketize(mag, levels, right=True).sub_(1).clamp_(max=len(FP4_LEVELS) - 2)
        lo, hi = levels[low], levels[low + 1]
        up = torch.rand(mag.shape, generator=self.generator, device=mag.device) < (mag - lo) / (hi - lo)
        code = (low + up).to(torch.uint8) | (blocks.reshape(-1) < 0).to(torch.uint8) << 3  # (B·32,)
        packed = code[0::2] << 4 | code[1::2]  # (B·16,)
        return [packed[: -(-n // 2)], scale], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scale = payload
        n = ctx.numel
        blocks = -(-n // FP4_BLOCK)
        if packed.numel() != -(-n // 2) or packed.dtype != torch.uint8 or scale.numel() != blocks:
            raise ValueError(f"fp4 payload of {packed.numel()} {packed.dtype} bytes and {scale.numel()} "
                             f"scales for a tensor of {n}")  # fmt: skip
        code = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n].long()  # (n,)
        value = self.levels.to(code.device)[code & 7] * (1 - 2 * (code >> 3)).float()
        value = torch.nn.functional.pad(value, (0, blocks * FP4_BLOCK - n)).view(blocks, FP4_BLOCK)
        return (value * scale.float().unsqueeze(1)).reshape(-1)[:n].view(ctx.shape).to(ctx.dtype)
