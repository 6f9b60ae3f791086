"""The training loop: ``fit()`` → ``train_step()`` → ``forward_backward()``, with plugins around it."""

from __future__ import annotations

import contextlib
import math
import random
import time
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.config import Config
from vatra.data import DatasetSpec, ShardSampler, Split, build_dataset, partition
from vatra.engine._plugin import Plugin, PluginList
from vatra.engine.dist import DistContext
from vatra.engine.optim import build_optimizer, build_scheduler
from vatra.engine.state import TrainState
from vatra.models import build_model, count_correct, loss_fn
from vatra.rundir import RunDir

EVAL_BATCH = 512
# A skipped update (healing) steps the schedule without optimizer.step(): intended, not a mistake.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """Distinct, reproducible per-rank seed (dropout, sampler order)."""
    return seed * 100_003 + rank


class Trainer:
    """Trains one model on this rank's shard; works with or without torch.distributed.

    Federated clients, HPO trials and parameter-server workers build a ``Trainer`` on their own
    data (``world_size == 1``, no process group) and call :meth:`train_step` or :meth:`fit`.
    """

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        train: Split,
        val: Split | None,
        spec: DatasetSpec,
        sampler: ShardSampler,
        *,
        dist: DistContext | None = None,
        plugins: Iterable[Plugin] = (),
        run_dir: RunDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist or DistContext()
        self.spec = spec
        self.train_split = train
        self.val_split = val
        self.sampler = sampler
        self.plugins = PluginList(plugins)
        self.run_dir = run_dir
        self.state = TrainState()
        self.model = model.to(self.dist.device)
        self.module: nn.Module = self.model  # what runs forward: the DDP wrapper when distributed
        if self.dist.distributed:
            ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
            self.module = DDP(self.model, device_ids=ids, bucket_cap_mb=cfg.dist.bucket_cap_mb)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        amp = cfg.train.precision
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=amp == "fp16")

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        dist: DistContext | None = None,
        plugins: Iterable[Plugin] = (),
        run_dir: RunDir | None = None,
    ) -> Trainer:
        """Data, shard, sampler and model as the config says, seeded so runs repeat exactly."""
        ctx = dist or DistContext()
        seed = cfg.run.seed
        train, val, spec = build_dataset(cfg.data, seed)
        shards = partition(
            len(train),
            train.labels,
            ctx.world_size,
            cfg.data.sharding,
            seed=seed,
            alpha=cfg.data.alpha,
            classes_per_shard=cfg.data.classes_per_shard,
        )
        sampler = ShardSampler(shards[ctx.rank], cfg.train.batch_size, seed=rank_seed(seed, ctx.rank))
        seed_everything(seed)  # identical initial weights on every rank
        model = build_model(cfg.model, spec)
        seed_everything(rank_seed(seed, ctx.rank))  # per-rank dropout and anything random after
        return cls(cfg, model, train, val, spec, sampler, dist=ctx, plugins=plugins, run_dir=run_dir)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps``; returns the summary (written by the run-folder plugin)."""
        start = time.perf_counter()
        try:
            self.plugins.on_fit_start(self)
            every = self.cfg.train.eval_every
            while self.state.step < self.cfg.train.steps and not self.state.should_stop:
                metrics = self.train_step()
                if every and self.state.step % every == 0 and self.state.step < self.cfg.train.steps:
                    metrics.update(self.evaluate())
                self.plugins.on_step_end(self, metrics)
                self.state.last_metrics = metrics
            final_eval = self.evaluate() if self.val_split is not None else {}
            summary = self._summary(time.perf_counter() - start, final_eval)
            self.plugins.on_fit_end(self, summary)
            return summary
        except BaseException as exc:
            self.log_event(
                "failure",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=8),
            )
            self.plugins.on_failure(self, exc)
            raise

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``train.grad_accum`` micro-batches; returns the step's metrics."""
        t0 = time.perf_counter()
        state, accum = self.state, self.cfg.train.grad_accum
        state.skip_update = False
        self.plugins.on_step_start(self)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.dist.device)
        data_time = fwd_bwd_time = 0.0
        for micro in range(accum):
            td = time.perf_counter()
            x, y = self.next_batch()
            tf = time.perf_counter()
            data_time += tf - td
            # DDP all-reduces gradients on the last micro-batch only (no_sync before it).
            sync: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if micro < accum - 1 and isinstance(self.module, DDP):
                sync = self.module.no_sync()
            with sync:
                loss_sum += self.forward_backward(x, y, scale=1.0 / accum)
            fwd_bwd_time += time.perf_counter() - tf  # includes DDP's all-reduce, overlapped with backward
        to = time.perf_counter()
        grad_norm = self._unscale_and_clip()
        state.extras["grad_norm"] = grad_norm  # pre-clip and identical on every rank: healing decides on it
        self.plugins.after_backward(self)
        if not state.skip_update:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        state.step += 1
        step_time = time.perf_counter() - t0
        batch = self.cfg.train.batch_size * accum * self.dist.world_size
        state.samples_seen += batch
        state.train_time_s += step_time
        return {
            "step": state.step,
            "loss": loss_sum.item() / accum,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": batch / step_time,
            "step_time_s": step_time,
            "data_time_s": data_time,
            "fwd_bwd_time_s": fwd_bwd_time,
            "optim_time_s": time.perf_counter() - to,
            "skipped": state.skip_update,
        }

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Loss of one micro-batch and its gradient (scaled by ``scale``); returns the detached loss."""
        with torch.autocast(
            self.dist.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            loss = loss_fn(self.module(x), y)
        self.scaler.scale(loss * scale).backward()
        return loss.detach()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.train_split.batch(self.sampler.next_batch())
        return x.to(self.dist.device, non_blocking=True), y.to(self.dist.device, non_blocking=True)

    def _unscale_and_clip(self) -> float:
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.train.clip_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Loss and accuracy on the validation split, each rank a strided share, summed across ranks."""
        if self.val_split is None:
            return {}
        self.module.eval()
        idx = np.arange(self.dist.rank, len(self.val_split), self.dist.world_size)
        totals = torch.zeros(3, dtype=torch.float64, device=self.dist.device)  # loss sum, correct, count
        for start in range(0, len(idx), EVAL_BATCH):
            x, y = self.val_split.batch(idx[start : start + EVAL_BATCH])
            x, y = x.to(self.dist.device), y.to(self.dist.device)
            logits = self.model(x)  # the plain module: evaluation needs no gradient sync
            correct, count = count_correct(logits, y)
            totals += torch.tensor(
                [loss_fn(logits, y).item() * count, correct, count], dtype=torch.float64, device=totals.device
            )
        self.dist.all_reduce_sum(totals)
        self.module.train()
        loss_total, correct_total, n = totals.tolist()
        metrics = {"val_loss": loss_total / max(n, 1), "val_accuracy": correct_total / max(n, 1)}
        self.state.last_eval = metrics
        self.plugins.on_eval_end(self, metrics)
        return metrics

    # --------------------------------------------------------------- helpers
    def log_event(self, kind: str, **fields: Any) -> None:
        """Record an event in events.jsonl (no-op without a run folder)."""
        if self.run_dir is not None:
            self.run_dir.log_event(kind, rank=self.dist.rank, step=self.state.step, **fields)

    def _summary(self, wall_s: float, final_eval: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        return {
            "steps": st.step,
            "final_loss": st.last_metrics.get("loss"),
            "val_loss": final_eval.get("val_loss"),
            "val_accuracy": final_eval.get("val_accuracy"),
            "samples_per_s": st.samples_seen / st.train_time_s if st.train_time_s else 0.0,
            "wall_s": wall_s,
            "world_size": self.dist.world_size,
            "samples_seen": st.samples_seen,
        }
