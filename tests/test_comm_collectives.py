"""vatra's ring and hierarchical collectives equal torch.distributed's, with exact byte counts."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from tests._dist import end_group, spawn

import vatra.comm.hierarchical as hier_module
import vatra.comm.ring as ring_module
from vatra.comm import (
    ByteCounter,
    FlatTopology,
    HierarchicalTopology,
    RingTopology,
    all_gather_coalesced,
    all_reduce_coalesced_,
    fuse_groups,
)

SIZES = [1, 2, 3, 7, 100, 1001, 4099]  # odd sizes, and sizes below the world size (empty ring chunks)
LAYOUTS = {
    2: [[0], [1]],
    3: [[0, 1], [2]],
    4: [[0, 1], [2, 3]],
    5: [[0, 1, 2], [3, 4]],
    6: [[0, 1, 2], [3, 4, 5]],
}


def _data(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


def _worker(rank: int, max_world: int, rdzv_dir: str) -> None:
    """One spawn for every world size: ranks < W form a fresh default group of size W in turn."""
    torch.set_num_threads(1)
    ring_module.PIECE_BYTES = 256  # large ring messages travel in pieces: make small tests use them too
    hier_module.CHUNK_BYTES = 1024  # and the hierarchical pipeline in chunks: n > 256 takes several
    for world in range(2, max_world + 1):
        if rank < world:
            init = f"file://{rdzv_dir}/rdzv{world}"
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
            try:
                _check_world(rank, world)
            finally:
                end_group()


def _check_world(rank: int, world: int) -> None:
    ring = RingTopology(ByteCounter())
    hier = HierarchicalTopology(LAYOUTS[world], ByteCounter())
    flat = FlatTopology(ByteCounter())
    for n in SIZES:
        want = _data(rank, n).clone()
        dist.all_reduce(want)
        for topo in (ring, hier, flat):
            got = _data(rank, n)
            topo.all_reduce_(got)
            # Same numbers summed in a different order: fp32 rounding differs by a few ulps.
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{topo.name} n={n}")
        for topo in (ring, hier, flat):
            got = topo.all_gather(_data(rank, n))
            want_g = torch.cat([_data(r, n) for r in range(world)])
            assert torch.equal(got, want_g), f"{topo.name} all_gather n={n}"
    # exact bytes: ring all-reduce sends every chunk except one, in each of its two phases
    n = 1001
    ring.counter.reset()
    ring.all_reduce_(_data(rank, n))
    chunks = [c.numel() for c in torch.empty(n).tensor_split(world)]
    me = rank
    reduce_scatter = sum(chunks[(me - s) % world] for s in range(world - 1))
    all_gather = sum(chunks[(me + 1 - s) % world] for s in range(world - 1))
    assert ring.counter.sent == 4 * (reduce_scatter + all_gather)
    # hierarchical: members send n to their leader; leaders ring every pipeline chunk among leaders
    # and send n to each member
    hier.counter.reset()
    hier.all_reduce_(_data(rank, n))
    host = next(h for h in LAYOUTS[world] if rank in h)
    leaders = [h[0] for h in LAYOUTS[world]]
    if rank != host[0]:
        assert hier.counter.sent == 4 * n and hier.counter.cross_host == 0
    else:
        h, pos = len(leaders), leaders.index(rank)
        ring_part = 0
        for chunk in torch.empty(n).split(hier_module.CHUNK_BYTES // 4):
            lchunks = [c.numel() for c in chunk.tensor_split(h)]
            ring_part += sum(lchunks[(pos - s) % h] + lchunks[(pos + 1 - s) % h] for s in range(h - 1))
        assert hier.counter.sent == 4 * (ring_part + n * (len(host) - 1))
        assert hier.counter.cross_host == 4 * ring_part  # only the leaders' ring leaves the host
    # the host-local steps on their own: an exact sum on the leader (members added in rank order),
    # then the leader's tensor on every rank of the host
    host_sum = _data(host[0], n).clone()
    for r in host[1:]:
        host_sum += _data(r, n)
    got = hier.reduce_to_leader_(_data(rank, n))
    assert torch.equal(got, host_sum if rank == host[0] else _data(rank, n))
    assert torch.equal(hier.broadcast_from_leader_(got), host_sum)
    # fp16 through the ring: the sum is done in fp16 by torch
    got16 = _data(rank, 513, torch.float16)
    ring.all_reduce_(got16)
    want16 = sum(_data(r, 513, torch.float16).float() for r in range(world))
    torch.testing.assert_close(got16.float(), want16, rtol=2e-3, atol=2e-2)
    # batching: many small tensors of mixed dtypes, fused into 1 KiB buckets
    small = [_data(rank, n) for n in (3, 50, 200, 7, 300)] + [_data(rank, 9, torch.float64)]
    want_small = [t.clone() for t in small]
    for t in want_small:
        dist.all_reduce(t)
    hier.counter.reset()
    all_reduce_coalesced_(small, hier, bucket_bytes=1024)
    for got, want in zip(small, want_small, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    parts = [_data(rank, 5), torch.arange(rank, rank + 4, dtype=torch.int32), _data(rank, 3).half()]
    per_rank = all_gather_coalesced(parts, ring, bucket_bytes=16)
    for r in range(world):
        assert torch.equal(per_rank[r][0], _data(r, 5))
        assert torch.equal(per_rank[r][1], torch.arange(r, r + 4, dtype=torch.int32))
        assert torch.equal(per_rank[r][2], _data(r, 3).half())


def test_ring_and_hierarchical_equal_all_reduce_for_world_sizes_2_to_6(tmp_path: Path) -> None:
    spawn(_worker, 6, (6, str(tmp_path)))


def test_fuse_groups_respects_bucket_size() -> None:
    tensors = [torch.empty(n) for n in (10, 10, 10, 100, 1, 1)]  # 40, 40, 40, 400, 4, 4 bytes
    assert fuse_groups(tensors, bucket_bytes=80) == [[0, 1], [2], [3], [4, 5]]
    assert fuse_groups(tensors, bucket_bytes=10_000) == [[0, 1, 2, 3, 4, 5]]
