"""The meta-step in the engine: a plugin whose micro-steps strategy turns one optimizer step of the
:class:`~vatra.engine.Trainer` into one meta-step over a batch of episodes.

The trainer's loop, optimizer (the outer one), LR schedule, checkpoints, monitoring and launcher are
those of ``vatra train``; only the gradients differ. Meta-step ``s`` uses episodes
``s·T … s·T + T − 1`` of the meta-training split (``T = meta.tasks_per_step``); rank ``r`` of ``W``
computes episodes ``t ≡ r (mod W)``, the per-task meta-gradients are all-gathered and summed in
episode order on every rank, so a step on ``W`` ranks adds exactly the terms one process adds, in
the same order (see tests/test_meta_dist.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from vatra.config import Config
from vatra.engine import Plugin
from vatra.engine.steps import StepWork
from vatra.errors import ConfigError
from vatra.meta.adapt import INIT_FILE, save_init
from vatra.meta.algorithms import InnerLoop, TaskLoss, evaluate_tasks, task_batch
from vatra.meta.tasks import ClassTasks, ColumnTasks, Episode, TaskSampler, UserTasks, rows_of
from vatra.registry import import_object
from vatra.rundir import RunDir

if TYPE_CHECKING:
    from vatra.engine.trainer import Trainer


def head_names(model: nn.Module, prefix: str) -> tuple[str, ...]:
    """ANIL's head: the parameters under ``prefix``, or (``auto``) those of the last module that
    holds parameters of its own."""
    names = [n for n, _ in model.named_parameters()]
    if prefix == "auto":
        owners = [m for m, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False))]
        prefix = owners[-1]
    chosen = tuple(n for n in names if n == prefix or n.startswith(prefix + "."))
    if not chosen:
        raise ConfigError(
            f"meta.head = {prefix!r} names no parameter of the model; parameters: {', '.join(names[:6])}"
        )
    return chosen


def build_sampler(cfg: Config, trainer: Trainer) -> TaskSampler:
    """The run's episodes: from the training and validation rows pooled (the splits are by class or
    by task, not by row), or from the user's sampler."""
    meta = cfg.meta
    if meta.tasks == "sampler":
        return UserTasks(import_object(meta.sampler, "meta.sampler"), cfg.run.seed)
    parts = [d for d in (trainer.train_data, trainer.val_data) if d is not None]
    rows = [rows_of(d) for d in parts]
    x = torch.cat([r[0] for r in rows])
    y = np.concatenate([r[1] for r in rows])
    common = {"shots": meta.shots, "queries": meta.queries, "seed": cfg.run.seed}
    if meta.tasks == "classes":
        return ClassTasks(x, y, ways=meta.ways, val=meta.val_classes, test=meta.test_classes, **common)
    columns = [getattr(d, "columns", {}).get(meta.task_column) for d in parts]
    if any(c is None for c in columns):
        raise ConfigError(
            f"meta.task_column = {meta.task_column!r}: needs a table data source (data.name = 'table') with "
            "that column"
        )
    groups = np.concatenate([np.asarray(c) for c in columns])
    classes = int(y.max()) + 1
    return ColumnTasks(x, y, groups, classes=classes, val=meta.val_tasks, test=meta.test_tasks, **common)


