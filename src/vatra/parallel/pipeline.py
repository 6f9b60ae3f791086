"""Pipeline parallelism for gpt: stages from measured block costs, torch.distributed.pipelining schedules.

Call order: :func:`build_pipeline` (collective: measures on pp rank 0 of the first data replica,
broadcasts the split, builds this rank's stage modules, applies tp and fsdp to them, makes the
schedule), then per optimizer step ``zero_grad`` → :meth:`Pipeline.step` → ``optimizer.step``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase

from vatra.config import ParallelConfig
from vatra.errors import ConfigError
from vatra.models.gpt import GPT
from vatra.parallel.fsdp import apply_fsdp
from vatra.parallel.grads import local_tensor
from vatra.parallel.mesh import Mesh
from vatra.parallel.split import measure_block_costs, split_stages
from vatra.parallel.tp import apply_tp

# All four ran on gloo (CPU) here with 2 and 4 ranks and matched the unsplit model (tests/test_parallel.py).
SINGLE_STAGE: dict[str, type[S.PipelineScheduleSingle]] = {
    "gpipe": S.ScheduleGPipe,
    "1f1b": S.Schedule1F1B,
}
MULTI_STAGE: dict[str, type[S.PipelineScheduleMulti]] = {
    "interleaved_1f1b": S.ScheduleInterleaved1F1B,
    "zero_bubble": S.ScheduleZBVZeroBubble,
}


class StageClock:
    """Seconds a rank's pipeline stages compute in a step, and the seconds the schedule ran: their
    difference is the rank's share of the bubble (waiting on its neighbours' sends and receives).

    Timed around torch's per-micro-batch calls (a stage's forward, backward of inputs and of weights,
    and the last stage's loss), so the waits between them are left out. On a GPU each call is timed
    with a pair of CUDA events, read when the step is taken (:meth:`take`), so no call synchronises.
    """

    CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.busy_s = 0.0
        self.wall_s = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, obj: object, name: str) -> None:
        """Time ``obj.name`` from now on (an instance attribute over the bound method)."""
        call = getattr(obj, name)

        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = call(*args, **kwargs)
                end.record()
                self.events.append((start, end))
                return out
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.busy_s += time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> tuple[float, float]:
        """(compute seconds, schedule seconds) since the last take; both restart from 0."""
        busy = self.busy_s
        if self.events:
            self.events[-1][1].synchronize()
            busy += sum(start.elapsed_time(end) for start, end in self.events) / 1e3
        out = (busy, self.wall_s)
        self.busy_s = self.wall_s = 0.0
        self.events = []
        return out


class GPTStage(nn.Module):
    """Some of a :class:`GPT`'s blocks, with the embeddings on the first stage and the final norm
    and head on the last. Parameter names are the whole model's (``blocks.3.attn.qkv.weight``), so
    a checkpoint of any split loads into any other, or into the unsplit model.

    The head is tied to the token embedding; when they sit on different stages the last stage
    holds its own copy, kept equal by summing both gradients (:meth:`Pipeline.sync_tied`).
    """

    def __init__(self, model: GPT, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.block_size = model.block_size
        self.width = model.tok_emb.embedding_dim  # C of the hidden state passed between stages
        if first:
            self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.ln_f = model.ln_f
            self.head = model.head
            if not first:  # untie: the embedding lives on another stage
                self.head = nn.Linear(model.head.in_features, model.head.out_features, bias=False)
                self.head.weight = nn.Parameter(model.head.weight.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.first:  # x: token ids (B, T)
            pos = torch.arange(x.shape[1], device=x.device)  # (T,)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


class StageUnion(nn.Module):
    """A rank's several stages as one module for the optimizer and checkpoints: the same parameter
    objects under the whole model's names (``blocks`` merged). It is never run forward."""

    def __init__(self, stages: list[GPTStage]) -> None:
        super().__init__()
        blocks: dict[str, nn.Module] = {}
        for stage in stages:
            blocks.update(stage.blocks.items())
            if stage.first:
                self.tok_emb, self.pos_emb, self.drop = stage.tok_emb, stage.pos_emb, stage.drop
            if stage.last:
                self.ln_f, self.head = stage.ln_f, stage.head
        self.blocks = nn.ModuleDict(dict(sorted(blocks.items(), key=lambda kv: int(kv[0]))))

    def forward(self, *args: object) -> Tensor:
        raise RuntimeError("StageUnion holds a rank's pipeline stages for checkpoints; it does not run")


def stage_ids(pp_rank: int, pp: int, schedule: str, per_rank: int) -> list[int]:
    """The stages a pp rank runs: one; looped (``interleaved_1f1b``: r, r + pp, …); or V-shaped
    (``zero_bubble``: r and 2·pp − 1 − r, so rank 0 holds the first and the last)."""
    if schedule == "zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + pp * v for v in range(per_rank)]


