"""Resume on another world size: the sampler's hand-over of the interrupted epoch (4 → 3, 2, 5 ranks,
twice in a row, ranks an epoch apart), and 4 → 3 ranks end to end on gloo (DCP reshards the model
and optimizer; no sample of the interrupted epoch is lost or repeated)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests._dist import spawn
from tests.conftest import small_config
from torch.utils.data import Dataset, IterableDataset

from vatra.comm.plugin import CommPlugin
from vatra.config import Config
from vatra.data import ShardSampler, partition
from vatra.engine import DistContext, Plugin, Trainer
from vatra.errors import ConfigError
from vatra.monitor.narrate import describe
from vatra.resilience import LATEST, CheckpointPlugin, open_store
from vatra.rundir import RunDir, read_jsonl

N, BATCH, SEED = 96, 4, 7


# ------------------------------------------------------------- sampler math
def _samplers(n: int, world: int, batch: int) -> list[ShardSampler]:
    """The trainer's samplers: random shards, per-rank seeds."""
    shards = partition(n, None, world, "random", seed=SEED)
    return [ShardSampler(s, batch, seed=SEED * 100_003 + r) for r, s in enumerate(shards)]


def _hand_over(old: list[ShardSampler], world: int, batch: int, n: int) -> list[ShardSampler]:
    saved = [(s.state_dict(), s.indices) for s in old]
    new = _samplers(n, world, batch)
    for rank, sampler in enumerate(new):
        sampler.take_over(saved, rank, world)
    return new


def _draw(samplers: list[ShardSampler], steps: int) -> list[list[int]]:
    """What each rank consumes in ``steps`` steps (alternating next_batch and advance, as a loader)."""
    out: list[list[int]] = [[] for _ in samplers]
    for _ in range(steps):
        for r, s in enumerate(samplers):
            twin = s.copy()
            out[r] += twin.next_batch().tolist()
            s.advance()
            assert s.state_dict() == twin.state_dict()
    return out


