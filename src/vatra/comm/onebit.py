"""``onebit``: one sign bit per element (packed 8 to a byte) and one fp32 scale, mean |x| (1-bit SGD)."""

from __future__ import annotations

import torch

from vatra.comm._base import Compressor, Ctx, Payload, register

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)  # bit 7 first


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool tensor (n,) → uint8 tensor (⌈n/8⌉,), most significant bit first."""
    n = bits.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    return (padded.view(-1, 8) << _SHIFTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)  # (n/8,)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 (⌈n/8⌉,) → bool (n,)."""
    bits = (packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1  # (n/8, 8)
    return bits.reshape(-1)[:n].bool()


@register
class OneBit(Compressor):
    name = "onebit"

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().to(torch.float32).reshape(1)
        return [pack_bits(flat >= 0), scale], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scale = payload
        signs = unpack_bits(packed, ctx.numel).to(ctx.dtype) * 2 - 1  # {0, 1} → {-1, +1}
        return (signs * scale.to(ctx.dtype)).view(ctx.shape)
