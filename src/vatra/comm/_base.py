"""The ``Compressor`` base class, and ``build_compressor``: ``comm.method`` to a compressor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vatra.config._comm import CommConfig
from vatra.registry import COMPRESSORS

Payload = list[torch.Tensor]  # what goes on the wire for one tensor; sizes depend only on its shape


@dataclass(frozen=True)
class Ctx:
    """What a receiver needs besides the payload to rebuild a tensor: its shape and dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.shape.numel()


class Compressor:
    """Turns one gradient tensor into a payload and back (the GRACE split: compressor ≠ memory).

    Call order for one tensor in one step, on every rank: ``Memory.compensate`` → :meth:`compress`
    → the payload travels (all-reduce when :attr:`summable`, else all-gather) → :meth:`decompress`
    of each rank's payload → sum → ``Memory.update`` with the local decompressed tensor.

    Contract: the number, sizes and dtypes of the payload tensors depend only on the input's shape
    and dtype, so a receiver can cut a fused byte buffer into another rank's payload using its own.
    Compressors hold no per-tensor state (error feedback lives in ``Memory``). Not thread-safe: one
    compressor per DDP hook; with ``comm.overlap`` its methods run on the hook's worker thread, one
    bucket after another.

    Randomness: a compressor that draws random numbers sets :attr:`stochastic` and draws from
    :attr:`generator`. In the DDP hook that is a ``torch.Generator`` of its own, seeded before each
    tensor from ``run.seed``, the rank, the step and the tensor (``vatra.comm.hooks.TensorDraws``),
    so the draws do not depend on bucket order or threads, and a resumed run draws what the
    uninterrupted one drew. Elsewhere (federated compression, direct use) ``generator`` is ``None``
    and torch draws from its global RNG. A user's subclass that draws from the global RNG still
    works; but on the worker thread its draws interleave with the training thread's (dropout) in no
    fixed order, so runs with it do not repeat exactly.

    A user's subclass named by import string (``comm.method = "pkg.mod:MyCompressor"``, or
    ``federated.compression``) works like a built-in: it is built by :meth:`from_config` and gets
    error-feedback memory unless it sets ``lossless`` or clears ``error_feedback``.
    """

    summable: ClassVar[bool] = False  # payloads of different ranks may be added element-wise
    lossless: ClassVar[bool] = False  # decompress(compress(x)) == x: error feedback has nothing to carry
    # Error feedback needs a contractive compressor (‖x − C(x)‖ < ‖x‖). An unbiased quantiser with
    # high variance is not one, and its residual grows without bound: no memory for those.
    error_feedback: ClassVar[bool] = True
    stochastic: ClassVar[bool] = False  # compress draws random numbers (from ``generator``)
    generator: torch.Generator | None = None  # set by the DDP hook for a stochastic compressor
    # A compressor whose payload is summable when every rank draws the same numbers (random-k's
    # values at shared indices) sets ``can_share_draws``; the DDP hook then seeds every rank's
    # generator alike and sets ``shared``, and the payloads are all-reduced.
    can_share_draws: ClassVar[bool] = False
    shared: bool = False
    # Methods that lose accuracy when compressed from the start: with comm.start_step = "auto" they
    # run uncompressed until the loss settles (vatra.comm.warmup), by this share of train.steps at
    # the latest (and at least the LR warm-up in any case). 0: only the LR warm-up.
    dense_share: ClassVar[float] = 0.0

    @property
    def sums(self) -> bool:
        """Whether the ranks' payloads are added element-wise (all-reduce) rather than gathered."""
        return self.summable or self.shared

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        return cls()

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        raise NotImplementedError

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        raise NotImplementedError