@pytest.mark.parametrize("new_world", [3, 2, 5])
def test_take_over_serves_the_rest_of_the_epoch_once_then_the_new_sharding(new_world: int) -> None:
    # Prepare: 4 ranks, 4 steps into epoch 0 (16 of 24 samples each)
    old = _samplers(N, 4, BATCH)
    seen = Counter(i for rank in _draw(old, 4) for i in rank)
    # Execute
    new = _hand_over(old, new_world, BATCH, N)
    carry = [len(s.carry) for s in new]
    per = N // new_world if N % new_world == 0 else None
    steps = -(-(max(carry) + (per or N)) // BATCH)
    after = _draw(new, steps)
    # Assert: epoch 0 = what the old ranks consumed + the carries, each sample once
    assert sum(carry) == N - 4 * 16 and max(carry) - min(carry) <= 1
    epoch0 = seen + Counter(i for r, got in enumerate(after) for i in got[: carry[r]])
    assert epoch0 == Counter(range(N))
    # then epoch 1 on the new world size's own shards, each visited whole
    shards = partition(N, None, new_world, "random", seed=SEED)
    for r, got in enumerate(after):
        assert sorted(got[carry[r] : carry[r] + len(shards[r])]) == sorted(shards[r].tolist())
        assert new[r].epoch >= 1


def test_take_over_while_a_carry_is_served_and_with_ranks_an_epoch_apart() -> None:
    # Prepare: 101 samples on 4 ranks (shards of 26, 25, 25, 25): after 16 steps of 8 the ranks
    # of 25 are in epoch 5, the rank of 26 still in epoch 4
    n, batch = 101, 8
    old = _samplers(n, 4, batch)
    consumed = Counter(i for rank in _draw(old, 16) for i in rank)
    assert [s.epoch for s in old] == [4, 5, 5, 5]
    # Execute: 4 → 3, two steps (carries not yet used up), then 3 → 2 and the rest of it
    mid = _hand_over(old, 3, batch, n)
    consumed += Counter(i for rank in _draw(mid, 2) for i in rank)
    assert all(len(s.carry) for s in mid)
    last = _hand_over(mid, 2, batch, n)
    carry = [len(s.carry) for s in last]
    got = _draw(last, -(-max(carry) // batch))
    consumed += Counter(i for r, g in enumerate(got) for i in g[: carry[r]])
    # Assert: every sample exactly once per epoch through epoch 5 (the furthest old rank's)
    assert all(s.epoch == 6 for s in last)
    assert consumed == Counter({i: 6 for i in range(n)})


def test_take_over_state_round_trips_through_a_checkpoint() -> None:
    old = _samplers(N, 4, BATCH)
    _draw(old, 3)
    new = _hand_over(old, 3, BATCH, N)
    _draw(new, 1)
    twin = _samplers(N, 3, BATCH)[1]
    twin.load_state_dict(new[1].state_dict())
    assert _draw([twin], 12) == _draw([new[1]], 12)


# ------------------------------------------------------------- end to end
class _Indexed(Dataset[tuple[torch.Tensor, int]]):
    """Inputs encode the sample id; ``taken`` lists the ids fetched (in process: the ones consumed)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.taken: list[int] = []
        self.num_classes = 3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.taken.append(int(i))
        return self.x[i], int(i) % 3


class _Recorder(Plugin):
    """After the checkpoint plugin: what the resume restored, then the ids each step consumed."""

    def __init__(self, data: _Indexed, out: Path, stop_at: int) -> None:
        self.data, self.out, self.stop_at = data, out, stop_at

    def _write(self, record: dict[str, Any]) -> None:
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_fit_start(self, trainer: Trainer) -> None:
        self.data.taken = []  # the dataset's first item, read to infer its spec, is no training sample
        weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        self._write({"start": trainer.state.step, "lr_epoch": trainer.scheduler.last_epoch,
                     "samples_seen": trainer.state.samples_seen, "weights": weights.tolist()})  # fmt: skip

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self._write({"step": trainer.state.step, "ids": self.data.taken, "lr": metrics["lr"]})
        self.data.taken = []
        if trainer.state.step == self.stop_at:
            trainer.state.should_stop = True  # the run ends here (a final save at this step)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        self._write({"end": trainer.state.step, "weights": weights.tolist()})


def _cfg() -> Config:
    return small_config(
        model={"hidden": [16]},
        train={"steps": 20, "batch_size": BATCH},
        optim={"name": "adamw", "lr": 0.01, "schedule": "cosine", "warmup_steps": 2},
        checkpoint={"every_steps": 0},
        comm={"method": "topk", "ratio": 0.5},
        run={"seed": SEED},
    )


def _worker(rank: int, world: int, rdzv: str, run: str, stop_at: int) -> None:
    torch.set_num_threads(1)
    cfg = _cfg()
    ctx = DistContext.init(cfg.dist, rank=rank, world_size=world, init_method=f"file://{rdzv}")
    try:
        rd = RunDir(Path(run))
        data = _Indexed(N)
        out = Path(run) / f"ids-w{world}-r{rank}.jsonl"
        # top-k with error feedback: per-rank residuals that cannot follow a world-size change
        plugins = [CommPlugin(cfg.comm), CheckpointPlugin(cfg, rd), _Recorder(data, out, stop_at)]
        Trainer.from_config(cfg, train=data, val=None, dist=ctx, plugins=plugins, run_dir=rd).fit()
        torch.distributed.barrier()
    finally:
        ctx.destroy()


def _run(world: int, run: Path, stop_at: int = 0) -> list[list[dict[str, Any]]]:
    rdzv = run.parent / f"rdzv-{run.name}-{world}"
    spawn(_worker, world, (world, str(rdzv), str(run), stop_at))
    return [read_jsonl(run / f"ids-w{world}-r{r}.jsonl") for r in range(world)]


@pytest.mark.slow(17)
def test_resume_from_4_ranks_on_3_and_on_2_sees_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    # Prepare: 4 ranks stop after step 4 (16 of each rank's 24 samples): the final save is at step 4
    run = tmp_path / "run"
    RunDir(run).create()
    before = _run(4, run, stop_at=4)
    consumed = Counter(i for rank in before for line in rank if "ids" in line for i in line["ids"])
    assert sum(consumed.values()) == 64 and max(consumed.values()) == 1
    for world in (3, 2):
        # Execute: a copy of the run goes on with `world` ranks from the 4-rank checkpoint
        copy = tmp_path / f"on{world}"
        shutil.copytree(run, copy)
        after = _run(world, copy)
        _assert_resharded(before, consumed, after, copy, world)


def _assert_resharded(
    before: list[list[dict[str, Any]]],
    consumed: Counter[int],
    after: list[list[dict[str, Any]]],
    run: Path,
    world: int,
) -> None:
    # model, optimizer step, LR schedule and counters carried over; all ranks alike
    for rank in after:
        start = rank[0]
        assert (start["start"], start["lr_epoch"], start["samples_seen"]) == (4, 4, 4 * 4 * BATCH)
        assert start["weights"] == before[0][-1]["weights"]
        assert rank[-1]["end"] == 20
    (event,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resharded"]
    assert (event["from_world_size"], event["to_world_size"], event["dropped"]) == (4, world, ["comm"])
    # the console's line for this resume (rank 0 prints it) names the change of world size
    (resume,) = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "resume"]
    line = f"resumed from checkpoint version {resume['version']} at step 4 (world size 4 → {world})"
    assert describe("resume", resume) == line
    ids = [[i for line in rank if "ids" in line for i in line["ids"]] for rank in after]
    # the interrupted epoch: the 4 ranks' 64 samples + the new ranks' carries = each sample once
    carry = [len(p) for p in np.array_split(np.arange(N - 64), world)]
    epoch0 = consumed + Counter(i for r, got in enumerate(ids) for i in got[: carry[r]])
    assert epoch0 == Counter(range(N))
    # then the new world size's own shards, one whole epoch each
    shards = partition(N, None, world, "random", seed=SEED)
    for r, got in enumerate(ids):
        assert sorted(got[carry[r] : carry[r] + len(shards[r])]) == sorted(shards[r].tolist())
    # the LR schedule continues on its curve: step 5's LR is the cosine's next value after step 4's
    lrs = [line["lr"] for line in after[0] if "lr" in line]
    assert lrs[0] == pytest.approx(before[0][-2]["lr"], rel=0.2) and lrs[0] != before[0][-2]["lr"]
    # the store's newest version is the new world size's, intact
    store = open_store(_cfg().store, run / "checkpoints")
    assert store.manifest(LATEST)["world_size"] == world and store.verify(LATEST) == []


class _Stream(IterableDataset[tuple[torch.Tensor, int]]):
    num_classes = 3

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        g = torch.Generator().manual_seed(0)
        for i in range(64):
            yield torch.randn(6, generator=g), i % 3


def test_an_iterable_dataset_refuses_another_world_size_in_one_line(tmp_path: Path) -> None:
    # Prepare: a one-rank run on an iterable, its newest version relabelled as written by 2 ranks
    cfg = _cfg()
    cfg.train.steps = 3
    rd = RunDir(tmp_path / "run").create()
    Trainer.from_config(cfg, train=_Stream(), val=None, plugins=[CheckpointPlugin(cfg, rd)], run_dir=rd).fit()
    store = open_store(cfg.store, rd.checkpoints)
    manifest = store.manifest(LATEST)
    files = {**manifest["files"], "rank00001.pt": manifest["files"]["rank00000.pt"]}
    store.write_version({}, stored=files, step=3, parent=None, world_size=2, version="s0000003-two")
    # Execute / Assert
    trainer = Trainer.from_config(
        cfg, train=_Stream(), val=None, plugins=[CheckpointPlugin(cfg, rd)], run_dir=rd
    )
    with pytest.raises(ConfigError, match=r"written by 2 rank\(s\) but this run has 1: a 'iterable' dataset"):
        trainer.fit()
