"""``comm.overlap``: the hooks' work on a worker thread gives the synchronous hook's results bit for
bit (2 gloo ranks, several DDP buckets), a failing bucket raises in backward instead of hanging, no
thread outlives its run, and stochastic compressors draw per tensor and step, not from the global RNG."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from tests._dist import end_group, spawn
from tests.conftest import small_config
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from vatra.comm import Compressor, Ctx, Payload
from vatra.comm.hooks import HookState
from vatra.comm.plugin import CommPlugin
from vatra.config import CommConfig, Config, load_config
from vatra.engine import DistContext, Plugin, Trainer

WORLD = 2
# every built-in lossy method; topk and onebit on vatra's own topologies too
PLAN = [
    ("fp16", "flat"), ("bf16", "flat"), ("topk", "flat"), ("topk", "ring"), ("randomk", "flat"),
    ("onebit", "flat"), ("onebit", "hierarchical"), ("qsgd", "flat"), ("powersgd", "flat"),
]  # fmt: skip


class Exploding(Compressor):
    """Fails on every compressed tensor: the error must reach the training process."""

    def compress(self, tensor: torch.Tensor) -> tuple[Payload, Ctx]:
        raise ValueError("boom in compress")


class _Probe(Plugin):
    """Records, after each backward, whether a comm worker thread is running."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def after_backward(self, trainer: Trainer) -> None:
        self.seen.append(_comm_threads() > 0)


def _comm_threads() -> int:
    return sum(t.name.startswith("vatra-") for t in threading.enumerate())


class _Blobs(TensorDataset):
    """Random 64-feature inputs of 10 classes: what digits looks like to the MLP, without loading sklearn."""

    num_classes = 10


def _train(cfg: Config, ctx: DistContext, *plugins: Plugin) -> Trainer:
    g = torch.Generator().manual_seed(0)
    train = _Blobs(torch.rand(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g))
    trainer = Trainer.from_config(cfg, train=train, dist=ctx, plugins=list(plugins))
    trainer.fit()
    return trainer


def _params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)  # one intra-op thread: the same kernels, whichever thread runs them
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    results: dict[str, Any] = {}
    try:
        for method, topology in PLAN:
            comm = {"method": method, "topology": topology, "ratio": 0.05, "min_numel": 64}
            # 1 KB buckets: after DDP's first step the 3.5 k-parameter MLP travels in 3 buckets, one
            # per layer; 4 steps, since powersgd compresses from step 3
            cfg = small_config(
                model={"hidden": [32, 32]}, train={"steps": 4}, dist={"bucket_cap_mb": 0.001}, comm=comm
            )
            runs = {}
            for overlap in (False, True):
                probe = _Probe()
                plugin = CommPlugin(cfg.comm.model_copy(update={"overlap": overlap}), hosts=[[0], [1]])
                trainer = _train(cfg, ctx, plugin, probe)
                assert probe.seen == [overlap] * 4, (method, overlap, probe.seen)
                assert _comm_threads() == 0, (method, overlap)  # closed at the end of the run
                runs[overlap] = _params(trainer)
            buckets = trainer.module._get_ddp_logging_data()["rebuilt_bucket_sizes"]
            results[f"{method}/{topology}"] = {
                "equal": torch.equal(runs[False], runs[True]),
                "buckets": buckets,
            }
        # a bucket that fails on the worker fails backward, on every rank, within moments
        comm = {"method": "tests.test_comm_overlap:Exploding", "min_numel": 64, "start_step": 1}
        cfg = small_config(train={"steps": 3}, dist={"bucket_cap_mb": 0.001}, comm=comm)
        t0 = time.perf_counter()
        try:
            _train(cfg, ctx, CommPlugin(cfg.comm))
            results["failure"] = "no error"
        except RuntimeError as err:
            results["failure"] = str(err)
        results["failure_s"] = time.perf_counter() - t0
        for _ in range(100):  # closed without waiting on failure: the thread ends on its own
            if _comm_threads() == 0:
                break
            time.sleep(0.01)
        results["threads_after_failure"] = _comm_threads()
        ok = torch.ones(1)
        dist.all_reduce(ok)  # the group still works: both ranks skipped the same collectives
        results["group_ok"] = float(ok) == WORLD
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        ctx.destroy()