@dataclass
class Pipeline:
    """This rank's stages of a pipelined model and the schedule that runs them."""

    stages: list[GPTStage]
    ids: list[int]
    n_stages: int
    schedule: S._PipelineSchedule
    mesh: Mesh
    split: list[range]
    tied_group: dist.ProcessGroup | None = None  # ranks holding the first and the last stage
    last_owner: int = 0  # pp rank of the last stage
    owners: list[int] = field(default_factory=list)  # stage id → the pp rank that runs it
    losses: list[Tensor] = field(default_factory=list)
    clock: StageClock = field(default_factory=lambda: StageClock(torch.device("cpu")))

    @property
    def has_first(self) -> bool:
        return 0 in self.ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.ids

    def parameters(self) -> Iterator[nn.Parameter]:
        for stage in self.stages:
            yield from stage.parameters()

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters counted in the global gradient norm: the head's copy of the tied embedding
        is left out (its gradient equals the embedding's after :meth:`sync_tied`)."""
        skip = {id(s.head.weight) for s in self.stages if s.last and not s.first}
        return [p for p in self.parameters() if id(p) not in skip]

    def step(self, inputs: Tensor | None, target: Tensor | None, *, sync_tied: bool = True) -> Tensor:
        """Forward and backward of one batch in ``microbatches`` pieces; the gradients left are those
        of the batch's mean loss (the schedule divides by the micro-batch count). Returns that mean
        loss on every rank of the pipeline (sent from the last stage).

        The first stage reads ``inputs``, the last ``target``; the others may pass None.
        ``sync_tied``: sum the tied weights' gradients now; when gradients accumulate over several
        steps, pass False and call :meth:`sync_tied` once after the last (summing twice double-counts).
        """
        self.losses = []
        args = (inputs,) if self.has_first else ()
        t0 = time.perf_counter()
        if self.has_last:
            self.schedule.step(*args, target=target, losses=self.losses)
        else:
            self.schedule.step(*args)
        self.clock.wall_s += time.perf_counter() - t0
        if sync_tied:
            self.sync_tied()
        device = next(self.parameters()).device
        loss = torch.stack(self.losses).mean().detach() if self.has_last else torch.zeros((), device=device)
        return self.from_last(loss)

    def busy_and_bubble(self) -> tuple[float, float]:
        """Collective over pp: this rank's stage compute seconds since the last call, and its share
        of the pipeline's time spent not computing. The pipeline's time is the longest of the pp
        ranks' schedule times (they start together, synchronised by the step before; the last stage's
        schedule returns while the first is still running backward, and its wait then is bubble too)."""
        busy, wall = self.clock.take()
        span = torch.tensor(wall, dtype=torch.float64, device=next(self.parameters()).device)
        pp = self.mesh["pp"]
        if pp.size() > 1:
            dist.all_reduce(span, op=dist.ReduceOp.MAX, group=pp.get_group())
        longest = float(span)
        return busy, max(0.0, 1.0 - busy / longest) if longest > 0 else 0.0

    def from_last(self, t: Tensor) -> Tensor:
        """``t`` as the last stage holds it, on every rank of the pipeline (a broadcast over pp)."""
        pp = self.mesh["pp"]
        if pp.size() > 1:
            dist.broadcast(t, group=pp.get_group(), group_src=self.last_owner)
        return t

    @property
    def module(self) -> nn.Module:
        """What this rank trains and checkpoints: its stage, or the union of its stages (one set of
        names, the whole model's, for the optimizer and the state dict)."""
        return self.stages[0] if len(self.stages) == 1 else StageUnion(self.stages)

    @torch.no_grad()
    def forward_only(self, inputs: Tensor) -> Tensor | None:
        """The model's output for ``inputs`` (token ids ``(b, T)``, the same on every pp rank) on the
        rank of the last stage, None elsewhere: every stage's forward in turn, the hidden state
        ``(b, T, C)`` sent to the next stage's rank with a plain send/recv (kept when the next
        stage is this rank's too). For evaluation, where batch sizes vary and the schedule's
        stages, which fix their micro-batch shapes at the first step, cannot be used."""
        pp = self.mesh["pp"]
        group, me = pp.get_group(), pp.get_local_rank()
        owners = self.owners
        mine = dict(zip(self.ids, self.stages, strict=True))
        x: Tensor = inputs
        for sid in range(self.n_stages):
            if owners[sid] != me:
                continue
            stage = mine[sid]
            if sid > 0 and owners[sid - 1] != me:
                x = torch.empty(*inputs.shape, stage.width, device=inputs.device)  # (b, T, C)
                dist.recv(x, group=group, group_src=owners[sid - 1])
            x = stage(x)
            if sid < self.n_stages - 1 and owners[sid + 1] != me:
                dist.send(x.contiguous(), group=group, group_dst=owners[sid + 1])
        return x if self.has_last else None

    def sync_tied(self) -> None:
        """Sum the gradients of the token embedding (first stage) and the head's copy (last stage)."""
        tied = [s.tok_emb.weight for s in self.stages if s.first and not s.last]
        tied += [s.head.weight for s in self.stages if s.last and not s.first]
        if not tied:
            return
        with torch.no_grad():  # the local shards (FSDP: both weights are sharded alike)
            local = [local_tensor(p.grad) for p in tied if p.grad is not None]
        total = torch.stack(local).sum(0)
        if self.tied_group is not None:
            dist.all_reduce(total, group=self.tied_group)
        for g in local:
            g.copy_(total)


def _tied_group(mesh: Mesh, last_owner: int) -> dist.ProcessGroup | None:
    """Collective (every rank creates every group, in one order): per position on the other axes,
    a group of the ranks holding pp rank 0 and ``last_owner``; None when both are this rank."""
    if last_owner == 0:
        return None
    ranks = mesh.mesh.mesh  # (pp, dp_replicate, dp_shard, tp) → global rank
    mine: dist.ProcessGroup | None = None
    me = dist.get_rank()
    for pair in torch.stack([ranks[0], ranks[last_owner]], dim=-1).reshape(-1, 2).tolist():
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


def _agreed_split(model: GPT, mesh: Mesh, n_stages: int, example: Tensor) -> list[range]:
    """Stage boundaries from the block costs measured by global rank 0, the same on every rank."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        with torch.no_grad():
            pos = torch.arange(example.shape[1], device=example.device)  # (T,)
            hidden = model.tok_emb(example) + model.pos_emb(pos)  # (B, T, C)
        with torch.random.fork_rng():  # dropout in the timed runs draws nothing from training's RNG
            costs = measure_block_costs(list(model.blocks), hidden)
            head = measure_block_costs([nn.Sequential(model.ln_f, model.head)], hidden)[0]
        box[0] = split_stages(costs, n_stages, last_extra=head)
    dist.broadcast_object_list(box, src=0)
    split = box[0]
    assert isinstance(split, list)
    return split


def build_pipeline(
    model: nn.Module,
    mesh: Mesh,
    cfg: ParallelConfig,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    example: Tensor,
) -> Pipeline:
    """Collective: split ``model`` into ``pp × stages_per_rank`` stages and build this rank's.

    ``example``: one micro-batch of inputs (token ids ``(b, T)``) to measure the blocks on. Every
    rank must hold the same initial ``model`` (same seed). Tensor parallelism (``tp``) and FSDP
    (``dp × fsdp``) are applied to each stage module.
    """
    if not isinstance(model, GPT):
        raise ConfigError(
            f"parallel.pp = {cfg.pp}: pipelining splits the built-in gpt model's blocks; "
            f"{type(model).__name__} has no known block list (use fsdp or tp for it)"
        )
    per_rank = cfg.stages_per_rank
    n_stages = cfg.pp * per_rank
    split = _agreed_split(model, mesh, n_stages, example)
    ids = stage_ids(mesh.pp_rank, cfg.pp, cfg.schedule, per_rank)
    modules = [GPTStage(model, split[i], first=i == 0, last=i == n_stages - 1) for i in ids]
    for module in modules:
        if cfg.tp > 1:
            apply_tp(module, mesh["tp"])
        if mesh.data_world > 1:
            apply_fsdp(module, mesh.data, cfg, blocks=list(module.blocks.values()))
    group = mesh["pp"].get_group()
    device = example.device
    stages: list[_PipelineStageBase] = [
        PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids, strict=True)
    ]
    schedule: S._PipelineSchedule
    if per_rank == 1:
        single = SINGLE_STAGE[cfg.schedule]
        schedule = single(stages[0], n_microbatches=cfg.n_microbatches, loss_fn=loss_fn)
    else:
        multi = MULTI_STAGE[cfg.schedule]
        schedule = multi(stages, n_microbatches=cfg.n_microbatches, loss_fn=loss_fn)
    last_owner = 0 if cfg.schedule == "zero_bubble" else cfg.pp - 1
    owners = [0] * n_stages
    for r in range(cfg.pp):
        for sid in stage_ids(r, cfg.pp, cfg.schedule, per_rank):
            owners[sid] = r
    tied = _tied_group(mesh, last_owner)
    clock = StageClock(device)
    for stage in stages:
        for name in StageClock.CALLS:
            clock.wrap(stage, name)
    clock.wrap(schedule, "_maybe_compute_loss")  # the last stage's loss of each micro-batch
    return Pipeline(modules, ids, n_stages, schedule, mesh, split, tied, last_owner, owners, clock=clock)
