"""dist.ps_wire: what a push and a pull put on the wire, error feedback on both sides, the config
key, and where the launcher places the server shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import small_config, vatra_in_process

from vatra.asyncdp.ps import Codec, PushEncoder, split_even
from vatra.asyncrun import place
from vatra.config import CommConfig
from vatra.errors import ConfigError

NUMELS = [4096, 300, 10]  # a matrix, a vector over SMALL, a bias under it


def _shard(seed: int) -> torch.Tensor:
    return torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("wire", "nbytes"),
    [
        ("fp32", 4 * 4406),
        ("fp16", 2 * 4406),
        ("bf16", 2 * 4406),
        # top 10 %: 410 and 30 fp32 values with a bitmask of where (⌈n/8⌉ bytes); the bias dense
        ("topk", (512 + 4 * 410) + (38 + 4 * 30) + 4 * 10),
    ],
)
def test_a_codec_sends_its_stated_bytes_and_decodes_what_it_says(wire: str, nbytes: int) -> None:
    codec = Codec(NUMELS, wire, CommConfig(ratio=0.1))
    x = _shard(0)
    buf, seen = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes == nbytes
    torch.testing.assert_close(codec.decode(buf), seen, rtol=0, atol=0)  # the receiver sees what EF assumes
    if wire == "fp32":
        assert torch.equal(seen, x)
    elif wire != "topk":
        torch.testing.assert_close(seen, x, rtol=1e-2, atol=1e-2)
    else:
        kept = seen[:4096] != 0
        assert int(kept.sum()) == 410 and torch.equal(seen[:4096][kept], x[:4096][kept])
        assert torch.equal(seen[-10:], x[-10:])  # small tensors are not compressed


@pytest.mark.parametrize("wire", ["topk", "randomk", "onebit", "qsgd", "int8", "bf16"])
def test_every_compressor_decodes_from_bytes_what_its_sender_assumed(wire: str) -> None:
    codec = Codec(NUMELS, wire, CommConfig(ratio=0.1))
    buf, seen = codec.encode(_shard(3))
    assert buf.numel() == codec.nbytes < 4 * sum(NUMELS)
    assert torch.equal(codec.decode(buf), seen)


@pytest.mark.parametrize("wire", ["topk", "onebit", "fp16"])
def test_pull_deltas_with_error_feedback_track_the_servers_parameters(wire: str) -> None:
    # Prepare: a server's shard that moves every step, and a worker's copy fed only decoded deltas
    codec = Codec(NUMELS, wire, CommConfig(ratio=0.1))
    params, server_copy = _shard(1), torch.zeros(sum(NUMELS))
    worker_copy, naive = torch.zeros(sum(NUMELS)), torch.zeros(sum(NUMELS))
    # Execute: 60 pulls of the change since the copy, the server moving in between; ``naive``
    # gets each step's own change compressed, with nothing carried over
    before = torch.zeros(sum(NUMELS))
    for step in range(60):
        params = params + 0.01 * _shard(100 + step) if step else params
        buf, seen = codec.encode(params - server_copy)
        server_copy += seen
        worker_copy += codec.decode(buf)
        naive += codec.encode(params - before)[1]
        before = params
    # Assert: both copies are the same bits, and what compression dropped was sent later
    assert torch.equal(server_copy, worker_copy)
    gap = float((params - worker_copy).norm() / params.norm())
    assert gap < (1e-3 if wire == "fp16" else 0.1)
    if wire != "fp16":
        assert float((params - naive).norm() / params.norm()) > 3 * gap


def test_push_error_feedback_sends_the_residual_with_the_next_push() -> None:
    codec = Codec(NUMELS, "topk", CommConfig(ratio=0.1))
    encoder = PushEncoder(codec)
    g = _shard(2)
    sent = sum(codec.decode(encoder.encode(g)) for _ in range(30))
    # 30 pushes of the same gradient: error feedback delivers ~30 g in total, not 30 × top-10 %
    assert isinstance(sent, torch.Tensor)
    assert ((sent - 30 * g).norm() / (30 * g).norm()) < 0.2
    encoder.forget()
    assert encoder.memory is not None and not encoder.memory.residuals
    assert PushEncoder(Codec(NUMELS, "fp16")).memory is None  # rounding is unbiased: nothing to carry


def test_ps_wire_is_checked_and_the_old_comm_method_still_names_the_dtype() -> None:
    assert small_config(dist={"mode": "async"}).dist.ps_wire == "fp16"
    assert small_config(dist={"mode": "async"}, comm={"method": "bf16"}).dist.ps_wire == "bf16"
    assert small_config(dist={"mode": "async", "ps_wire": "topk"}).dist.ps_wire == "topk"
    with pytest.raises(ConfigError, match=r"dist\.ps_wire"):
        small_config(dist={"mode": "async", "ps_wire": "fp32"}, comm={"method": "fp16"})
    with pytest.raises(ConfigError, match=r"dist\.ps_wire"):
        small_config(dist={"mode": "async"}, comm={"method": "topk"})
    with pytest.raises(ConfigError, match="not a per-tensor compressor"):
        small_config(dist={"ps_wire": "powersgd"})
    with pytest.raises(ConfigError, match="unknown compressor"):
        small_config(dist={"ps_wire": "fp8"})


@pytest.mark.parametrize(
    ("world", "per_host", "servers", "server_ranks"),
    [
        (3, 3, 1, [2]),  # one host: the last ranks, as before
        (4, 4, 2, [2, 3]),
        (5, 1, 1, [4]),  # 4 worker hosts and a server host
        (6, 1, 2, [4, 5]),
        (8, 2, 4, [1, 3, 5, 7]),  # 4 hosts × 2: a worker and a server shard on every host
        (8, 2, 2, [5, 7]),  # two shards on the last two hosts, not both on the last
        (9, 3, 2, [5, 8]),
    ],
)
def test_the_launcher_puts_each_server_shard_on_another_host(
    world: int, per_host: int, servers: int, server_ranks: list[int]
) -> None:
    roles = [place(r, world, per_host, servers) for r in range(world)]
    assert [r for r, (role, _) in enumerate(roles) if role == "server"] == server_ranks
    assert [i for role, i in roles if role == "server"] == list(range(servers))
    assert [i for role, i in roles if role == "worker"] == list(range(world - servers))
    assert roles[0] == ("worker", 0)  # rank 0 (the run's records) is worker 0


def test_per_rank_chaos_lists_name_the_workers_not_the_servers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # 3 processes, 1 of them a server: speed factors for 3 ranks are one too many (the workers
    # would refuse them after starting; the launcher says so before any starts)
    code, _, err = vatra_in_process(
        capsys, "train", "examples/digits.toml", "--nproc", "3", "--run-dir", str(tmp_path / "run"),
        "--set", "dist.mode=async", "--set", "chaos.speed_factors=[1,1,3]",
    )  # fmt: skip
    assert code == 2 and "chaos.speed_factors lists 3 entries but the run has 2 ranks" in err


def test_shards_are_equal_runs_of_elements_cutting_a_large_tensor() -> None:
    # an MLP 64-512-512-10: one 512×512 matrix is 87 % of it; whole tensors would give one server that
    numels = [64 * 512, 512, 512 * 512, 512, 512 * 10, 10]
    shards = split_even(numels, 4)
    sizes = [sum(b - a for _, a, b in s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == sum(numels)
    flat = [(i, e) for s in shards for i, a, b in s for e in range(a, b)]
    assert flat == [(i, e) for i, n in enumerate(numels) for e in range(n)]  # every element once, in order
    assert shards[0][-1][0] == 2 and shards[1] == [(2, shards[0][-1][2], shards[0][-1][2] + sizes[1])]
