"""A parameter server's shard as a transport-free state machine: flat fp32 parameters, their
optimizer, the version counter, and the staleness rule that scales or refuses a gradient."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from vatra.config import AsyncConfig, OptimConfig
from vatra.engine.optim import build_optimizer


def staleness_scale(rule: str, staleness: int, alpha: float) -> float:
    """The factor on a gradient's learning rate for staleness τ: 1, 1/(1+τ), or e^(−ατ)."""
    if rule == "inverse":
        return 1.0 / (1.0 + staleness)
    if rule == "exp":
        return math.exp(-alpha * staleness)
    return 1.0


@dataclass
class Reply:
    accepted: bool  # the gradient was applied (False: refused as too stale, or a pull)
    staleness: int
    version: int
    params: torch.Tensor  # the shard after the update (a copy)


class ShardServer:
    """One server's shard: flat fp32 parameters, their optimizer, the version counter and counts.

    Thread-safe: one thread per worker calls :meth:`push` as its gradients arrive.
    """

    def __init__(self, numel: int, optim: OptimConfig, cfg: AsyncConfig) -> None:
        self.cfg = cfg
        self.param = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)
        self.optimizer = build_optimizer([self.param], optim)
        self.version = 0
        self.initialized = False
        self.lock = threading.Condition()
        self.histogram: Counter[int] = Counter()  # staleness of applied gradients
        self.refused = 0
        self.waiting = 0  # pushes that arrived and wait for the lock: the queue depth
        self.busy_s = 0.0  # time spent applying updates

    def init(self, values: torch.Tensor) -> None:
        """The shard's starting values (worker 0's parameters); ignored once the shard has them."""
        with self.lock:
            if not self.initialized:
                self.param.data.copy_(values)
                self.initialized = True
                self.lock.notify_all()

    def wait_initialized(self, timeout: float) -> None:
        with self.lock:
            if not self.lock.wait_for(lambda: self.initialized, timeout):
                raise TimeoutError(f"the shard got no starting values from worker 0 in {timeout:.0f} s")

    def push(self, grad: torch.Tensor, seen: int, lr: float) -> Reply:
        """Apply ``grad`` (computed on version ``seen``) at the staleness-scaled ``lr``, or refuse it."""
        self.waiting += 1
        with self.lock:
            self.waiting -= 1
            t0 = time.perf_counter()
            tau = self.version - seen
            limit = self.cfg.max_staleness
            if tau < 0 or (limit and tau > limit):
                self.refused += 1
                return Reply(False, tau, self.version, self.param.detach().clone())
            for group in self.optimizer.param_groups:
                group["lr"] = lr * staleness_scale(self.cfg.staleness, tau, self.cfg.staleness_alpha)
            self.param.grad = grad.to(torch.float32)
            self.optimizer.step()
            self.param.grad = None
            self.version += 1
            self.histogram[tau] += 1
            self.busy_s += time.perf_counter() - t0
            return Reply(True, tau, self.version, self.param.detach().clone())

    def pull(self) -> Reply:
        with self.lock:
            return Reply(False, 0, self.version, self.param.detach().clone())

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "param": self.param.detach().clone(),
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "histogram": dict(self.histogram),
                "refused": self.refused,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.param.data.copy_(state["param"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
            self.histogram = Counter({int(k): int(v) for k, v in state["histogram"].items()})
            self.refused = int(state["refused"])
            self.initialized = True
            self.lock.notify_all()
