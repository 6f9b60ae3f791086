"""1-bit Adam (Tang et al., 2021) for Adam and AdamW: compress Adam's momentum, not the gradient.

Error feedback on raw gradients fights Adam: the second moment v sees the compressed, lumpy
gradients, and coordinates that wait in the residual arrive as spikes that v then divides by. 1-bit
Adam splits training in two:

1. **Warm-up**: gradients are averaged (sent in fp4 with a scale per 32 values, or fp8 with one
   per row, through the two-sided exchange; with ``comm.warmup_precision = "fp16"`` in fp16 with an
   fp32 resend when the sum overflows) and Adam runs as it always does, until v has settled
   (:class:`VarianceWatch`: the bias-corrected ‖v̂‖ stopped moving or stopped growing, after the
   LR warm-up).
2. **Compressed**: v is frozen (Adam's bias correction of v folded in at that step). Each rank
   updates the shared momentum with its own gradient, ``mᵢ = β₁·m + (1 − β₁)·gᵢ``, and takes the
   update it would make, ``uᵢ = mᵢ/(√v̂ + ε)``, clipped to Adam's own bound. The ranks average the
   uᵢ with a compressed all-reduce that has error feedback on both sides
   (:func:`vatra.comm.adam1bit_exchange.compressed_average`): each rank compresses ``uᵢ + eᵢ``
   and keeps its error eᵢ; rank j, the server of the j-th chunk of every tensor, averages what it
   received, compresses ``avg + sⱼ`` again and keeps the server error sⱼ; every rank decompresses
   the servers' chunks into the same ū. The momentum becomes ``m̄ = ū·(√v̂ + ε)`` and the update
   is Adam's with it and the frozen v: ``x ← x − lr·m̄ / (1 − β₁ᵗ) / (√v̂ + ε)`` (AdamW:
   ``x ← x·(1 − lr·λ)`` first; Adam's L2 decay ``λ·x`` is added to gᵢ, as torch's Adam adds it to
   the gradient).

Tensors under ``comm.min_numel`` send uᵢ in fp16 (|uᵢ| is bounded: an exact average but for
rounding). Used by the comm plugin when
``optim.name`` is adam or adamw and ``comm.method`` is onebit, topk or randomk (``comm.adam1bit``).
The DDP hook writes m̄ where the gradient was, so ``train.clip_grad_norm`` bounds m̄ and the
``grad_norm`` metric is ‖m̄‖ in the compressed phase.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vatra.comm._base import Compressor, SparseCompressor
from vatra.comm.adam1bit_freeze import (
    FrozenAdam,
    FrozenAdamW,
    VarianceWatch,
    freeze_,
    frozen_optimizer,
    rebind_scheduler,
)
from vatra.comm.batching import INT8_SUM_WORLD
from vatra.comm.hooks import HookState, TensorDraws
from vatra.comm.memory import Memory, NoMemory
from vatra.comm.minifloat import Fp4Blocks, Fp8Rows
from vatra.comm.topology import Topology

if TYPE_CHECKING:
    from vatra.config import Config
    from vatra.config._comm import CommConfig
    from vatra.engine import Trainer

__all__ = [
    "METHODS",
    "Adam1Bit",
    "Adam1BitState",
    "FrozenAdam",
    "FrozenAdamW",
    "NoTwoSidedMemory",
    "TwoSidedMemory",
    "VarianceWatch",
    "applies",
    "freeze_",
]

METHODS = ("onebit", "topk", "randomk")
# The compressed phase's shares (comm.ratio = "auto"): the momentum is smoother than a gradient,
# and error feedback delivers what waits. At 2 bytes a top-k element (one-byte place, fp8 value)
# and 1 a random-k one (int8), these cost what 1 % and 5 % did at 6 and 2: over gpt_text's 2,000
# steps topk at 1 % ended 2.6 % of loss behind none and at 3 % 0.6 % ahead; randomk 6.5 % behind at
# 5 %, 2.3 % at 10 %, 1.5 % at 15 %.
AUTO_RATIO = {"topk": 0.03, "randomk": 0.15}
# ... or more on a short run: a kept value waits 1/ratio steps on average, and each coordinate gets
# at least this many turns in the compressed phase (at 1 %, topk lost 1.1 points on digits' 300
# steps, whose 225 compressed steps gave it 2 turns; on gpt_text's 300 steps 8 turns, 3.2 %, kept
# its loss).
AUTO_TURNS = {"topk": 8, "randomk": 75}
AUTO_RATIO_MAX = {"topk": 0.25, "randomk": 0.5}  # the gradient path's shares
TOPK_BLOCK = 256  # top-k chooses per block of this many values: a place is one byte
VARIANCE_TOL = 0.02  # relative change of |v̂| per step
VARIANCE_WINDOW = 15  # steps in a row that say the variance has settled
CAP_SHARE = 0.25  # frozen by this share of train.steps at the latest


def applies(comm: CommConfig, cfg: Config) -> bool:
    """Whether this run compresses Adam's momentum (1-bit Adam) instead of its gradients."""
    return (
        comm.adam1bit
        and cfg.optim.name in ("adam", "adamw")
        and comm.method in METHODS
        and cfg.train.precision != "fp16"  # the scaler's scaled gradients would enter the momentum
    )


