"""vatra's own PowerSGD (``comm.powersgd_impl = "vatra"``) on 2 gloo ranks with several DDP buckets:
each step's average equals PowerSGD computed from both ranks' gradients (error feedback, warm start),
with one exchange for all buckets, overlapped or not, in fp16 or fp32, and after a resume."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests._dist import end_group, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.comm.batching import int8_sum_
from vatra.comm.lowrank import LowRankMemory, LowRankState, _pipeline_groups, lowrank_hook, worth_compressing
from vatra.comm.topology import FlatTopology

WORLD = 2
RANK = 2
SHAPES = [(5, 30), (30, 40), (40, 12)]  # the compressed weights of _model, in DDP's bucket order
STEPS = 3
CASES = [
    ("fp32", False, torch.float32, 1.0),
    ("fp32-overlap", True, torch.float32, 1.0),
    ("fp16", True, torch.float16, 1.0),
    ("fp16-overflow", True, torch.float16, 1e5),
    ("int8", False, torch.int8, 1.0),
    ("int8-large", True, torch.int8, 1e5),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 5))


def _grads(model: nn.Module, rank: int, step: int, scale: float) -> list[torch.Tensor]:
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(100 * step + rank))
    model.zero_grad()
    (model(x).square().sum() * scale).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _reference(
    per_rank: list[list[torch.Tensor]], state: dict[str, Any], index_seed: int
) -> list[torch.Tensor]:
    """PowerSGD by hand from every rank's gradients; ``state`` keeps residuals and factors."""
    out = []
    for i in range(len(per_rank[0])):
        g = [per_rank[r][i] for r in range(WORLD)]
        if not worth_compressing(g[0].shape, RANK):
            out.append(sum(g) / WORLD)
            continue
        ms = [
            (g[r] + state.get(("e", r, i), torch.zeros_like(g[r]))).reshape(g[r].shape[0], -1)
            for r in range(WORLD)
        ]
        q = state.get(("q", i))
        if q is None:
            gen = torch.Generator().manual_seed(index_seed * 1_000_003 + i)
            q = torch.randn(ms[0].shape[1], min(*ms[0].shape, RANK), generator=gen)
        p_hat = torch.linalg.qr(sum(m @ q for m in ms), mode="reduced").Q
        q_mean = sum(m.T @ p_hat for m in ms) / WORLD
        approx = p_hat @ q_mean.T
        for r in range(WORLD):
            state[("e", r, i)] = (ms[r] - approx).view_as(g[r])
        state[("q", i)] = q_mean
        out.append(approx.view_as(g[0]))
    return out


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results: dict[str, float] = {}
    try:
        # fp32 factors, overlapped or not; fp16 factors; fp16 factors whose sums overflow (a loss
        # scaled by 10⁵): sent again in fp32, so again PowerSGD's exact average
        for name, overlap, dtype, scale in CASES:
            local = _model()
            ddp = DDP(copy.deepcopy(local), bucket_cap_mb=0.002)  # 2 KB: 3 buckets after the first step
            index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
            state = LowRankState(
                FlatTopology(),
                LowRankMemory(),
                index,
                rank=RANK,
                start_step=1,
                factor_dtype=dtype,
                seed=7,
                overlap=overlap,
            )
            ddp.register_comm_hook(state, lowrank_hook)
            ref_state: dict[str, Any] = {}
            worst = 0.0
            for step in range(STEPS + 1):
                state.step = step
                if name == "fp32" and step == 2:  # a resume: residuals and factors from a saved copy
                    saved = io.BytesIO()
                    torch.save(state.memory.state_dict(), saved)
                    saved.seek(0)
                    state.memory = LowRankMemory()
                    state.memory.load_state_dict(torch.load(saved))
                x = torch.randn(16, 12, generator=torch.Generator().manual_seed(100 * step + rank))
                ddp.zero_grad()
                (ddp(x).square().sum() * scale).backward()
                got = [p.grad for p in ddp.module.parameters()]
                mine = _grads(local, rank, step, scale)
                gathered = [[torch.empty_like(t) for t in mine] for _ in range(WORLD)]
                for i, t in enumerate(mine):
                    parts = [torch.empty_like(t) for _ in range(WORLD)]
                    dist.all_gather(parts, t)
                    for r in range(WORLD):
                        gathered[r][i] = parts[r]
                want = (
                    [sum(g) / WORLD for g in zip(*gathered, strict=True)]
                    if step < 1
                    else _reference(gathered, ref_state, 7)
                )
                err = max(
                    float(((a - b).abs() / b.abs().max()).max()) for a, b in zip(got, want, strict=True)
                )
                worst = max(worst, err)  # relative to each tensor's largest entry
            results[name] = worst
            results[f"messages/{name}"] = state.counter.messages
            results[f"resends/{name}"] = state.fp32_resends
            state.close()
        # int8 sums at the edge: every rank at the top of its range sums to ±127 at most, exactly
        big = torch.tensor([[1e6, -1e6, 3.0], [0.5, 0.25, -0.125]])
        sent_summed = int8_sum_([big], [1], FlatTopology(), 1 << 20)
        assert sent_summed is not None
        sent, summed = sent_summed
        results["int8/edge"] = float(
            ((summed[0] - WORLD * big).abs() / (WORLD * big).abs().amax(1, True)).max()
        )
        results["int8/sent"] = float(((sent[0] - big).abs() / big.abs().amax(1, True)).max())
        # a non-finite value on one rank: every rank is told, none waits alone
        bad = torch.tensor([1.0, float("nan") if rank == 1 else 2.0])
        results[f"int8/nonfinite/{rank}"] = int8_sum_([bad], [None], FlatTopology(), 1 << 20) is None
        flags = torch.tensor([float(int8_sum_([bad], [None], FlatTopology(), 1 << 20) is None)])
        dist.all_reduce(flags)
        results["int8/nonfinite"] = float(flags)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        end_group()


