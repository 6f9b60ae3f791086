"""``CommPlugin``: registers the gradient hook on the DDP wrapper and logs the bytes it sent."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.comm import adam1bit
from vatra.comm._base import Compressor, SparseCompressor, build_compressor
from vatra.comm.adam1bit_exchange import adam1bit_hook
from vatra.comm.batching import INT8_SUM_WORLD
from vatra.comm.hierarchical import HierarchicalTopology
from vatra.comm.hooks import HookState, TensorDraws, compression_hook
from vatra.comm.lowrank import LowRankMemory, LowRankState, lowrank_hook
from vatra.comm.memory import Memory, MomentumMemory, NoMemory
from vatra.comm.powersgd import PowerSGDHookState, powersgd_hook
from vatra.comm.recipe import resolve_recipe
from vatra.comm.topology import ByteCounter, Topology
from vatra.comm.topology_factory import build_topology
from vatra.comm.warmup import CompressionStart, compression_start
from vatra.config._comm import CommConfig
from vatra.engine import Plugin
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import Trainer


class CommPlugin(Plugin):
    """Adds ``comm_bytes`` (bytes this rank sent for gradients this step), ``comm_time_s`` (the time
    the hook's work took, on its worker thread with ``comm.overlap``), on the hierarchical topology
    ``comm_cross_host_bytes`` (the part of ``comm_bytes`` that left the host) and, with error
    feedback, ``comm_residual_norm`` to each step's metrics, and the run's totals to the summary.

    Without a process group (one rank) nothing is sent and both figures are 0. With
    ``method = "none"`` on the flat topology no hook is registered: DDP's built-in all-reduce
    overlaps communication with backward in C++, with no Python on the way. Its bytes are the
    same ring formula the flat topology counts, 2·(W−1)/W of the gradient bytes per step; its time
    is inside ``fwd_bwd_time_s``, so ``comm_time_s`` is not reported then.
    """

    def __init__(self, cfg: CommConfig, hosts: list[list[int]] | None = None) -> None:
        self.cfg = cfg
        self.hosts = hosts  # explicit host layout (tests); None = ask the elastic agents
        self.state: HookState | PowerSGDHookState | LowRankState | None = None
        self.builtin_bytes: int | None = None  # per step, when DDP's own all-reduce runs
        self.total_bytes = 0
        self.total_cross_host_bytes: int | None = None  # counted on the hierarchical topology only
        self.names: dict[int, str] = {}  # id(parameter) -> its name, for checkpoints of the memory
        self.device = torch.device("cpu")
        self.start: CompressionStart | None = None  # when compression starts (vatra.comm.warmup)
        self.adam: adam1bit.Adam1Bit | None = None  # Adam(W) with onebit/topk/randomk: 1-bit Adam

    def on_fit_start(self, trainer: Trainer) -> None:
        if not isinstance(trainer.module, DDP):
            return
        compressor = None if self.cfg.method == "powersgd" else build_compressor(self.cfg)
        device = trainer.dist.device.type
        asked, self.cfg = self.cfg, resolve_recipe(self.cfg, trainer.cfg, compressor, device)
        counter = ByteCounter()
        if self.cfg.method == "powersgd" and self.cfg.powersgd_impl == "torch":
            topology_name = "flat"  # torch's hook runs torch's own collectives
            self.state = PowerSGDHookState(self.cfg, counter, seed=trainer.cfg.run.seed)
            trainer.module.register_comm_hook(self.state, powersgd_hook)
            trainer.state.rank_states["comm"] = self.state  # error feedback and warm-start factors
        else:
            topology = build_topology(self.cfg.topology, counter, self.hosts)
            topology_name = topology.name
            if self.cfg.method == "none" and topology_name == "flat":
                w = trainer.dist.world_size
                grad_bytes = sum(
                    p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad
                )
                self.builtin_bytes = 2 * (w - 1) * grad_bytes // w
                trainer.log_event("comm", method="none", topology="flat", hook="ddp-builtin")
                return
            if isinstance(topology, HierarchicalTopology):
                self.total_cross_host_bytes = 0
            if self.cfg.method == "powersgd":  # vatra's: its all-reduces compose with any topology
                self.state = self._lowrank_state(trainer, topology)
                trainer.module.register_comm_hook(self.state, lowrank_hook)
                self._checkpoint_memory(trainer)  # residuals and warm-start factors
            elif adam1bit.applies(asked, trainer.cfg) and not isinstance(topology, HierarchicalTopology):
                assert compressor is not None
                self.adam = adam1bit.Adam1Bit(trainer, asked, compressor, topology, _positions(trainer))
                self.cfg, self.state = self.adam.cfg, self.adam.state
                trainer.module.register_comm_hook(self.state, adam1bit_hook)
                self._checkpoint_memory(trainer)  # worker and server residuals
            else:
                assert compressor is not None
                self.state, use_memory = self._hook_state(trainer, compressor, topology)
                trainer.module.register_comm_hook(self.state, compression_hook)
                if use_memory:
                    self._checkpoint_memory(trainer)  # residuals (and velocities)
        c = self.cfg
        start: int | str = c.start_step
        ramp: int | str = c.sparsity_warmup
        if self.adam is None:  # 1-bit Adam decides and records its own start: its variance settling
            self.start = compression_start(asked, c, trainer.cfg, compressor)
            trainer.state.rank_states["comm_warmup"] = self.start  # a resumed run decides as this one
            if self.start.detector is not None:
                start = f"when the loss settles, by {c.start_step}"
                ramp = "as long as the warm-up" if self.start.ramp else ramp
        trainer.log_event(
            "comm", method=c.method, topology=topology_name, overlap=c.overlap, start_step=start,
            sparsity_warmup=ramp, momentum_correction=c.momentum_correction, ratio=c.ratio,
        )  # fmt: skip

    def _lowrank_state(self, trainer: Trainer, topology: Topology) -> LowRankState:
        c = self.cfg
        return LowRankState(
            topology=topology,
            memory=LowRankMemory(),
            index=_positions(trainer),
            rank=c.rank,
            start_step=int(c.start_step),
            factor_dtype=_factor_dtype(c.factor_dtype, topology.world_size),
            bucket_bytes=int(c.bucket_mb * 2**20),
            seed=trainer.cfg.run.seed,
            overlap=bool(c.overlap),
        )

    def _hook_state(
        self, trainer: Trainer, compressor: Compressor, topology: Topology
    ) -> tuple[HookState, bool]:
        """The compression hook's state, and whether it has error-feedback memory to checkpoint."""
        use_memory = self.cfg.error_feedback and compressor.error_feedback and not compressor.lossless
        memory = Memory() if use_memory else NoMemory()
        if self.cfg.momentum_correction:  # resolved: "auto" is on only where it applies
            if not use_memory:  # built-ins are refused at load time; a user's class only now
                raise ConfigError(
                    f"comm.momentum_correction: {self.cfg.method!r} takes no error feedback (the class "
                    "is lossless or sets error_feedback = False); set comm.momentum_correction = false"
                )
            memory = self._momentum_memory(trainer, isinstance(compressor, SparseCompressor))
        state = build_hook_state(
            self.cfg,
            compressor,
            topology,
            memory,
            seed=trainer.cfg.run.seed,
            index=_positions(trainer),
            device=trainer.dist.device,
        )
        clip = trainer.cfg.train.clip_grad_norm
        if use_memory and clip and not trainer.scaler.is_enabled():  # fp16's scaled gradients: no
            # DGC scales the threshold by W^-1/2: the ranks' clipped gradients are summed
            state.local_clip = clip / trainer.dist.world_size**0.5
        return state, use_memory

    def _checkpoint_memory(self, trainer: Trainer) -> None:
        """The hook's memory is training state: checkpoints keep it, by parameter name."""
        # every trained parameter, a loss's own included (an Objective wraps the model and the loss)
        self.names = {id(p): name for name, p in trainer.trainable.named_parameters()}
        self.device = trainer.dist.device
        trainer.state.rank_states["comm"] = self

    def _momentum_memory(self, trainer: Trainer, masking: bool) -> MomentumMemory:
        """Move SGD's momentum from the optimizer into each rank's error-feedback memory (DGC)."""
        optim = trainer.cfg.optim
        if optim.name != "sgd" or optim.momentum == 0.0:
            raise ConfigError(
                "comm.momentum_correction needs optim.name = 'sgd' with optim.momentum > 0 "
                f"(got {optim.name}, momentum {optim.momentum}); set comm.momentum_correction = false"
            )
        for group in trainer.optimizer.param_groups:
            group["momentum"] = 0.0  # the hook's velocity replaces it; weight decay stays in the optimizer
        trainer.log_event("comm", momentum_correction=optim.momentum, masking=masking)
        return MomentumMemory(optim.momentum, masking)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's error-feedback memory by parameter name: the hook keys it by the parameter's
        ``id``, which does not survive a restart. (A stochastic compressor's draws need no state:
        they follow from the seed, the rank, the step and the tensor.)"""
        assert isinstance(self.state, HookState | LowRankState)  # registered only with a memory
        names = self.names
        parts = self.state.memory.state_dict()
        return {part: {names[k]: t for k, t in d.items() if k in names} for part, d in parts.items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        assert isinstance(self.state, HookState | LowRankState)
        ids: dict[str, Hashable] = {name: key for key, name in self.names.items()}
        on = self.device
        parts = {part: {ids[n]: t.to(on) for n, t in d.items() if n in ids} for part, d in state.items()}
        self.state.memory.load_state_dict(parts)

    def on_step_start(self, trainer: Trainer) -> None:
        if self.state is not None:
            self.state.step = trainer.state.step
            self.state.counter.reset()
            self.state.comm_time_s = 0.0
        if self.start is not None:
            own = self.state if isinstance(self.state, HookState | LowRankState) else None
            self.start.on_step_start(trainer, own)
        if self.adam is not None:
            self.adam.on_step_start(trainer)

    def after_update(self, trainer: Trainer) -> None:
        if self.adam is not None:
            self.adam.after_update(trainer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if trainer.state.skip_update and self.state is not None:
            # A skipped update is dropped, not deferred: error feedback already holds what this
            # step's gradient (a spike, as a rule) did not send, and would send it over the next steps.
            self.state.forget()
        if self.builtin_bytes is not None:
            self.total_bytes += self.builtin_bytes
            metrics["comm_bytes"] = self.builtin_bytes
            return
        if self.start is not None and isinstance(self.state, HookState | LowRankState):
            self.start.on_step_end(trainer, self.state.topology, float(metrics.get("loss", math.nan)))
        sent = self.state.counter.sent if self.state is not None else 0
        self.total_bytes += sent
        metrics["comm_bytes"] = sent
        if self.total_cross_host_bytes is not None and self.state is not None:
            self.total_cross_host_bytes += self.state.counter.cross_host
            metrics["comm_cross_host_bytes"] = self.state.counter.cross_host
        metrics["comm_time_s"] = self.state.comm_time_s if self.state is not None else 0.0
        if isinstance(self.state, LowRankState | adam1bit.Adam1BitState) and self.state.fp32_resends:
            metrics["comm_fp32_resends"] = self.state.fp32_resends  # so far: half-precision overflows
        logged = (
            trainer.state.step % trainer.cfg.run.log_every == 0
            or trainer.state.step == trainer.cfg.train.steps
        )
        if logged and isinstance(self.state, HookState | LowRankState) and self.state.memory.residuals:
            # how much error feedback is holding back: growth without bound means the compressor
            # cannot keep up (too sparse, or a scale that undershoots). Every run.log_every steps: a
            # pass over every residual, 3 % of a CPU step of the benchmark MLP when taken every step
            metrics["comm_residual_norm"] = self.state.memory.residual_norm()

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.state is not None:
            self.state.close()
        summary["comm_bytes"] = self.total_bytes
        if self.total_cross_host_bytes is not None:
            summary["comm_cross_host_bytes"] = self.total_cross_host_bytes
        summary["comm_method"] = self.cfg.method
        if self.start is not None:
            summary["compression_started_step"] = self.start.summary()
        if self.adam is not None:
            self.adam.summarize(summary)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        if self.state is not None:
            self.state.close(wait=False)  # a bucket may still wait on a peer that is gone


def build_hook_state(
    cfg: CommConfig,
    compressor: Compressor,
    topology: Topology,
    memory: Memory,
    *,
    seed: int,
    index: dict[int, int],
    device: torch.device,
    start_step: int | None = None,
) -> HookState:
    """The compression hook's state for a resolved ``cfg`` (:func:`resolve_recipe`); ``index`` maps
    each tensor's key to its position (a stochastic compressor's draws are seeded from it). Also what
    ``vatra.asyncdp`` averages its pseudo-gradients with (:func:`vatra.comm.hooks.average_`)."""
    draws = None
    if compressor.stochastic:
        # random-k: the same indices on every rank, so only the values travel, all-reduced
        shared = compressor.can_share_draws
        compressor.shared = shared
        draws = TensorDraws(seed, 0 if shared else topology.rank, index, device)
    return HookState(
        compressor=compressor,
        memory=memory,
        topology=topology,
        start_step=int(cfg.start_step) if start_step is None else start_step,
        sparsity_warmup=int(cfg.sparsity_warmup),
        min_numel=cfg.min_numel,
        bucket_bytes=int(cfg.bucket_mb * 2**20),
        overlap=bool(cfg.overlap),
        draws=draws,
    )


def _positions(trainer: Trainer) -> dict[int, int]:
    """id(parameter) -> its position in the module, the same on every rank (seeds draws and factors)."""
    return {id(p): i for i, p in enumerate(trainer.module.parameters())}


def _factor_dtype(name: str, world: int) -> torch.dtype:
    """vatra's PowerSGD wire dtype; int8 sums serve up to ``INT8_SUM_WORLD`` ranks, fp16 above."""
    if name == "int8":
        return torch.int8 if world <= INT8_SUM_WORLD else torch.float16
    return torch.float16 if name == "fp16" else torch.float32
