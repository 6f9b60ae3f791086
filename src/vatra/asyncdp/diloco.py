"""``dist.mode = "diloco"``: local inner steps, an outer optimizer on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023): every rank starts a round from the shared parameters θ, takes H
steps of its own (inner) optimizer on its own data, and the ranks average their pseudo-gradients
Δ_r = θ − θ_r; an outer optimizer (Nesterov momentum in the paper) steps θ on the average, and every
rank starts the next round from the new θ. Streaming DiLoCo (Douillard et al. 2025) splits the
parameters into fragments synced at staggered steps, so each sync sends a fraction of the model, and
sends the outer gradients in low precision: here any ``vatra.comm`` compressor (fp16, topk, ...) with
error feedback averages them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vatra.asyncdp._state import copy_into, flat_optimizer_state, load_flat_optimizer_state, named
from vatra.comm._base import build_compressor
from vatra.comm.hierarchical import HierarchicalTopology
from vatra.comm.hooks import HookState, average_
from vatra.comm.memory import Memory, NoMemory
from vatra.comm.plugin import build_hook_state
from vatra.comm.recipe import resolve_recipe
from vatra.comm.topology import ByteCounter
from vatra.comm.topology_factory import build_topology
from vatra.config import CommConfig, DiLoCoConfig
from vatra.engine import Plugin
from vatra.engine.steps import PlainSteps, StepWork
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import Trainer


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Contiguous groups of tensor indices, ``fragments`` of them, of about equal element counts."""
    if fragments > len(numels):
        raise ConfigError(
            f"diloco.fragments = {fragments}, but the model has {len(numels)} parameter tensors; "
            f"set diloco.fragments to at most {len(numels)}"
        )
    out: list[list[int]] = []
    total, start, acc = sum(numels), 0, 0
    for i, n in enumerate(numels):
        acc += n
        left_tensors, left_groups = len(numels) - i - 1, fragments - len(out) - 1
        full = acc >= total * (len(out) + 1) / fragments
        if left_groups > 0 and (full or left_tensors == left_groups):
            out.append(list(range(start, i + 1)))
            start = i + 1
    out.append(list(range(start, len(numels))))
    return out


def steps_for_speed(times: list[float], inner_steps: int) -> list[int]:
    """Inner steps per rank in a round of ``inner_steps`` for per-step compute times ``times``: the
    fastest rank takes them all, rank r about ``inner_steps · t_fastest / t_r`` (at least 1), so the
    ranks finish their compute at about the same time. A rank with no measurement (0) takes all."""
    known = [t for t in times if t > 0]
    if not known:
        return [inner_steps] * len(times)
    fastest = min(known)
    return [
        inner_steps if t <= 0 else max(1, min(inner_steps, round(inner_steps * fastest / t))) for t in times
    ]


def computes_at(position: int, own: int, inner_steps: int) -> bool:
    """Whether a rank with ``own`` inner steps a round computes at ``position`` (0 ≤ position < H)
    of the round: exactly ``own`` positions a round, spread evenly over it."""
    return (position * own) % inner_steps < own


def _outer_optimizer(cfg: DiLoCoConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if cfg.outer == "adam":
        return torch.optim.Adam(params, lr=cfg.outer_lr, betas=(cfg.outer_momentum, 0.999))
    nesterov = cfg.outer == "nesterov" and cfg.outer_momentum > 0
    return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=nesterov)


