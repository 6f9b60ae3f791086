"""The meta-gradient of one task for MAML, first-order MAML, ANIL and Reptile, on ``torch.func``.

Every algorithm adapts a copy of the parameters θ to a task's support set with ``steps`` gradient
steps, ``φ ← φ − α_l ∇_φ L_support(φ)`` (``α_l``: one inner LR per parameter tensor, learnable with
Meta-SGD), and returns the task's contribution to the outer gradient:

- ``maml``: ``∇_θ L_query(φ(θ))``, differentiating through the inner steps (second order);
- ``fomaml``: ``∇_φ L_query(φ)``, the inner steps treated as constants (first order);
- ``anil``: MAML with only the head (``InnerLoop.adapted``) adapted in the inner loop;
- ``reptile``: ``θ − φ``, with the inner steps taken on support and query together; an outer SGD
  step of LR ε then moves θ towards φ by ε (Nichol et al., 2018).

Parameters travel as ``{name: tensor}`` dicts through :func:`torch.func.functional_call`, so a
batch of tasks of equal shapes is one :func:`torch.func.vmap` call (see :func:`task_batch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.func import functional_call, grad, grad_and_value, vmap

Params = dict[str, torch.Tensor]
Algorithm = Literal["maml", "fomaml", "anil", "reptile"]


@dataclass(frozen=True)
class InnerLoop:
    """How a task adapts: the algorithm, its inner steps and which parameters they change."""

    algorithm: Algorithm
    steps: int
    adapted: tuple[str, ...]  # parameter names the inner loop changes (ANIL: the head's; else all)
    ways: int = 0  # classification episodes: only the first ``ways`` outputs are the task's classes


class TaskLoss:
    """``L(params, x, y)``: the model called functionally on ``params`` (and its buffers), its output
    cut to the episode's ``ways`` classes, through the run's loss; plus the accuracy for classes."""

    def __init__(self, model: nn.Module, loss: Callable[[Any, Any], torch.Tensor], ways: int) -> None:
        self.model = model
        self.loss = loss
        self.ways = ways
        self.buffers = dict(model.named_buffers())

    def output(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        # buffers copied per call: batch norm's in-place running statistics then touch a copy (a
        # transform refuses to mutate a captured tensor), and the meta-step leaves them unchanged
        buffers = {n: b.clone() for n, b in self.buffers.items()}
        out = functional_call(self.model, (params, buffers), (x,))
        return out[..., : self.ways] if self.ways else out

    def __call__(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.output(params, x), y)

    def with_accuracy(
        self, params: Params, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.output(params, x)
        loss = self.loss(out, y)
        if not self.ways:
            return loss, torch.zeros_like(loss)
        return loss, (out.argmax(-1) == y).to(loss.dtype).mean()


def adapt(
    task_loss: TaskLoss, params: Params, lrs: Params, x: torch.Tensor, y: torch.Tensor, loop: InnerLoop
) -> Params:
    """φ after ``loop.steps`` inner steps from ``params`` on ``(x, y)``. Inside an outer ``grad``
    the steps stay differentiable (MAML's second-order term); outside it they are plain SGD."""
    fast = dict(params)
    for _ in range(loop.steps):
        sub = {n: fast[n] for n in loop.adapted}
        g = grad(lambda p: task_loss({**fast, **p}, x, y))(sub)  # noqa: B023 (called at once)
        fast = {**fast, **{n: sub[n] - lrs[n] * g[n] for n in loop.adapted}}
    return fast


def task_meta_grad(
    task_loss: TaskLoss,
    loop: InnerLoop,
    params: Params,
    lrs: Params,
    sx: torch.Tensor,
    sy: torch.Tensor,
    qx: torch.Tensor,
    qy: torch.Tensor,
) -> tuple[Params, Params, torch.Tensor, torch.Tensor]:
    """One task's outer gradient for ``params`` and for the inner LRs ``lrs`` (zeros unless the
    algorithm differentiates through the inner loop), its query loss after adaptation and accuracy."""
    if loop.algorithm in ("maml", "anil"):

        def query_loss(p: Params, a: Params) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            loss, acc = task_loss.with_accuracy(adapt(task_loss, p, a, sx, sy, loop), qx, qy)
            return loss, (loss, acc)

        (g_params, g_lrs), (loss, acc) = grad(query_loss, argnums=(0, 1), has_aux=True)(params, lrs)
        return g_params, g_lrs, loss.detach(), acc.detach()
    detached = {n: p.detach() for n, p in params.items()}
    zeros = {n: torch.zeros_like(a) for n, a in lrs.items()}
    if loop.algorithm == "fomaml":
        fast = {n: p.detach() for n, p in adapt(task_loss, detached, lrs, sx, sy, loop).items()}
        g, (loss, acc) = grad_and_value(lambda p: task_loss.with_accuracy(p, qx, qy), has_aux=True)(fast)
        return g, zeros, loss, acc
    # reptile: the inner steps on every labelled example of the task; the query loss is measured
    # after them (on data they saw: a training figure, as Reptile has no separate query loss)
    x, y = torch.cat([sx, qx]), torch.cat([sy, qy])
    fast = adapt(task_loss, detached, lrs, x, y, loop)
    loss, acc = task_loss.with_accuracy(fast, qx, qy)
    return {n: detached[n] - fast[n].detach() for n in params}, zeros, loss.detach(), acc.detach()


@dataclass
class TaskBatch:
    """Per-task results of a batch of tasks, each tensor with a leading task dimension ``T``."""

    grads: Params  # (T, *param.shape)
    lr_grads: Params  # (T, *lr.shape)
    loss: torch.Tensor  # (T,)
    accuracy: torch.Tensor  # (T,)


def task_batch(
    task_loss: TaskLoss,
    loop: InnerLoop,
    params: Params,
    lrs: Params,
    episodes: Sequence[tuple[torch.Tensor, ...]],
    *,
    vectorise: bool = True,
) -> tuple[TaskBatch, bool]:
    """Every episode's meta-gradient, in episode order; the second value says whether ``vmap`` ran.

    Episodes of equal shapes run as one ``vmap`` call when ``vectorise`` (tasks are independent, so
    the per-task results equal the loop's up to float reassociation inside batched kernels); a model
    ``vmap`` cannot trace (in-place buffer updates such as batch norm's, data-dependent control flow,
    dropout) falls back to a loop over the tasks.
    """
    fn = _bound(task_meta_grad, task_loss, loop)
    shapes = {tuple(t.shape for t in e) for e in episodes}
    if vectorise and len(shapes) == 1:
        stacked = [torch.stack(part) for part in zip(*episodes, strict=True)]  # (T, ...) each
        try:
            g, a, loss, acc = vmap(fn, in_dims=(None, None, 0, 0, 0, 0))(params, lrs, *stacked)
            return TaskBatch(g, a, loss, acc), True
        except (RuntimeError, ValueError):  # vmap cannot trace this model: the loop below
            pass
    per_task = [fn(params, lrs, *e) for e in episodes]
    return (
        TaskBatch(
            grads={n: torch.stack([t[0][n] for t in per_task]) for n in params},
            lr_grads={n: torch.stack([t[1][n] for t in per_task]) for n in lrs},
            loss=torch.stack([t[2] for t in per_task]),
            accuracy=torch.stack([t[3] for t in per_task]),
        ),
        False,
    )


def evaluate_tasks(
    task_loss: TaskLoss,
    loop: InnerLoop,
    params: Params,
    lrs: Params,
    episodes: Sequence[tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query loss and accuracy of each episode after adapting to its support set, shape ``(T,)``
    each (no outer gradient: evaluation of an initialisation, as at meta-test time)."""
    detached = {n: p.detach() for n, p in params.items()}
    lr_values = {n: a.detach() for n, a in lrs.items()}
    losses, accs = [], []
    for sx, sy, qx, qy in episodes:
        fast = adapt(task_loss, detached, lr_values, sx, sy, loop)
        with torch.no_grad():
            loss, acc = task_loss.with_accuracy(fast, qx, qy)
        losses.append(loss)
        accs.append(acc)
    return torch.stack(losses), torch.stack(accs)


def _bound(fn: Callable[..., Any], task_loss: TaskLoss, loop: InnerLoop) -> Callable[..., Any]:
    def call(params: Params, lrs: Params, sx: Any, sy: Any, qx: Any, qy: Any) -> Any:
        return fn(task_loss, loop, params, lrs, sx, sy, qx, qy)

    return call
