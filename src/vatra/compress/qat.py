"""Quantization-aware training: Linear layers fake-quantized to int8 exactly as torchao's int8 kernel rounds.

The fake quantization reproduces torchao's ``Int8DynamicActivationInt8WeightConfig`` (symmetric
int8; weights one scale per output row, inputs one scale per row, both ``amax / 127.5``; values
``round(t * (1 / scale))``), so the model ``vatra edge export`` converts with torchao computes what
training saw. Gradients pass straight through the rounding (STE). The layers keep their
parameters (only ``forward`` changes), so DDP's buckets, the optimizer and checkpoints are untouched.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

INT8_HALF_RANGE = 127.5  # torchao's symmetric int8 scale: amax / ((127 - (-128)) / 2)


def fake_quant_int8(t: Tensor, dim: int) -> Tensor:
    """``t`` quantize-dequantized to int8 with one scale per slice along ``dim`` (its amax / 127.5);
    the gradient passes straight through."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).clamp_min(torch.finfo(torch.float32).eps)
    scale = amax / INT8_HALF_RANGE
    q = torch.round(t.detach() * (1.0 / scale)).clamp(-128, 127) * scale
    return t + (q - t).detach()


def _fake_quant_forward(self: nn.Linear, x: Tensor) -> Tensor:
    w = fake_quant_int8(self.weight, dim=1)  # (out, in): one scale per output row
    return nn.functional.linear(fake_quant_int8(x, dim=-1), w, self.bias)  # x (..., in): one per row


def prepare_qat(model: nn.Module) -> int:
    """Fake-quantize every Linear layer of ``model`` (in place); returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and "forward" not in module.__dict__:
            module.forward = types.MethodType(_fake_quant_forward, module)  # type: ignore[method-assign]
            n += 1
    return n


def is_prepared(model: nn.Module) -> bool:
    return any(type(m) is nn.Linear and "forward" in m.__dict__ for m in model.modules())


def remove_qat(model: nn.Module) -> None:
    """The float forward back on every fake-quantized Linear (what conversion starts from)."""
    for module in model.modules():
        if type(module) is nn.Linear and "forward" in module.__dict__:
            del module.forward