class SitOutSteps:
    """``adaptive_steps``' micro-steps: the plain ones at the steps where this rank computes, none
    (the rank sits the step out: no data read, nothing computed) at the others."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self.plain = PlainSteps()

    def forward_module(self, trainer: Trainer) -> torch.nn.Module:
        return self.plain.forward_module(trainer)

    def run(self, trainer: Trainer, accum: int) -> StepWork | None:
        return None if self.diloco.idle else self.plain.run(trainer, accum)


class DiLoCo(Plugin):
    """The ranks train apart for ``inner_steps`` steps, then fragment by fragment (``fragments``,
    fragment f at the steps k with ``k % H == round(f·H/F)``, and all of them after the last step)
    average their pseudo-gradients through comm and step the shared parameters with the outer
    optimizer. At the start every rank takes rank 0's parameters and buffers; buffers (BatchNorm
    statistics) are not averaged after that.

    ``adaptive_steps``: each rank times its steps' compute; at every round's end the ranks exchange
    the times and rank r computes at ``steps_for_speed`` of the next round's H steps, sitting the
    others out (:class:`SitOutSteps`: no data read, nothing computed), and its pseudo-gradient is weighted
    by its share of the computed steps.

    Metrics: ``comm_bytes`` (what this rank sent this step), ``synced`` (fragments synced after this
    step), with adaptive_steps ``inner_steps`` (this rank's count this round).
    """

    def __init__(self, cfg: DiLoCoConfig, comm: CommConfig, *, group_size: int = 1) -> None:
        self.cfg = cfg
        self.comm = comm
        self.group_size = group_size  # hybrid: ranks that run DDP together and must step alike
        self.trainer: Trainer | None = None
        self.params: list[torch.Tensor] = []
        self.names: list[str] = []
        self.shared: list[torch.Tensor] = []
        self.fragments: list[list[int]] = []
        self.offsets: list[int] = []
        self.outer: list[torch.optim.Optimizer] = []
        self.hook: HookState | None = None
        self.world = 1
        self.counts: list[int] = []  # inner steps per rank this round (adaptive_steps)
        self.done: list[int] = []  # per fragment: steps this rank computed since the fragment's last sync
        self.busy = 0.0  # compute seconds and steps since the last round's end (adaptive_steps)
        self.busy_steps = 0
        self.idle = False  # adaptive_steps: this rank sits the current step out
        self.t0 = 0.0
        self.sent = self.cross_host = 0
        self.synced = 0
        self.total_bytes = self.total_cross_host = 0
        self.hierarchical = False
        self.rounds = 0

    # ------------------------------------------------------------------ setup
    def micro_steps(self, trainer: Trainer) -> SitOutSteps | None:
        return SitOutSteps(self) if self.cfg.adaptive_steps else None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.trainer = trainer
        ctx = trainer.dist
        self.world = ctx.world_size
        named_params = [(n, p) for n, p in trainer.trainable.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        if ctx.distributed:  # one starting point: rank 0's weights (DDP would broadcast them)
            with torch.no_grad():
                for t in [*self.params, *trainer.trainable.buffers()]:
                    dist.broadcast(t.data, 0)
        self.shared = [p.detach().float().clone() for p in self.params]
        h, f = self.cfg.inner_steps, self.cfg.fragments
        self.fragments = split_fragments([p.numel() for p in self.params], f)
        self.offsets = [round(i * h / f) for i in range(f)]
        self.outer = [_outer_optimizer(self.cfg, [self.shared[i] for i in frag]) for frag in self.fragments]
        self.counts = [h] * self.world
        self.done = [0] * f
        if ctx.distributed:
            self.hook = self._hook_state(trainer)
        trainer.state.rank_states["diloco"] = self
        trainer.log_event(
            "diloco", inner_steps=h, outer=self.cfg.outer, outer_lr=self.cfg.outer_lr, fragments=f,
            adaptive_steps=self.cfg.adaptive_steps, method=self.comm.method,
        )  # fmt: skip

    def _hook_state(self, trainer: Trainer) -> HookState:
        """comm's averaging state for the pseudo-gradients: the method's recipe, compressed from the
        first sync (a round is many steps: the dense warm-up counted in steps does not apply)."""
        compressor = build_compressor(self.comm)
        comm = resolve_recipe(self.comm, trainer.cfg, compressor).model_copy(
            update={"start_step": 0, "sparsity_warmup": 0, "momentum_correction": False, "overlap": False}
        )
        use_memory = comm.error_feedback and compressor.error_feedback and not compressor.lossless
        memory = Memory() if use_memory else NoMemory()
        topology = build_topology(comm.topology, ByteCounter())
        self.hierarchical = isinstance(topology, HierarchicalTopology)
        index = {i: i for i in range(len(self.params))}
        return build_hook_state(
            comm, compressor, topology, memory, seed=trainer.cfg.run.seed, index=index,
            device=trainer.dist.device, start_step=0,
        )  # fmt: skip

    # ------------------------------------------------------------------- steps
    def on_step_start(self, trainer: Trainer) -> None:
        self.t0 = time.perf_counter()
        if self.cfg.adaptive_steps:
            position = trainer.state.step % self.cfg.inner_steps
            own = self.counts[trainer.dist.rank]
            self.idle = not computes_at(position, own, self.cfg.inner_steps)

    def after_update(self, trainer: Trainer) -> None:
        if not self.idle:
            self.busy += time.perf_counter() - self.t0
            self.busy_steps += 1
            self.done = [d + 1 for d in self.done]
        k, h = trainer.state.step, self.cfg.inner_steps
        last = k >= trainer.cfg.train.steps
        due = [f for f, off in enumerate(self.offsets) if last or k % h == off]
        self.sent = self.cross_host = 0
        self.synced = len(due)
        if not due:
            return
        counter = self.hook.counter if self.hook is not None else None
        if counter is not None:
            counter.reset()
        weights = self._exchange(due, round_end=k % h == 0 and not last)
        for f in due:
            self._sync(f, weights[f] if weights else None)
            self.done[f] = 0
        self.rounds += 1
        if counter is not None:
            self.sent, self.cross_host = counter.sent, counter.cross_host
        self.total_bytes += self.sent
        self.total_cross_host += self.cross_host

    def _exchange(self, due: list[int], round_end: bool) -> dict[int, float]:
        """adaptive_steps: one small all-reduce of every rank's computed steps per due fragment and
        compute time per step; returns this rank's pseudo-gradient weight per fragment, and at a
        round's end sets the next round's step counts. Without adaptive_steps: nothing (weight 1)."""
        if not self.cfg.adaptive_steps or self.trainer is None:
            return {}
        ctx, w = self.trainer.dist, self.world
        table = torch.zeros(len(due) + 1, w, dtype=torch.float64)
        for row, f in enumerate(due):
            table[row, ctx.rank] = self.done[f]
        table[-1, ctx.rank] = self.busy / self.busy_steps if self.busy_steps else 0.0
        ctx.all_reduce_sum(table)
        weights = {}
        for row, f in enumerate(due):
            total = float(table[row].sum())
            weights[f] = self.done[f] * w / total if total > 0 else 1.0
        if round_end:
            counts = steps_for_speed(table[-1].tolist(), self.cfg.inner_steps)
            g = self.group_size  # a group computes together (DDP): at its slowest member's count
            self.counts = [min(counts[r - r % g : r - r % g + g]) for r in range(w)]
            self.busy, self.busy_steps = 0.0, 0
        return weights

    @torch.no_grad()
    def _sync(self, f: int, weight: float | None) -> None:
        """Average fragment f's pseudo-gradients, step the outer optimizer, restart from θ."""
        idx = self.fragments[f]
        deltas = [self.shared[i] - self.params[i].float() for i in idx]
        if weight is not None and weight != 1.0:
            torch._foreach_mul_(deltas, weight)
        if self.hook is not None:
            self.hook.step = self.rounds  # seeds a stochastic compressor's draws
            average_(self.hook, idx, deltas)
        for i, d in zip(idx, deltas, strict=True):
            self.shared[i].grad = d
        self.outer[f].step()
        self.outer[f].zero_grad(set_to_none=True)
        for i in idx:
            self.params[i].copy_(self.shared[i])

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics["comm_bytes"] = self.sent
        metrics["synced"] = self.synced
        if self.hierarchical:
            metrics["comm_cross_host_bytes"] = self.cross_host
        if self.cfg.adaptive_steps:
            metrics["inner_steps"] = self.counts[trainer.dist.rank]

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["comm_bytes"] = self.total_bytes
        if self.hierarchical:
            summary["comm_cross_host_bytes"] = self.total_cross_host
        summary["dist_mode"] = trainer.cfg.dist.mode

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, dict[str, Any]]:
        assert self.trainer is not None
        t = self.trainer
        state: dict[str, dict[str, Any]] = {
            "local": named(t.trainable),
            "shared": dict(zip(self.names, self.shared, strict=True)),
            "inner": flat_optimizer_state(t.optimizer),
            "counts": {"counts": list(self.counts), "done": list(self.done), "rounds": self.rounds},
        }
        for f, opt in enumerate(self.outer):
            state[f"outer.{f}"] = flat_optimizer_state(opt)
        if self.hook is not None:
            for part, d in self.hook.memory.state_dict().items():
                state[f"memory.{part}"] = {self.names[int(k)]: v for k, v in d.items()}  # type: ignore[call-overload]
        return state

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        assert self.trainer is not None
        if not state:
            return
        t = self.trainer
        if len([k for k in state if k.startswith("outer.")]) != len(self.outer):
            raise ValueError("the checkpoint's diloco.fragments differ from this run's")
        copy_into(named(t.trainable), state["local"], "local parameters")
        copy_into(dict(zip(self.names, self.shared, strict=True)), state["shared"], "shared parameters")
        load_flat_optimizer_state(t.optimizer, state["inner"])
        for f, opt in enumerate(self.outer):
            load_flat_optimizer_state(opt, state[f"outer.{f}"])
        counts = state["counts"]
        self.counts, self.done = [int(c) for c in counts["counts"]], [int(d) for d in counts["done"]]
        self.rounds = int(counts["rounds"])
        if self.hook is not None:
            index = {n: i for i, n in enumerate(self.names)}
            on = t.dist.device
            parts = {
                k.split(".", 1)[1]: {index[n]: v.to(on) for n, v in d.items() if n in index}
                for k, d in state.items()
                if k.startswith("memory.")
            }
            self.hook.memory.load_state_dict(parts)  # type: ignore[arg-type]

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        if self.hook is not None:
            self.hook.close(wait=False)
