"""Hierarchical topology with a lossy compressor (4 gloo ranks, hosts [[0, 1], [2, 3]]): each host's
exact gradient sum is compressed once by its leader with the host's error feedback, only leaders'
payloads cross hosts, and the result equals a reference computed from the four ranks' gradients."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tests._dist import end_group, spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.comm import (
    ByteCounter,
    Compressor,
    HierarchicalTopology,
    HookState,
    Memory,
    MomentumMemory,
    build_compressor,
    compression_hook,
)
from vatra.config import CommConfig

HOSTS = [[0, 1], [2, 3]]
WORLD = 4
MIN_NUMEL = 100  # the weights (480, 1200, 150 elements) are compressed, the biases (40, 30, 5) not
MOMENTUM = 0.9
COMPRESSED_STEPS = 2  # the second one sends what error feedback kept from the first
# name: (method, momentum correction, warm-up steps)
CASES = {
    "topk": ("topk", False, 0),
    "onebit": ("onebit", False, 0),
    "fp16": ("fp16", False, 0),
    "topk+mc": ("topk", True, 0),
    "topk+mc+warmup": ("topk", True, 1),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 5))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(16, 12, generator=torch.Generator().manual_seed(100 * step + rank))
    return model(x).square().sum()


class _Reference:
    """The composition, computed from all four ranks' gradients: per host the exact sum (leader +
    member), the host's velocity and error feedback, compress and decompress; the hosts' results
    summed (payloads summed first when the compressor is summable) and divided by 4. Uncompressed
    tensors (small ones, warm-up steps) are the mean of each rank's own gradient or velocity."""

    def __init__(self, comp: Compressor, momentum_correction: bool, start_step: int) -> None:
        self.comp, self.mc, self.start_step = comp, momentum_correction, start_step
        self.residual: dict[tuple[int, int], torch.Tensor] = {}  # (host, tensor)
        self.velocity: dict[tuple[str, int, int], torch.Tensor] = {}  # ("rank"/"host", index, tensor)

    def _accumulate(self, key: tuple[str, int, int], g: torch.Tensor) -> torch.Tensor:
        u = self.velocity.get(key)
        self.velocity[key] = u = g.clone() if u is None else MOMENTUM * u + g
        return u

    def step(self, step: int, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for i in range(len(grads[0])):
            g = [grads[r][i] for r in range(WORLD)]
            if step < self.start_step or g[0].numel() < MIN_NUMEL:
                sent = [self._accumulate(("rank", r, i), g[r]) for r in range(WORLD)] if self.mc else g
                out.append(((sent[0] + sent[1]) + (sent[2] + sent[3])) / WORLD)
                continue
            payloads, decompressed = [], []
            for h, (leader, member) in enumerate(HOSTS):
                s = g[leader] + g[member]
                if self.mc:
                    if ("rank", leader, i) in self.velocity:  # the first compressed step after warm-up
                        own = [self.velocity.pop(("rank", r, i)) for r in (leader, member)]
                        self.velocity[("host", h, i)] = own[0] + own[1]  # the host sum's velocity
                    s = self._accumulate(("host", h, i), s)
                e = self.residual.get((h, i))
                x = s.clone() if e is None else s + e
                payload, ctx = self.comp.compress(x)
                sent_h = self.comp.decompress(payload, ctx)
                self.residual[(h, i)] = x - sent_h
                if self.mc:  # momentum-factor masking, on the host sum's velocity
                    self.velocity[("host", h, i)].masked_fill_(sent_h != 0, 0.0)
                payloads.append(payload)
                decompressed.append(sent_h)
            if self.comp.summable:
                summed = [a + b for a, b in zip(*payloads, strict=True)]
                out.append(self.comp.decompress(summed, ctx) / WORLD)
            else:
                total = torch.zeros_like(g[0])
                for d in decompressed:
                    total += d
                out.append(total / WORLD)
        return out


def _payload_bytes(comp: Compressor, shapes: list[torch.Size]) -> int:
    """Bytes of one host's payloads: their layout depends only on the shapes."""
    return sum(t.numel() * t.element_size() for s in shapes for t in comp.compress(torch.randn(s))[0])


def _run_case(rank: int, name: str, topology: HierarchicalTopology) -> dict[str, Any]:
    method, mc, start_step = CASES[name]
    cfg = CommConfig(method=method, ratio=0.1, min_numel=MIN_NUMEL)
    memory = MomentumMemory(MOMENTUM, masking=method == "topk") if mc else Memory()
    state = HookState(
        build_compressor(cfg), memory, topology, start_step=start_step, min_numel=MIN_NUMEL, overlap=True
    )
    local = _model()
    ddp = DDP(copy.deepcopy(local), bucket_cap_mb=0.002)  # 2 KB: 3 buckets after the first step
    ddp.register_comm_hook(state, compression_hook)
    reference = _Reference(build_compressor(cfg), mc, start_step)
    shapes = [p.shape for p in local.parameters()]
    small = sum(s.numel() for s in shapes if s.numel() < MIN_NUMEL)
    large = [s for s in shapes if s.numel() >= MIN_NUMEL]
    worst, cross, sent = 0.0, [], []
    for step in range(start_step + COMPRESSED_STEPS):
        # Execute: one DDP step through the hook; the local model gives this rank's own gradient
        state.step = step
        state.counter.reset()
        _loss(ddp, rank, step).backward()
        got = [p.grad.clone() for p in ddp.module.parameters()]
        ddp.zero_grad()
        _loss(local, rank, step).backward()
        mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
        local.zero_grad()
        every = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        grads = [list(torch.split(e, [s.numel() for s in shapes])) for e in every]
        want = reference.step(step, [[t.view(s) for t, s in zip(r, shapes, strict=True)] for r in grads])
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)))
        if step >= start_step:
            cross.append(state.counter.cross_host)
            sent.append(state.counter.sent)
    state.close()
    return {
        "max_abs_diff": worst,
        "cross_host": cross,
        "sent": sent,
        "payload_bytes": _payload_bytes(state.compressor, large),
        "small_bytes": 4 * small,
        "large_bytes": 4 * sum(s.numel() for s in large),
    }


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        topology = HierarchicalTopology(HOSTS, ByteCounter())  # its groups are built once
        results = {name: _run_case(rank, name, topology) for name in CASES}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        end_group()


