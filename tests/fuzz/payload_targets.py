"""Fuzz target for what another rank sends in 1-bit Adam's exchange: a compressor's payload.

A receiver cuts the bytes it got into tensors shaped like its own payload of the same tensor
(``vatra.comm.batching.unpack_bytes``), so a peer controls their bytes, not their sizes. The first
byte picks the decoder (the fp4 and fp8 warm-up's, block top-k's with fp8 or fp16 values) and the
shape; the rest fills the payload tensors in order (repeated or cut to their sizes).

Property: ``decompress`` returns a tensor of the receiver's shape (any value, NaN included: training
treats a non-finite gradient as such) or raises ValueError, nothing else.
"""

from __future__ import annotations

import torch
from tests.fuzz._harness import Target

from vatra.comm._base import Compressor
from vatra.comm.batching import pack_bytes, unpack_bytes
from vatra.comm.minifloat import Fp4Blocks, Fp8Rows
from vatra.comm.topk import TopK


def _block_topk(value_dtype: torch.dtype) -> TopK:
    topk = TopK(0.05)
    topk.block, topk.value_dtype = 256, value_dtype
    return topk


def _fp4() -> Fp4Blocks:
    fp4 = Fp4Blocks()
    fp4.generator = torch.Generator().manual_seed(0)
    return fp4


DECODERS: list[Compressor] = [_fp4(), Fp8Rows(), _block_topk(torch.float8_e4m3fn), _block_topk(torch.float16)]
SHAPES = [(37, 29), (5,), (300,), (2, 3, 4)]
_REF = torch.linspace(-1.0, 1.0, 1073)  # values to build the receiver's own payloads from


def _own(comp: Compressor, shape: tuple[int, ...]) -> tuple[list[torch.Tensor], object]:
    n = torch.Size(shape).numel()
    return comp.compress(_REF[:n].reshape(shape))


def payload_one_input(data: bytes) -> None:
    if not data:
        return
    comp = DECODERS[data[0] % len(DECODERS)]
    shape = SHAPES[(data[0] // len(DECODERS)) % len(SHAPES)]
    like, ctx = _own(comp, shape)
    size = sum(t.numel() * t.element_size() for t in like)
    body = (data[1:] or b"\x00") * (size // max(1, len(data) - 1) + 1)
    parts = unpack_bytes(torch.frombuffer(bytearray(body[:size]), dtype=torch.uint8), like)
    try:
        out = comp.decompress(parts, ctx)  # type: ignore[arg-type]
    except ValueError:
        return
    assert out.shape == torch.Size(shape), (out.shape, shape)


def _seeds() -> list[bytes]:
    seeds = []
    for i, comp in enumerate(DECODERS):
        for j, shape in enumerate(SHAPES):
            like, _ = _own(comp, shape)
            seeds.append(bytes([i + j * len(DECODERS)]) + pack_bytes(like).numpy().tobytes())
    return seeds


PAYLOAD = Target("payload", payload_one_input, _seeds, [b"\x00" * 4, b"\xff" * 4, b"\x7f\x80", b"\x7f\xc0"])