def keep_count(numel: int, ratio: float) -> int:
    """Elements a sparsifier keeps: ⌈ratio·numel⌉, at least one."""
    return max(1, min(numel, int(-(-numel * ratio // 1))))


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


def scatter_sparse(values: torch.Tensor, indices: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """Dense tensor of ``ctx``'s shape with ``values`` at flat ``indices`` and zeros elsewhere."""
    out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=values.device)
    out.index_put_((indices.long(),), values.to(ctx.dtype), accumulate=True)
    return out.view(ctx.shape)


def build_compressor(cfg: CommConfig, key: str = "comm.method") -> Compressor:
    """The compressor ``cfg.method`` names (a built-in or a user's subclass); ``key`` names the
    config key in errors. powersgd is no per-tensor compressor: the comm plugin runs it itself."""
    cls: type[Compressor] = COMPRESSORS.load_class(cfg.method, Compressor, key)
    return cls.from_config(cfg)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
AUTO_RATIO = 0.1  # the DDP hook's share when comm.ratio = "auto", unless the class sets its own
AUTO_RATIO_UPLOAD = 0.01  # federated uploads' share when comm.ratio = "auto"


class SparseCompressor(Compressor):
    """Sends ⌈ratio·n⌉ chosen elements and where they are (a bitmask, or int32 indices where fewer
    than 1 in 32 are kept); subclasses choose which."""

    auto_ratio: ClassVar[float] = AUTO_RATIO  # the DDP hook's share when comm.ratio = "auto" (recipe)
    # the values' dtype on the wire; None: the tensor's own. 1-bit Adam sends fp16 (what it
    # compresses is bounded by Adam's own bound, and its error feedback keeps the rounding)
    value_dtype: torch.dtype | None = None
    # > 0: the tensor is cut into blocks of this many elements (at most 256), each keeps its own
    # ⌈ratio·block⌉ and sends their places in it as one byte each (1-bit Adam's momentum: 4 bytes
    # an index saved to 1, for a choice per block instead of over the tensor)
    block: int = 0

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ratio

    def values(self, flat: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The kept values as they travel."""
        kept = flat[indices]
        return kept if self.value_dtype is None else kept.to(self.value_dtype)

    def select_rows(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        """Indices within each row of ``rows`` (B, block) of its ``k`` elements to send: (B, k)."""
        raise NotImplementedError(f"{type(self).__name__} has no per-block choice (block = 0 only)")

    def _compress_blocks(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        flat = tensor.reshape(-1)
        rows = torch.nn.functional.pad(flat, (0, -flat.numel() % self.block)).view(-1, self.block)
        where = self.select_rows(rows, keep_count(self.block, self.ratio))  # (B, k)
        kept = rows.gather(1, where).reshape(-1)  # (B·k,)
        places, ctx = where.to(torch.uint8).reshape(-1), Ctx(tensor.shape, tensor.dtype)
        if self.value_dtype != torch.float8_e4m3fn:
            return [places, kept if self.value_dtype is None else kept.to(self.value_dtype)], ctx
        scale = kept.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX  # one
        values = (kept / scale).clamp_(-FP8_MAX, FP8_MAX).to(self.value_dtype).view(torch.uint8)
        return [places, values, scale.reshape(1)], ctx

    def _decompress_blocks(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        where, values = payload[0], payload[1]
        k = keep_count(self.block, self.ratio)
        blocks = -(-ctx.numel // self.block)
        if where.numel() != blocks * k or values.numel() != blocks * k or where.dtype != torch.uint8:
            raise ValueError(f"block payload of {where.numel()} places and {values.numel()} values for "
                             f"{blocks} blocks of {k} in a tensor of {ctx.numel}")  # fmt: skip
        if len(payload) == 3:  # fp8 values and their scale
            values = values.view(torch.float8_e4m3fn).float() * payload[2].float()
        on = where.device
        places = (
            where.view(blocks, k).long() + torch.arange(blocks, device=on).unsqueeze(1) * self.block
        )  # (B, k)
        out = torch.zeros(blocks * self.block, dtype=ctx.dtype, device=on)
        out.index_put_((places.reshape(-1),), values.to(ctx.dtype), accumulate=True)
        return out[: ctx.numel].view(ctx.shape)

    @classmethod
    def from_config(cls, cfg: CommConfig) -> Compressor:
        # "auto": the DDP plugin sets its recipe's share (vatra.comm.recipe); federated uploads send 1 %
        return cls(AUTO_RATIO_UPLOAD if cfg.ratio == "auto" else cfg.ratio)

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the ``k`` elements of ``flat`` (1-D) to send."""
        raise NotImplementedError

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        """(where, values): ``where`` is a bitmask of the kept elements (⌈n/8⌉ bytes, values in index
        order) when that is smaller than their int32 indices (4k bytes: above 1 in 32 kept), else
        the indices. Both sizes follow from n and the ratio alone, as the payload contract asks."""
        if self.block:
            return self._compress_blocks(tensor)
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = keep_count(n, self.ratio)
        indices = self.select(flat, k)
        if -(-n // 8) < 4 * k:
            indices = indices.sort().values
            mask = torch.zeros(n, dtype=torch.bool, device=flat.device)
            mask[indices] = True
            return [pack_bits(mask), self.values(flat, indices)], Ctx(tensor.shape, tensor.dtype)
        return [indices.to(torch.int32), self.values(flat, indices)], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        if self.block:
            return self._decompress_blocks(payload, ctx)
        where, values = payload
        if where.dtype == torch.uint8:  # a bitmask
            where = unpack_bits(where, ctx.numel).nonzero().squeeze(1)
        return scatter_sparse(values, where, ctx)