def test_overlapped_hooks_equal_synchronous_ones_bit_for_bit(tmp_path: Path) -> None:
    # Execute
    out = tmp_path / "results.json"
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(out)))
    r = json.loads(out.read_text())
    print(json.dumps(r, indent=1))

    # Assert: identical parameters after 4 steps with every method, with 3 or more buckets
    for method, topology in PLAN:
        case = r[f"{method}/{topology}"]
        assert case["equal"], (method, topology)
        assert len(str(case["buckets"]).split(",")) >= 3, case
    # the compressor's own error, with its type, is what backward raised
    assert "ValueError: boom in compress" in r["failure"], r["failure"]
    assert r["failure_s"] < 30 and r["threads_after_failure"] == 0 and r["group_ok"]


def test_a_stochastic_compressors_draws_follow_the_step_and_the_tensor_only(tmp_path: Path) -> None:
    """randomk and qsgd draw from a generator of their own, seeded per tensor and step: a resumed run
    repeats the step although DDP's first iteration hands the tensors over in another order."""
    # Prepare: one gloo rank, a DDP-wrapped MLP and the trainer attributes the plugin reads
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        x = torch.randn(32, 8)

        def fit_start(method: str) -> tuple[CommPlugin, Any]:
            model = copy.deepcopy(base)  # no optimizer: every copy keeps the same weights
            trainer = SimpleNamespace(
                module=DDP(model, bucket_cap_mb=0.0002),  # 200 B: after the first step, 3 buckets
                model=model,
                trainable=model,
                dist=SimpleNamespace(world_size=1, device=torch.device("cpu")),
                state=SimpleNamespace(rank_states={}, step=0, skip_update=False),
                cfg=load_config(None, ["run.seed=7"]),  # AdamW, no LR warm-up: compressed from step 0
                log_event=lambda *args, **kwargs: None,
            )
            # the gradient path (AdamW would get 1-bit Adam, which needs the trainer's optimizer)
            comm = CommConfig(method=method, ratio=0.25, min_numel=0, topology="flat", adam1bit=False)
            plugin = CommPlugin(comm)
            plugin.on_fit_start(trainer)
            return plugin, trainer

        def step(plugin: CommPlugin, trainer: Any, number: int) -> torch.Tensor:
            trainer.state.step = number
            plugin.on_step_start(trainer)
            trainer.model.zero_grad()
            trainer.module(x).square().sum().backward()
            plugin.on_step_end(trainer, {})
            return torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters()])

        global_rng = torch.get_rng_state()

        # Execute: steps 0-2, with the rank state saved before step 2; then a fresh plugin and DDP
        # wrapper (its first iteration: one bucket, parameter order) load it and take step 2 again
        first, trainer = fit_start("randomk")
        for number in (0, 1):
            step(first, trainer, number)
        saved = first.state_dict()
        third = step(first, trainer, 2)
        first.on_fit_end(trainer, {})
        second, trainer2 = fit_start("randomk")
        second.load_state_dict(saved)
        again = step(second, trainer2, 2)
        second.on_fit_end(trainer2, {})
        qsgd, trainer3 = fit_start("qsgd")
        quantised = [step(qsgd, trainer3, 0) for _ in range(2)]
        qsgd.on_fit_end(trainer3, {})

        # Assert: the global RNG was not drawn from; step 2 repeats exactly after the restore, and
        # qsgd draws alike for the same step
        assert torch.equal(torch.get_rng_state(), global_rng)
        assert isinstance(first.state, HookState) and first.state.draws is not None
        assert first.state.compressor.generator is first.state.draws.generator
        assert torch.equal(third, again)
        assert torch.equal(quantised[0], quantised[1])
        assert "comm" not in trainer3.state.rank_states  # qsgd has no error feedback: no rank state
        assert _comm_threads() == 0
    finally:
        end_group()