class TwoSidedMemory(Memory):
    """Error feedback on both sides of the compressed all-reduce: ``residuals`` holds each rank's
    worker error eᵢ (of the whole tensor), ``server`` the error of the chunk this rank serves."""

    def __init__(self, keys: Iterable[Hashable] = ()) -> None:
        super().__init__()
        self.server: dict[Hashable, torch.Tensor] = {}
        self.keys = list(keys)  # every parameter's: the freeze is saved under each of them
        self.frozen_step: int | None = None  # when the variance was frozen (kept through forget)

    def compensate_server(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        residual = self.server.get(key)
        if residual is None or residual.shape != tensor.shape:
            return tensor.clone()
        return tensor + residual

    def update_server(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        self.server[key] = compensated - transmitted

    def forget(self) -> None:
        super().forget()
        self.server.clear()

    def drop(self, key: Hashable) -> None:
        super().drop(key)
        self.server.pop(key, None)

    def residual_norm(self) -> float:
        parts = [*self.residuals.values(), *self.server.values()]
        return float(sum(r.float().norm() ** 2 for r in parts) ** 0.5)

    def state_dict(self) -> dict[str, dict[Hashable, torch.Tensor]]:
        state = {**super().state_dict(), "server": self.server}
        if self.frozen_step is not None:  # a checkpoint renames keys: one copy under each parameter
            state["frozen_step"] = {k: torch.tensor(self.frozen_step) for k in self.keys}
        return state

    def load_state_dict(self, state: dict[str, dict[Hashable, torch.Tensor]]) -> None:
        super().load_state_dict(state)
        self.server = dict(state.get("server", {}))
        frozen = list(state.get("frozen_step", {}).values())
        self.frozen_step = int(frozen[0]) if frozen else None


class NoTwoSidedMemory(NoMemory, TwoSidedMemory):
    """Error feedback off on both sides: the minifloat warm-up's exchange (a gradient's rounding
    must not reach the momentum phase's residuals)."""

    def compensate_server(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        return tensor

    def update_server(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        return None


@dataclass
class Adam1BitState(HookState):
    """The hook's state: :class:`HookState`'s, plus the optimizer whose momentum is averaged and each
    parameter by its key. :meth:`refresh` (every step, before backward) reads whether the optimizer
    is frozen and its groups (a checkpoint or a rollback loads new group dicts)."""

    optimizer: torch.optim.Optimizer | None = None
    params: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    frozen: bool = False
    groups: dict[int, dict[str, Any]] = field(default_factory=dict)
    fp32_resends: int = 0  # warm-up steps whose fp16 sum overflowed and went again in fp32
    warmup: Compressor | None = None  # the warm-up's gradients' (comm.warmup_precision); None: fp16
    sum_int8: bool = False  # random-k's shared-index values summed as int8 (else in the values' dtype)
    warmup_draws: TensorDraws | None = None  # its randomness (fp4's rounding: each rank its own)

    def refresh(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.frozen = optimizer.param_groups[0].get("frozen_step") is not None
        self.groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def to_update_(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` becomes the update this rank's momentum makes, u = mᵢ/(√v̂ + ε) with
        mᵢ = β₁·m + (1 − β₁)·gᵢ (Adam's L2 decay added to gᵢ first), clipped to the largest |m/√v|
        Adam itself can reach, (1 − β₁)/√((1 − β₂)(1 − β₁²/β₂)) (Cauchy–Schwarz over the two
        averages): with v frozen, a coordinate whose gradient grows after the freeze could go
        further, and one whose v̂ was 0 would divide by ε. Returns √v̂ + ε."""
        assert self.optimizer is not None
        p, group = self.params[key], self.groups[key]
        beta1, beta2 = group["betas"]
        if not isinstance(self.optimizer, torch.optim.AdamW) and group["weight_decay"]:
            grad.add_(p.detach(), alpha=group["weight_decay"])
        st = self.optimizer.state[p]
        grad.mul_(1.0 - beta1).add_(st["exp_avg"], alpha=beta1)
        denominator = st["exp_avg_sq"].sqrt().add_(group["eps"])
        bound = (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1**2 / beta2))
        grad.div_(denominator).clamp_(-bound, bound)
        return denominator


class Adam1Bit:
    """The comm plugin's 1-bit Adam: swaps in the frozen-variance optimizer and builds the hook's
    state (:meth:`__init__`, at fit start); per step reads the optimizer (:meth:`on_step_start`) and,
    until it is frozen, decides after the update whether to freeze it (:meth:`after_update`), which
    it records as a ``compression_started`` event. Every rank decides alike: in the warm-up every
    rank's optimizer saw the same averaged gradients."""

    def __init__(
        self,
        trainer: Trainer,
        comm: CommConfig,
        compressor: Compressor,
        topology: Topology,
        index: dict[int, int],
    ) -> None:
        steps = trainer.cfg.train.steps
        ratio = resolved_ratio(comm, compressor)
        self.auto_ratio = comm.ratio == "auto"  # set at the freeze, from the steps left
        if isinstance(compressor, SparseCompressor) and ratio is not None:
            compressor.ratio = ratio
            if comm.method == "topk":  # a choice per block of 256: one-byte places, fp8 values
                compressor.block, compressor.value_dtype = TOPK_BLOCK, torch.float8_e4m3fn
            else:  # |u| ≤ Adam's bound (~7.3): no overflow in fp16
                compressor.value_dtype = torch.float16
        self.start = None if comm.start_step == "auto" else max(1, comm.start_step)  # v needs one step
        self.cap = max(1, math.ceil(CAP_SHARE * steps))
        # not before the LR warm-up ends, nor before a window's worth of steps
        after = max(trainer.cfg.optim.warmup_steps, VARIANCE_WINDOW)
        self.watch = VarianceWatch(VARIANCE_TOL, VARIANCE_WINDOW, after=after)
        self.started: int | None = None
        self.cfg = comm.model_copy(update={"ratio": "auto" if ratio is None else ratio})
        trainer.optimizer = frozen_optimizer(trainer.optimizer)
        trainer.scheduler = rebind_scheduler(trainer.scheduler, trainer.optimizer)
        self.memory = TwoSidedMemory([id(p) for p in trainer.module.parameters()])
        draws = None
        if compressor.stochastic:  # random-k: every rank draws the same indices; values all-reduced
            compressor.shared = compressor.can_share_draws
            draws = TensorDraws(
                trainer.cfg.run.seed, 0 if compressor.shared else topology.rank, index, trainer.dist.device
            )
        self.state = Adam1BitState(
            compressor=compressor,
            memory=self.memory,
            topology=topology,
            start_step=self.start or 0,
            min_numel=comm.min_numel,
            bucket_bytes=int(comm.bucket_mb * 2**20),
            overlap=bool(comm.overlap),  # resolved by the recipe; "auto" = on
            draws=draws,
            params={id(p): p for p in trainer.module.parameters()},
        )
        small_world = topology.world_size <= INT8_SUM_WORLD
        if isinstance(compressor, SparseCompressor) and compressor.sums and small_world:  # random-k
            self.state.sum_int8, compressor.value_dtype = True, None  # int8 from the fp32 values
        if comm.warmup_precision == "fp4":
            self.state.warmup = Fp4Blocks()
            draws = TensorDraws(trainer.cfg.run.seed, topology.rank, index, trainer.dist.device)
            self.state.warmup.generator, self.state.warmup_draws = draws.generator, draws
        elif comm.warmup_precision == "fp8":
            self.state.warmup = Fp8Rows()
        self.state.refresh(trainer.optimizer)
        trainer.log_event(
            "comm", adam1bit=True, start="comm.start_step" if self.start else "variance settles",
            variance_tol=VARIANCE_TOL, variance_window=VARIANCE_WINDOW, at_latest=self.start or self.cap,
            ratio=ratio,
        )  # fmt: skip

    def on_step_start(self, trainer: Trainer) -> None:
        frozen = self.memory.frozen_step
        groups = trainer.optimizer.param_groups
        if frozen is not None and groups[0].get("frozen_step") is None:
            # resumed (or rolled back) past the freeze: the loaded v is already the frozen v̂, and
            # the optimizer's state_dict does not keep the groups' extra key through a checkpoint
            for group in groups:
                group["frozen_step"] = frozen
            self.started = frozen
        self.state.refresh(trainer.optimizer)

    def after_update(self, trainer: Trainer) -> None:
        step = trainer.state.step  # steps done: the next one is the first compressed one
        if self.state.frozen or trainer.state.skip_update:
            return
        settled = self.watch.settled(trainer.optimizer, step)
        if self.start is not None:
            if step < self.start:
                return
            reason = f"comm.start_step = {self.start}"
        elif settled:
            reason = f"Adam's second moment settled after the LR warm-up: {self.watch.why}"
        elif step >= self.cap:
            reason = f"|v̂| still moving at {CAP_SHARE:.0%} of train.steps; variance frozen there"
        else:
            return
        freeze_(trainer.optimizer, step)
        self.started = self.memory.frozen_step = step
        if self.auto_ratio and self.state.ratio is not None:
            method = self.cfg.method
            turns = AUTO_TURNS[method] / max(1, trainer.cfg.train.steps - step)
            self.state.ratio = min(AUTO_RATIO_MAX[method], max(AUTO_RATIO[method], turns))
        warm = self.cfg.sparsity_warmup
        self.state.start_step = step
        self.state.sparsity_warmup = step if warm == "auto" else int(warm)
        trainer.log_event("compression_started", reason=reason, ratio=self.state.ratio)

    def summarize(self, summary: dict[str, Any]) -> None:
        summary["compression_started_step"] = self.started


def resolved_ratio(comm: CommConfig, compressor: Compressor) -> float | None:
    """The compressed phase's share for a sparsifier (``comm.ratio``, or the Adam recipe's)."""
    if not isinstance(compressor, SparseCompressor):
        return None
    return AUTO_RATIO[comm.method] if comm.ratio == "auto" else comm.ratio
