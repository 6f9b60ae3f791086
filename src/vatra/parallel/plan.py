"""The layout planner: every ``dp × fsdp × tp × pp`` of a world size, its step time and memory per
rank estimated from block costs measured on one process, ranked.

The model is an estimate, meant to order layouts, not to predict to the millisecond:

- compute: the slowest pipeline stage's measured seconds per sample (stages split as
  :func:`split_stages` would), times the samples a data-parallel rank takes, divided by ``tp``; a
  pipeline adds its bubble, ``(p − 1)/(m + p − 1)`` of the step for gpipe and 1f1b,
  ``(p − 1)/(v·m + p − 1)`` interleaved over ``v`` chunks (zero_bubble is counted as interleaved
  with v = 2: a bound, its real bubble is smaller);
- communication, fp32, ring collectives at ``bandwidth`` bytes/s plus ``latency`` seconds each
  (however small), not overlapped with compute: tp: 4 all-reduces of the block's activations per
  block (2 forward, 2 backward); pp: a micro-batch's activations forward and their gradients back
  over the ``p − 1`` hops of the fill and the drain (the schedule's other sends are asynchronous
  and overlap compute); fsdp: per block and for the root, an all-gather in forward and in
  backward and a reduce-scatter of the gradients (3·(f − 1)/f of the rank's parameters); dp: an
  all-reduce (2·(d − 1)/d) of what fsdp left, one per DDP bucket (``dist.bucket_cap_mb``) or per FSDP unit;
- memory per rank: parameters, gradients and optimizer state of the rank's stage, / tp, / fsdp,
  plus one unsharded block under FSDP, plus activations by Korthikanti et al. 2022 (per layer and
  sample, 16-bit: ``s·h·(10 + 24/t + 5·a·s/(h·t))`` bytes; doubled for fp32) for the micro-batches
  a stage holds at once (gpipe: m, 1f1b: min(p, m)), plus the last stage's logits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vatra.config import Config, ParallelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError
from vatra.models import GPT, build_model
from vatra.parallel.split import measure_block_costs, split_stages

FP32 = 4
VOCAB = 256  # the text source is byte-level
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8}  # per parameter: exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Costs:
    """What one process measured and counted of the model."""

    block_s: list[float]  # forward + backward of each block on ``batch`` samples
    head_s: float  # final norm + head
    batch: int
    block_params: int
    embedding_params: int  # token + position embeddings (the first stage)
    head_params: int  # final norm + head (the last stage; a tied head's copy counts there)
    seq: int
    width: int
    heads: int
    vocab: int

    @property
    def layers(self) -> int:
        return len(self.block_s)


@dataclass(frozen=True)
class Estimate:
    """One layout's estimate; ``why`` says what makes it infeasible (empty when it is not)."""

    dp: int
    fsdp: int
    tp: int
    pp: int
    microbatches: int
    compute_s: float
    comm_s: float
    bubble: float
    memory_gb: float
    why: str = ""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def feasible(self) -> bool:
        return not self.why


def measure(cfg: Config) -> Costs:
    """Time each block of the config's gpt (forward + backward, ``train.batch_size`` samples)."""
    if cfg.model.name != "gpt":
        raise ConfigError(
            f"vatra plan: model.name = {cfg.model.name!r}; the planner knows the gpt model only"
        )
    seq = cfg.data.block_size
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, DatasetSpec(kind="lm", input_shape=(seq,), num_classes=VOCAB))
    assert isinstance(model, GPT)
    ids = torch.randint(0, VOCAB, (cfg.train.batch_size, seq))  # (B, T)
    with torch.no_grad():
        hidden = model.tok_emb(ids) + model.pos_emb(torch.arange(seq))  # (B, T, C)
    blocks = measure_block_costs(list(model.blocks), hidden)
    head = measure_block_costs([torch.nn.Sequential(model.ln_f, model.head)], hidden)[0]

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return Costs(
        block_s=blocks,
        head_s=head,
        batch=cfg.train.batch_size,
        block_params=count(model.blocks[0]),
        embedding_params=count(model.tok_emb) + count(model.pos_emb),
        head_params=count(model.ln_f) + count(model.tok_emb),
        seq=seq,
        width=cfg.model.n_embd,
        heads=cfg.model.n_head,
        vocab=VOCAB,
    )