class MetaLearner(Plugin):
    """Meta-learning as a plugin: offers :class:`MetaSteps`, evaluates adapted episodes (meta-val
    every ``train.eval_every`` steps as ``val_loss``/``val_accuracy``, meta-test at the end as
    ``test_loss``/``test_accuracy``), and with Meta-SGD keeps and checkpoints the inner LRs."""

    def __init__(self, cfg: Config, run_dir: RunDir | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.lrs: dict[str, torch.Tensor] = {}
        self.lr_optimizer: torch.optim.Optimizer | None = None
        self.vmapped = False
        self.comm_bytes = 0  # summed over the run, as comm's plugin does for vatra train

    @staticmethod
    def wanted(cfg: Config) -> bool:
        return cfg.meta.enabled

    def micro_steps(self, trainer: Trainer) -> MetaSteps:
        meta = self.cfg.meta
        if trainer.trainable is not trainer.model:
            raise ConfigError(
                "meta: the loss has parameters of its own (multitask); meta-learning needs a plain loss"
            )
        meta.check_world(trainer.dist.world_size)
        self.sampler = build_sampler(self.cfg, trainer)
        trainer.val_data = None  # the engine's evaluation of rows does not apply: episodes are evaluated here
        # classification: the model's first `ways` outputs are an episode's classes; else outputs as they are
        classify = trainer.task == "classification"
        ways = 0 if not classify else (trainer.spec.num_classes if meta.tasks == "column" else meta.ways)
        model = trainer.model
        adapted = (
            head_names(model, meta.head)
            if meta.algorithm == "anil"
            else tuple(n for n, _ in model.named_parameters())
        )
        self.loop = InnerLoop(meta.algorithm, meta.inner_steps, adapted, ways)
        self.task_loss = TaskLoss(model, trainer.loss, ways)
        device = trainer.dist.device
        self.lrs = {
            n: torch.tensor(meta.inner_lr, device=device, requires_grad=meta.learn_inner_lr) for n in adapted
        }
        if meta.learn_inner_lr:
            self.lr_optimizer = torch.optim.Adam(list(self.lrs.values()), lr=self.cfg.optim.lr)
            trainer.state.rank_states["meta"] = self  # the inner LRs and their optimizer, in checkpoints
        if ways:
            self._check_outputs(trainer, ways)
        return MetaSteps(self)

    def _check_outputs(self, trainer: Trainer, ways: int) -> None:
        sx = self.sampler.episode(self.sampler.splits()[0], 0)[0].to(trainer.dist.device)  # a support set
        model = trainer.model
        was_training = model.training
        model.eval()  # no running statistics touched by this look
        with torch.no_grad():
            out = model(sx)
        model.train(was_training)
        if out.shape[-1] < ways:
            raise ConfigError(
                f"meta: the model has {out.shape[-1]} outputs but episodes have {ways} classes; give "
                f"the model at least {ways} outputs (the first {ways} are the episode's classes)"
            )

    def episodes(self, trainer: Trainer, split: str, indices: range) -> list[Episode]:
        """This rank's share of ``indices`` (every ``world``-th, from its rank), on its device."""
        d = trainer.dist
        device = d.device
        mine = indices[d.rank :: d.world_size]
        return [tuple(t.to(device) for t in self.sampler.episode(split, i)) for i in mine]  # type: ignore[misc]

    def evaluate(self, trainer: Trainer, split: str) -> dict[str, float]:
        """Mean query loss and accuracy of ``meta.eval_tasks`` episodes of ``split`` after adapting."""
        params = {n: p.detach() for n, p in trainer.model.named_parameters()}
        mine = self.episodes(trainer, split, range(self.cfg.meta.eval_tasks))
        totals = torch.zeros(3, dtype=torch.float64, device=trainer.dist.device)
        if mine:
            loss, acc = evaluate_tasks(self.task_loss, self.loop, params, self.lrs, mine)
            totals += torch.stack(
                [
                    loss.sum().double(),
                    acc.sum().double(),
                    torch.tensor(len(mine), device=totals.device, dtype=torch.float64),
                ]
            )
        trainer.dist.all_reduce_sum(totals)
        n = float(totals[2])
        out = {f"{split}_loss": float(totals[0]) / n}
        if self.loop.ways:
            out[f"{split}_accuracy"] = float(totals[1]) / n
        return out

    def after_backward(self, trainer: Trainer) -> None:
        if self.lr_optimizer is not None and not trainer.state.skip_update:
            self.lr_optimizer.step()
            with torch.no_grad():
                for a in self.lrs.values():
                    a.clamp_(min=0.0)  # an inner LR below zero would climb the support loss

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        metrics.update(trainer.state.extras.get("meta", {}))
        self.comm_bytes += int(metrics.get("comm_bytes", 0))
        # the step's samples_per_s counts train.batch_size per rank, as in vatra train; this counts episodes
        metrics["tasks_per_s"] = self.cfg.meta.tasks_per_step / metrics["step_time_s"]
        every = self.cfg.train.eval_every
        if every and trainer.state.step % every == 0 and "val" in self.sampler.splits():
            metrics.update(self.evaluate(trainer, "val"))

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for split in ("val", "test"):
            if split in self.sampler.splits():
                summary.update(self.evaluate(trainer, split))
        meta = self.cfg.meta
        summary["comm_bytes"] = self.comm_bytes
        summary["meta"] = {
            "algorithm": meta.algorithm,
            "ways": self.loop.ways,
            "shots": meta.shots,
            "inner_steps": meta.inner_steps,
            "vmap": self.vmapped,
            "inner_lr": {n: float(a.detach()) for n, a in self.lrs.items()}
            if meta.learn_inner_lr
            else meta.inner_lr,
        }
        if self.run_dir is not None and trainer.dist.is_main:  # what 'vatra meta adapt' starts from
            save_init(self.run_dir.path / INIT_FILE, trainer.model, self.loop, self.lrs, trainer.spec)

    # Meta-SGD's per-rank state (identical on every rank: the LR gradients are gathered like the rest)
    def state_dict(self) -> dict[str, dict[str, Any]]:
        assert self.lr_optimizer is not None
        opt = self.lr_optimizer.state_dict()
        flat: dict[str, Any] = {f"{i}.{k}": v for i, st in opt["state"].items() for k, v in st.items()}
        flat["param_groups"] = opt["param_groups"]
        return {"lrs": {n: a.detach().clone() for n, a in self.lrs.items()}, "optimizer": flat}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        assert self.lr_optimizer is not None
        with torch.no_grad():
            for n, a in self.lrs.items():
                a.copy_(state["lrs"][n])
        flat = dict(state["optimizer"])
        groups = flat.pop("param_groups")
        per: dict[int, dict[str, Any]] = {}
        for key, value in flat.items():
            index, _, name = key.partition(".")
            per.setdefault(int(index), {})[name] = value
        self.lr_optimizer.load_state_dict({"state": per, "param_groups": groups})


class MetaSteps:
    """One meta-step as the trainer's micro-steps: this rank's episodes' meta-gradients, gathered
    from every rank in episode order and averaged into the parameters' ``.grad`` (no DDP: the
    gather is the synchronisation)."""

    def __init__(self, learner: MetaLearner) -> None:
        self.learner = learner

    def forward_module(self, trainer: Trainer) -> nn.Module:
        return trainer.model

    def run(self, trainer: Trainer, accum: int) -> StepWork:
        learner, cfg = self.learner, self.learner.cfg.meta
        t0 = time.perf_counter()
        trainer.optimizer.zero_grad(set_to_none=True)
        total = cfg.tasks_per_step
        first = trainer.state.step * total
        mine = learner.episodes(trainer, "train", range(first, first + total))
        t1 = time.perf_counter()
        # detached: torch.func takes the gradients; autograd need not record the meta-step itself
        params = {n: p.detach() for n, p in trainer.model.named_parameters()}
        lrs = {n: a.detach() for n, a in learner.lrs.items()}
        batch, learner.vmapped = task_batch(
            learner.task_loss, learner.loop, params, lrs, mine, vectorise=cfg.vmap
        )
        # (T_r, P) per rank → (T, P) in episode order on every rank
        learned = list(learner.lrs) if learner.lr_optimizer is not None else []  # Meta-SGD's LRs
        local = torch.cat(
            [batch.grads[n].reshape(len(mine), -1) for n in params]
            + [batch.lr_grads[n].reshape(len(mine), -1) for n in learned]
            + [batch.loss.reshape(-1, 1), batch.accuracy.reshape(-1, 1)],
            dim=1,
        )
        world = trainer.dist.world_size
        every = gather_in_order(local, world, trainer.dist.distributed)
        sent = local.numel() * local.element_size() * (world - 1) if trainer.dist.distributed else 0
        mean = every.sum(0) / total
        offset = 0
        for p in trainer.model.parameters():
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        for n in learned:
            learner.lrs[n].grad = mean[offset : offset + 1].view_as(learner.lrs[n]).clone()
            offset += 1
        loss, acc = mean[offset], mean[offset + 1]
        # comm_bytes: what this rank sent for the gather (its rows to each other rank), as the comm
        # plugin reports a DDP step's
        extras = {"meta_query_loss": float(loss), "comm_bytes": sent}
        if learner.loop.ways:
            extras["meta_query_accuracy"] = float(acc)
        trainer.state.extras["meta"] = extras
        return StepWork(loss.detach() * accum, t1 - t0, time.perf_counter() - t1)


def gather_in_order(local: torch.Tensor, world: int, distributed: bool) -> torch.Tensor:
    """Rank r's rows are episodes r, r + W, r + 2W, …; all-gathered and interleaved back into
    episode order: ``(T_r, P)`` on each rank → ``(T, P)``. Every rank holds the same count (the
    config asks ``tasks_per_step`` to be a multiple of the world size)."""
    if not distributed:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(parts, local.contiguous())
    return torch.stack(parts, dim=1).reshape(-1, local.shape[1])  # (T_r, W, P) → (T, P)
