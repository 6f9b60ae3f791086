"""Client-side training: the engine's ``Trainer`` on the client's own shard, one round at a time."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vatra.config import Config
from vatra.data import ShardSampler
from vatra.engine import Plugin, Trainer, seed_everything
from vatra.federated._base import FitIns, FitRes, UploadHook
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import Federation
from vatra.federated.evaluate import class_scores
from vatra.federated.params import ParamLayout
from vatra.losses import CrossEntropy
from vatra.models import build_model

if TYPE_CHECKING:
    from torch import nn

PROBE_SAMPLES = 256  # local samples scored before and after training (fixed per client)


class ProximalTerm(Plugin):
    """FedProx: adds μ(w − w_anchor) to every gradient after backward.

    That is exactly the gradient of μ/2·‖w − w_anchor‖² added to the loss, without a second
    training loop. It lands after gradient clipping (``after_backward`` runs after the clip), so
    with ``train.clip_grad_norm`` set the clip sees the data gradient only.
    """

    def __init__(self, mu: float, anchor: list[torch.Tensor]) -> None:
        self.mu = mu
        self.anchor = anchor

    def after_backward(self, trainer: Trainer) -> None:
        with torch.no_grad():
            for p, a in zip(trainer.model.parameters(), self.anchor, strict=True):
                if p.grad is not None:
                    p.grad.add_(p.detach() - a, alpha=self.mu)


def client_seed(seed: int, rnd: int, client: int) -> int:
    """Seed of a client's sampler and dropout in one round: reproducible, distinct per (round, client)."""
    return int(np.random.default_rng([seed, rnd, client]).integers(2**62))


def client_speeds(seed: int, clients: int, sigma: float) -> np.ndarray:
    """Slowness factor per client (median 1): log-normal, so a few devices are much slower."""
    return np.random.default_rng([seed, 2]).lognormal(0.0, sigma, clients)


_INIT_LOCK = threading.Lock()  # seeding is process-global: threads (tests) must not interleave


def initial_weights(cfg: Config, fed: Federation) -> tuple[nn.Module, ParamLayout, np.ndarray]:
    """The model every process builds from the config seed, its layout and its flat weights."""
    with _INIT_LOCK:
        seed_everything(cfg.run.seed)
        model = build_model(cfg.model, fed.spec)
    layout = ParamLayout.of(model)
    return model, layout, layout.flatten(model)


class LocalClient:
    """Trains whichever client a ``FitIns`` names, on that client's shard; reusable across clients.

    ``personal`` holds per-client head vectors (personalized strategy); a simulation worker
    passes them in and out, a deployed client keeps its own.
    """

    def __init__(self, cfg: Config, fed: Federation, hook: UploadHook | None = None) -> None:
        self.cfg = cfg
        self.fed = fed
        self.loss = CrossEntropy()
        self.model, self.layout, self.init = initial_weights(cfg, fed)
        self.hook = hook or build_upload_hook(cfg, self.layout)
        self.speeds = client_speeds(cfg.run.seed, fed.num_clients, cfg.federated.speed_sigma)

    @torch.no_grad()
    def _probe_loss(self, cid: int, vec: np.ndarray) -> float:
        idx = self.fed.shards[cid][:PROBE_SAMPLES]
        x, y = self.fed.train_for(cid).get_batch(idx)
        self.layout.load(self.model, vec)
        self.model.eval()
        loss = float(self.loss(self.model(x), y))
        self.model.train()
        return loss

    def _local_accuracy(self, cid: int, vec: np.ndarray) -> float:
        shift = self.fed.shifts[cid]
        val = self.fed.val_for_shift(shift)
        assert val.y is not None
        acc, _ = class_scores(self.model, self.layout, vec, val.x, val.y, self.fed.spec.num_classes)
        self.model.train()
        return float(self.fed.label_hist[cid] @ acc)

    def fit(self, ins: FitIns, personal: np.ndarray | None = None) -> tuple[FitRes, np.ndarray | None]:
        """Train one round; returns the (hook-encoded) result and the client's new personal head."""
        cid, conf = ins.client_id, ins.config
        steps, mu = int(conf["local_steps"]), float(conf.get("mu", 0.0))
        head = self.layout.head_size(int(conf.get("personal_layers", 0)))
        if head:
            own = personal if personal is not None else self.init[-head:]
            candidates = [np.concatenate([m, own]) for m in ins.models]
        else:
            candidates = list(ins.models)
        losses = [self._probe_loss(cid, vec) for vec in candidates]
        chosen = int(np.argmin(losses))  # IFCA: the cluster model that fits this client best
        start = candidates[chosen]

        self.layout.load(self.model, start)
        seed = client_seed(self.cfg.run.seed, ins.round, cid)
        seed_everything(seed)
        local_cfg = self.cfg.model_copy(update={"train": self.cfg.train.model_copy(update={"steps": steps})})
        plugins: list[Plugin] = []
        if mu > 0:
            plugins.append(ProximalTerm(mu, [p.detach().clone() for p in self.model.parameters()]))
        plugins.extend(self.hook.client_plugins(self.model))
        sampler = ShardSampler(self.fed.shards[cid], self.cfg.train.batch_size, seed=seed)
        trainer = Trainer(
            local_cfg,
            self.model,
            self.fed.train_for(cid),
            None,
            self.fed.spec,
            sampler,
            loss=self.loss,
            plugins=plugins,
        )
        t0 = time.perf_counter()
        train_losses = [trainer.train_step()["loss"] for _ in range(steps)]
        train_time = time.perf_counter() - t0

        trained = self.layout.flatten(self.model)
        loss_after = self._probe_loss(cid, trained)
        modelled = steps * self.cfg.federated.step_time_s * float(self.speeds[cid])
        metrics: dict[str, Any] = {
            "loss_before": losses[chosen],
            "loss_after": loss_after,
            "train_loss": float(np.mean(train_losses)),
            "train_time_s": train_time,
            "duration_s": modelled if self.cfg.federated.step_time_s > 0 else train_time,
            "model": chosen,
            "local_accuracy": self._local_accuracy(cid, trained),
        }
        body = slice(0, self.layout.size - head)
        update = (trained[body].astype(np.float64) - start[body]).astype(np.float32)
        res = FitRes(cid, ins.round, len(self.fed.shards[cid]), update, metrics)
        return self.hook.encode(res, ins), (trained[-head:].copy() if head else None)
