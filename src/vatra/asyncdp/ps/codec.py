"""How a shard's values travel between a worker and its server (``dist.ps_wire``).

A :class:`Codec` turns a flat fp32 shard into one byte buffer of a size fixed by the layout and back:

- ``fp32``: the raw values (the lossless wire);
- ``fp16`` / ``bf16``: cast to half, half the bytes;
- a ``vatra.comm`` compressor (``topk``, ``onebit``, ``randomk``, ``qsgd``, ``int8``, a user's class):
  each tensor of the shard compressed on its own (tensors under :data:`SMALL` elements go as fp32,
  as DGC leaves small tensors dense). Its payload sizes depend only on the tensor's shape (the
  :class:`~vatra.comm.Compressor` contract), so the receiver cuts the buffer with a probe's layout.

Error feedback, both ways: a worker adds what compression dropped from its last gradient to the next
(:class:`~vatra.comm.Memory`); a server sends each worker the change of the shard since the copy that
worker holds, ``C(params − copy)``, and both add the decoded change to their copy, so what a pull
dropped is sent with the next one. The fp32 wire sends the parameters themselves (a copy updated by
a difference would not equal them bit for bit).
"""

from __future__ import annotations

import torch

from vatra.comm import Compressor, Ctx, Memory, build_compressor
from vatra.config import CommConfig
from vatra.errors import ConfigError

Piece = tuple[int, int, int]  # (tensor index, first element, end element) of a flat parameter


def split_even(numels: list[int], servers: int) -> list[list[Piece]]:
    """The parameters' elements, in order, cut into ``servers`` runs of equal size (±1): one shard
    per server, a tensor cut between two shards where a boundary falls inside it (whole tensors
    would leave one server most of a model whose weight is one large matrix)."""
    total = sum(numels)
    if servers > total:
        raise ConfigError(f"dist.servers = {servers}: more servers than the model's {total} parameters")
    cuts = [total * k // servers for k in range(servers + 1)]
    shards: list[list[Piece]] = [[] for _ in range(servers)]
    start = 0
    for i, n in enumerate(numels):
        for s in range(servers):
            a, b = max(start, cuts[s]), min(start + n, cuts[s + 1])
            if a < b:
                shards[s].append((i, a - start, b - start))
        start += n
    return shards


HALF = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SMALL = 256  # tensors under this many elements skip the compressor (fp32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Codec:
    """Encodes a flat fp32 shard of tensors of ``numels`` elements into :attr:`nbytes` bytes.

    ``bounds``: the byte offset where each tensor's encoding ends (messages are cut between tensors).
    Not thread-safe: one codec per (link, direction).
    """

    def __init__(self, numels: list[int], wire: str, comm: CommConfig | None = None) -> None:
        self.numels, self.wire = numels, wire
        self.dtype = HALF.get(wire)
        self.compressor: Compressor | None = None
        if self.dtype is None:
            base = comm or CommConfig()
            self.compressor = build_compressor(base.model_copy(update={"method": wire}), "dist.ps_wire")
        # per tensor: the payload's (shape, dtype, bytes) parts, or None for a dense tensor
        self.layout: list[list[tuple[torch.Size, torch.dtype, int]] | None] = []
        self.bounds: list[int] = []
        end = 0
        for n in numels:
            if self._compressed(n):
                assert self.compressor is not None
                payload, _ = self.compressor.compress(torch.ones(n))
                parts = [(p.shape, p.dtype, p.numel() * p.element_size()) for p in payload]
                self.layout.append(parts)
                end += sum(size for _, _, size in parts)
            else:
                self.layout.append(None)
                end += n * (self.dtype or torch.float32).itemsize
            self.bounds.append(end)
        self.nbytes = end

    @property
    def exact(self) -> bool:
        return self.wire == "fp32"

    def _compressed(self, numel: int) -> bool:
        return self.compressor is not None and numel >= SMALL

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bytes, what the receiver decodes them to): the second is for error feedback."""
        if self.compressor is None:
            assert self.dtype is not None
            half = flat.to(self.dtype)
            return _bytes(half), half.to(torch.float32)
        out, seen, offset = [], torch.empty_like(flat, dtype=torch.float32), 0
        for n, parts in zip(self.numels, self.layout, strict=True):
            piece = flat[offset : offset + n]
            if parts is None:
                out.append(_bytes(piece.float()))
                seen[offset : offset + n] = piece
            else:
                payload, ctx = self.compressor.compress(piece.float())
                out.extend(_bytes(p) for p in payload)
                seen[offset : offset + n] = self.compressor.decompress(payload, ctx).reshape(-1)
            offset += n
        return torch.cat(out), seen

    def decode(self, buf: torch.Tensor) -> torch.Tensor:
        """The flat fp32 shard ``buf`` (of :attr:`nbytes` uint8) carries."""
        if self.compressor is None:
            assert self.dtype is not None
            return buf.view(self.dtype).to(torch.float32)
        out, at = [], 0
        for n, parts in zip(self.numels, self.layout, strict=True):
            if parts is None:
                out.append(buf[at : at + 4 * n].clone().view(torch.float32))
                at += 4 * n
                continue
            payload = []
            for shape, dtype, size in parts:
                payload.append(buf[at : at + size].clone().view(dtype).reshape(shape))
                at += size
            ctx = Ctx(torch.Size([n]), torch.float32)
            out.append(self.compressor.decompress(payload, ctx).reshape(-1).float())
        return torch.cat(out)


class PushEncoder:
    """A worker's gradients for one server: encoded with error feedback (the residual of the last
    push is added to the next; none for a lossless or half wire where the rounding is unbiased)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.memory = Memory() if codec.compressor is not None and codec.compressor.error_feedback else None

    def encode(self, grad: torch.Tensor) -> torch.Tensor:
        if self.memory is None:
            return self.codec.encode(grad)[0]
        compensated = self.memory.compensate(grad, 0)
        buf, seen = self.codec.encode(compensated)
        self.memory.update(compensated, 0, seen)
        return buf

    def forget(self) -> None:
        """The push in flight was lost (a broken link): its residual would be applied twice."""
        if self.memory is not None:
            self.memory.forget()