def layouts(world: int) -> Iterator[tuple[int, int, int, int]]:
    """Every ``(dp, fsdp, tp, pp)`` whose product is ``world``."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for dp, fsdp, tp in itertools.product(divisors, repeat=3):
        if world % (dp * fsdp * tp) == 0:
            yield dp, fsdp, tp, world // (dp * fsdp * tp)


def estimate(
    costs: Costs,
    layout: tuple[int, int, int, int],
    cfg: Config,
    world: int,
    *,
    bandwidth: float,
    latency: float = 0.0,
    memory_gb: float | None = None,
) -> Estimate:
    """One layout at the global batch ``train.batch_size × world`` (what plain DDP would train)."""
    dp, fsdp, tp, pp = layout
    par = cfg.parallel
    chunks = par.virtual_stages if par.schedule == "interleaved_1f1b" else 2
    per_rank = 1 if par.schedule in ("gpipe", "1f1b") else chunks
    m = par.microbatches if par.microbatches is not None else 2 * pp
    m = m if pp > 1 else 1
    data = dp * fsdp
    batch = cfg.train.batch_size * world // data if (cfg.train.batch_size * world) % data == 0 else 0
    why = ""
    if costs.heads % tp:
        why = f"tp {tp} does not divide {costs.heads} heads"
    elif pp * per_rank > costs.layers:
        why = f"{pp * per_rank} stages > {costs.layers} blocks"
    elif not batch or batch % m:
        why = f"global batch {cfg.train.batch_size * world} does not split into {data} × {m} micro-batches"
    if why:
        return Estimate(dp, fsdp, tp, pp, m, 0.0, 0.0, 0.0, 0.0, why)

    per_sample = [c / costs.batch for c in costs.block_s]
    stages = split_stages(per_sample, pp * per_rank, last_extra=costs.head_s / costs.batch)
    slowest = max(
        sum(per_sample[i] for i in s) + (costs.head_s / costs.batch if k == len(stages) - 1 else 0.0)
        for k, s in enumerate(stages)
    )
    work = slowest * per_rank * batch / tp  # this rank's chunks, the whole batch, its tp share
    bubble = (pp - 1) / ((per_rank if per_rank > 1 else 1) * m + pp - 1) if pp > 1 else 0.0
    compute = work / (1.0 - bubble)

    layers = costs.layers / pp  # per rank
    act = batch * costs.seq * costs.width * FP32  # (b, T, C) of a data-parallel rank's batch
    comm = 0.0
    if tp > 1:
        comm += layers * 4 * (2 * (tp - 1) / tp * act / bandwidth + latency)
    if pp > 1:  # sends overlap the next micro-batch's compute but on the fill and the drain
        comm += 2 * (pp - 1) * (act / m / bandwidth + latency)
    params = layers * costs.block_params / tp + max(costs.embedding_params, costs.head_params)
    grad_bytes = params * FP32
    units = math.ceil(layers) + 1  # FSDP's: each block and the root
    if fsdp > 1:
        comm += 3 * (fsdp - 1) / fsdp * grad_bytes / bandwidth + 3 * units * latency
    if dp > 1:
        messages = units if fsdp > 1 else max(1, math.ceil(grad_bytes / (cfg.dist.bucket_cap_mb * 2**20)))
        comm += 2 * (dp - 1) / dp * grad_bytes / fsdp / bandwidth + messages * latency

    optim = OPTIMIZER_BYTES.get(cfg.optim.name, FP32 if cfg.optim.momentum > 0 else 0)
    memory = params * (2 * FP32 + optim) / fsdp
    if fsdp > 1:
        memory += costs.block_params / tp * 2 * FP32  # the block being computed, whole
    s, h, a = costs.seq, costs.width, costs.heads
    per_layer_sample = 2 * s * h * (10 + 24 / tp + 5 * a * s / (h * tp))  # fp32: twice the 16-bit bytes
    in_flight = 1 if pp == 1 else (m if par.schedule == "gpipe" else min(pp, m))
    micro = batch / m
    memory += layers * per_layer_sample * micro * in_flight
    memory += micro * s * costs.vocab * FP32 * 2  # logits and their gradient (last stage)
    gb = memory / 2**30
    if memory_gb is not None and gb > memory_gb:
        why = f"needs {gb:.3g} GB > {memory_gb:g} GB"
    return Estimate(dp, fsdp, tp, pp, m, compute, comm, bubble, gb, why)


def plan(
    costs: Costs,
    cfg: Config,
    world: int,
    *,
    bandwidth: float,
    latency: float = 0.0,
    memory_gb: float | None = None,
) -> list[Estimate]:
    """Every layout of ``world``, the feasible ones first, fastest first."""
    found = [
        estimate(costs, layout, cfg, world, bandwidth=bandwidth, latency=latency, memory_gb=memory_gb)
        for layout in layouts(world)
    ]
    return sorted(found, key=lambda e: (not e.feasible, e.step_s if e.feasible else 0.0, e.why))


def choose(cfg: Config, world: int) -> ParallelConfig:
    """``parallel.auto``: the fastest feasible layout (with the config's pipeline schedule), measured
    here; a ``ConfigError`` when none fits ``parallel.auto_memory_gb``."""
    par = cfg.parallel
    ranked = plan(
        measure(cfg),
        cfg,
        world,
        bandwidth=par.auto_bandwidth_gbs * 1e9,
        latency=par.auto_latency_us * 1e-6,
        memory_gb=par.auto_memory_gb,
    )
    best = next((e for e in ranked if e.feasible), None)
    if best is None:
        reasons = "; ".join(f"dp {e.dp} fsdp {e.fsdp} tp {e.tp} pp {e.pp}: {e.why}" for e in ranked[:3])
        raise ConfigError(
            f"parallel.auto: no layout of {world} ranks fits: {reasons}; raise "
            "parallel.auto_memory_gb, lower train.batch_size, or add ranks"
        )
    layout = {"dp": best.dp, "fsdp": best.fsdp, "tp": best.tp, "pp": best.pp, "auto": False}
    return par.model_copy(update=layout)