def test_vatra_powersgd_equals_powersgd_from_both_ranks_gradients(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(out)))
    r = json.loads(out.read_text())
    print(r)
    # the same fp32 arithmetic up to the order of the all-reduce's sums
    assert r["fp32"] < 1e-5 and r["fp32-overlap"] < 1e-5 and r["fp16-overflow"] < 1e-5, r
    assert 1e-5 < r["fp16"] < 1e-2, r  # half-precision factors: rounded, not wrong
    assert r["resends/fp16"] == r["resends/fp32"] == 0, r
    # on gloo's group the exchange is pipelined: each phase one message per group of matrices (the
    # vectors travel with the first, in fp16 with error feedback), every message resent once when
    # its half-precision sum overflows; int8 is not pipelined: one message for P and the vectors,
    # one for Q, and one of the maxima before each
    mats = [(0, torch.empty(n, m), torch.empty(n, RANK), torch.empty(0)) for n, m in SHAPES]
    groups = len(_pipeline_groups(mats))
    assert groups == 2 and r["messages/fp32"] == r["messages/fp16"] == 1 + 2 * groups * STEPS, r
    assert r["resends/fp16-overflow"] == 2 * groups * STEPS, r
    # int8 factors, one scale per component: PowerSGD's average to a few per cent of each tensor's
    # largest entry, whatever the gradients' size (a loss scaled by 10⁵ is no overflow for int8)
    assert 1e-3 < r["int8"] < 0.1 and 1e-3 < r["int8-large"] < 0.1, r
    assert r["messages/int8"] == 1 + 4 * STEPS and r["resends/int8"] == r["resends/int8-large"] == 0, r
    # the shared scale: rank i's values take (127 − W)·amaxᵢ/Σamax levels, so the sum is within a level
    assert r["int8/edge"] <= 1.001 / 125 and r["int8/sent"] <= 1.001 / 125, r
    assert r["int8/nonfinite"] == WORLD, r