def test_hosts_compress_their_exact_sum_and_only_payloads_cross_hosts(tmp_path: Path) -> None:
    # Execute
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(json.dumps(ranks[0], indent=1))

    for name in CASES:
        # Assert: the reference's gradients on every rank. Exactly: the hook adds the same fp32
        # numbers in the same order (leader + member; hosts in order; division last). After a
        # warm-up, the host's velocity starts as m·u_leader + g_leader + (m·u_member + g_member)
        # on the leader and m·(u_leader + u_member) + (g_leader + g_member) in the reference: the
        # same sum rounded in another order, so 1e-6.
        tolerance = 1e-6 if CASES[name][2] else 0.0
        for r in range(WORLD):
            assert ranks[r][name]["max_abs_diff"] <= tolerance, (name, r, ranks[r][name])
        # Assert: bytes. Members send their host's leader every tensor in fp32 and nothing across
        # hosts; a leader's cross-host bytes are its host's payloads (one exchange among 2 leaders)
        # plus the small tensors' fp32 ring, and it sends its member the average of everything.
        for leader, member in HOSTS:
            lead, memb = ranks[leader][name], ranks[member][name]
            want_cross = lead["payload_bytes"] + lead["small_bytes"]
            assert lead["cross_host"] == [want_cross] * len(lead["cross_host"]), (name, lead)
            assert lead["sent"] == [want_cross + lead["small_bytes"] + lead["large_bytes"]] * len(
                lead["sent"]
            )
            assert memb["cross_host"] == [0] * len(memb["cross_host"])
            assert memb["sent"] == [memb["small_bytes"] + memb["large_bytes"]] * len(memb["sent"])
        # compressed only: what crossed hosts is far below the fp32 gradient
        assert ranks[0][name]["cross_host"][-1] < 0.6 * (
            ranks[0][name]["large_bytes"] + ranks[0][name]["small_bytes"]
        )
