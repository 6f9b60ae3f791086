"""Client-side training and evaluation on the client's own rows, one round at a time.

A :class:`LocalClient` trains and scores whichever client a task names, on the rows
``data_of(client)`` gives: a simulation worker serves every simulated owner from one
:class:`~vatra.federated.data.Federation`; a deployed client serves only itself, from its own data.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vatra.compress import is_prepared, prepare_qat
from vatra.compress.qat4 import is_int4w_prepared, prepare_int4w
from vatra.config import Config
from vatra.data import DatasetSpec, ShardSampler
from vatra.engine import Plugin, Trainer, seed_everything
from vatra.engine.optim import build_optimizer, build_scheduler
from vatra.engine.trainer import call_model
from vatra.errors import VatraError
from vatra.federated._base import EvalRes, FitIns, FitRes, UploadHook
from vatra.federated.batched import GroupTrainer, batchable
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import ClientData
from vatra.federated.edgesync import profile_speeds
from vatra.federated.evaluate import Scorer, batch_fetcher
from vatra.federated.params import ParamLayout
from vatra.federated.perfedavg import meta_gradient, personalise
from vatra.losses import build_loss
from vatra.models import build_model

if TYPE_CHECKING:
    from collections.abc import Callable

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


def initial_weights(cfg: Config, spec: DatasetSpec) -> tuple[nn.Module, ParamLayout, np.ndarray]:
    """The model every process builds from the config seed and the data's spec, its layout and weights."""
    with _INIT_LOCK:
        seed_everything(cfg.run.seed)
        model = build_model(cfg.model, spec)
    layout = ParamLayout.of(model)
    return model, layout, layout.flatten(model)


def local_steps(conf: dict[str, Any], rows: int, batch_size: int) -> int:
    """Steps of one round: ``local_epochs`` × ⌈rows / batch⌉ when set (FedAvg's E), else ``local_steps``."""
    epochs = int(conf.get("local_epochs", 0))
    if epochs > 0:
        return epochs * -(-rows // batch_size)
    return int(conf["local_steps"])


class TaskRefused(VatraError):
    """A task the client will not run: an evaluation of a round that is over for it (a server may
    not use a client's held-out rows as an oracle)."""


class LocalClient:
    """Trains and scores whichever client a task names, on that client's rows; reusable across clients.

    ``personal`` holds per-client head vectors (personalized strategy); a simulation worker
    passes them in and out, a deployed client keeps its own. A client evaluates at most once per
    round, and only the round it is in (the newest it was given a task for): asked again for that
    round it repeats its report, asked for an earlier round ``evaluate`` raises :class:`TaskRefused`.
    """

    def __init__(
        self,
        cfg: Config,
        spec: DatasetSpec,
        data_of: Callable[[int], ClientData],
        hook: UploadHook | None = None,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.data_of = data_of
        self.model, self.layout, self.init = initial_weights(cfg, spec)
        self.loss = build_loss(cfg.train, spec)
        self.scorer = Scorer(cfg, self.model, spec, self.loss)
        self.hook = hook or build_upload_hook(cfg, self.layout)
        self.group = GroupTrainer(cfg, self.model, self.loss, self.layout)
        # slowness: log-normal spread, divided by the device profile's speed (federated.edge.profiles)
        spread = client_speeds(cfg.run.seed, cfg.federated.clients, cfg.federated.speed_sigma)
        self.speeds = spread / profile_speeds(cfg)
        if cfg.edge.qat == "int4w":  # edge clients train with the rounding their device will run
            prepare_int4w(self.model)  # torchao's QAT layers, holding the same Parameters
        elif cfg.edge.qat != "none":
            prepare_qat(self.model)
        self.in_round: dict[int, int] = {}  # client → the newest round it was given a task for
        self.reports: dict[int, EvalRes] = {}  # client → its report on the last round it evaluated

    def _candidates(self, ins: FitIns, personal: np.ndarray | None) -> tuple[list[np.ndarray], int]:
        head = self.layout.head_size(int(ins.config.get("personal_layers", 0)))
        if head:
            own = personal if personal is not None else self.init[-head:]
            return [np.concatenate([m, own]) for m in ins.models], head
        return list(ins.models), head

    def _probe(self, data: ClientData, vec: np.ndarray) -> float:
        return self.scorer.loss_of(vec, data.train, data.train_rows[:PROBE_SAMPLES])

    def _choose(self, data: ClientData, candidates: list[np.ndarray]) -> tuple[int, list[float]]:
        """IFCA: the model that fits this client's training rows best (the only one when one is sent)."""
        if len(candidates) == 1:
            return 0, []
        losses = [self._probe(data, vec) for vec in candidates]
        return int(np.argmin(losses)), losses

    def _train(
        self, data: ClientData, sampler: ShardSampler, steps: int, plugins: list[Plugin], alpha: float = 0.0
    ) -> list[float]:
        """``steps`` optimizer steps on the sampler's batches: a fresh optimizer each round (the
        config's, with its schedule over the round's steps), the config's gradient clipping, then
        the plugins' ``after_backward`` (FedProx's proximal term, DP-SGD's per-sample clipping).
        ``alpha`` > 0 (perfedavg): each step's gradient is Per-FedAvg's first-order meta-gradient
        over two batches (:func:`~vatra.federated.perfedavg.meta_gradient`).

        A lean loop rather than the engine's Trainer: a client round is a few milliseconds of
        compute, and building a Trainer per round (loaders, timers, gradient-norm metrics) cost
        more than the training itself.
        """
        params = [*self.model.parameters(), *self.loss.parameters()]
        optimizer = build_optimizer(params, self.cfg.optim)
        scheduler = build_scheduler(optimizer, self.cfg.optim, steps)
        clip = self.cfg.train.clip_grad_norm
        fetch = batch_fetcher(data.train)
        view = SimpleNamespace(model=self.model)  # what the plugins read
        losses = torch.zeros(steps, dtype=torch.float64)
        self.model.train()
        for i in range(steps):
            inputs, target = fetch(sampler.next_batch())
            optimizer.zero_grad(set_to_none=True)
            if alpha > 0:
                then = fetch(sampler.next_batch())
                loss = meta_gradient(self.model, self._loss_on(inputs, target), self._loss_on(*then), alpha)
            else:
                loss = self.loss(call_model(self.model, inputs), target)
                loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            for plugin in plugins:
                plugin.after_backward(view)  # type: ignore[arg-type]
            optimizer.step()
            scheduler.step()
            losses[i] = loss.detach()
        return losses.tolist()

    def fit(self, ins: FitIns, personal: np.ndarray | None = None) -> tuple[FitRes, np.ndarray | None]:
        """Train one round; returns the (hook-encoded) result and the client's new personal head."""
        cid, conf = ins.client_id, ins.config
        self.in_round[cid] = max(self.in_round.get(cid, 0), ins.round)
        data = self.data_of(cid)
        batch = self.cfg.train.batch_size
        steps = local_steps(conf, data.num_train, batch)
        mu = float(conf.get("mu", 0.0))
        candidates, head = self._candidates(ins, personal)
        chosen, probes = self._choose(data, candidates)
        start = candidates[chosen]

        self.layout.load(self.model, start)
        seed = client_seed(self.cfg.run.seed, ins.round, cid)
        seed_everything(seed)
        plugins: list[Plugin] = []
        if mu > 0:
            plugins.append(ProximalTerm(mu, [p.detach().clone() for p in self.model.parameters()]))
        plugins.extend(self.hook.client_plugins(self.model))
        epochs = int(conf.get("local_epochs", 0)) > 0
        sampler = ShardSampler(data.train_rows, batch, seed=seed, epoch_end=epochs)
        t0 = time.perf_counter()
        alpha = float(conf.get("inner_lr", 0.0))
        train_losses = self._train(data, sampler, steps, plugins, alpha)
        train_time = time.perf_counter() - t0

        trained = self.layout.flatten(self.model)
        modelled = steps * self.cfg.federated.step_time_s * float(self.speeds[cid % len(self.speeds)])
        metrics: dict[str, Any] = {
            # the loss before training: the probe that chose the model, else the first step's batch
            "loss_before": probes[chosen] if probes else float(train_losses[0]),
            "train_loss": float(np.mean(train_losses)),
            "steps": steps,
            "train_time_s": train_time,
            "duration_s": modelled if self.cfg.federated.step_time_s > 0 else train_time,
            "model": chosen,
        }
        if probes:  # clustered weighs its clusters by how well their members fit after training
            metrics["loss_after"] = self._probe(data, trained)
        provenance = getattr(data.train, "provenance", None)  # a Delta table: which version it trained on
        if isinstance(provenance, dict):
            metrics["data_version"] = int(provenance["version"])
            if provenance.get("schema_hash"):
                metrics["data_schema"] = str(provenance["schema_hash"])
        body = slice(0, self.layout.size - head)
        update = (trained[body].astype(np.float64) - start[body]).astype(np.float32)
        res = FitRes(cid, ins.round, data.num_train, update, metrics)
        return self.hook.encode(res, ins), (trained[-head:].copy() if head else None)

    def fit_group(self, group: list[FitIns]) -> list[FitRes] | None:
        """Train a round's clients together, vmapped over their stacked weights
        (:mod:`vatra.federated.batched`): the same results as :meth:`fit` one by one, within float
        tolerance. None when the round's config needs the per-client loop."""
        conf = group[0].config
        if is_prepared(self.model) or is_int4w_prepared(self.model):
            return None  # fake-quantized Linear layers (edge.qat) patch forward: the loop trains them
        plugins = len(self.hook.client_plugins(self.model))
        if any(True for _ in self.loss.parameters()) or not all(
            batchable(self.cfg, i.config, self.model, len(i.models), plugins) for i in group
        ):
            return None  # a loss with weights of its own trains beside the model: the loop does that
        batch = self.cfg.train.batch_size
        steps = local_steps(conf, 1, batch)
        datas = [self.data_of(i.client_id) for i in group]
        xs, ys = [], []
        for ins, data in zip(group, datas, strict=True):
            seed = client_seed(self.cfg.run.seed, ins.round, ins.client_id)
            sampler = ShardSampler(data.train_rows, batch, seed=seed)
            fetch = batch_fetcher(data.train)
            batches = [fetch(sampler.next_batch()) for _ in range(steps)]
            if isinstance(getattr(data.train, "provenance", None), dict) or not all(
                isinstance(b[0], torch.Tensor) for b in batches
            ):
                return None  # dict inputs, or a Delta table whose version each result names: the loop
            xs.append(torch.stack([b[0] for b in batches]))  # (steps, B, ...)
            ys.append(torch.stack([b[1] for b in batches]))  # (steps, B)
        starts = np.stack([i.models[0] for i in group])  # (C, P)
        t0 = time.perf_counter()
        trained, losses = self.group.train(starts, torch.stack(xs, dim=1), torch.stack(ys, dim=1))
        train_time = (time.perf_counter() - t0) / len(group)  # each client's share of the batch
        out = []
        for c, (ins, data) in enumerate(zip(group, datas, strict=True)):
            cid = ins.client_id
            self.in_round[cid] = max(self.in_round.get(cid, 0), ins.round)
            modelled = steps * self.cfg.federated.step_time_s * float(self.speeds[cid % len(self.speeds)])
            metrics: dict[str, Any] = {
                "loss_before": float(losses[c, 0]),
                "train_loss": float(np.mean(losses[c])),
                "steps": steps,
                "train_time_s": train_time,
                "duration_s": modelled if self.cfg.federated.step_time_s > 0 else train_time,
                "model": 0,
            }
            update = (trained[c].astype(np.float64) - starts[c]).astype(np.float32)
            out.append(self.hook.encode(FitRes(cid, ins.round, data.num_train, update, metrics), ins))
        return out

    def evaluate(self, ins: FitIns, personal: np.ndarray | None = None) -> EvalRes:
        """Score the model(s) sent on this client's own held-out rows (the hook filters the report),
        once per round and only for the round the client is in: the same round again gets the same
        report (a retry, or other weights sent as a probe: nothing new either way)."""
        cid = ins.client_id
        done = self.reports.get(cid)
        if done is not None and done.round == ins.round:
            return done
        now = self.in_round.get(cid, 0)
        if ins.round < now:
            raise TaskRefused(f"an evaluation of round {ins.round}, but client {cid} is in round {now}")
        self.in_round[cid] = ins.round
        self.reports[cid] = report = self.hook.encode_eval(self._score(ins, personal))
        return report

    def _loss_on(self, inputs: Any, target: Any) -> Callable[[], torch.Tensor]:
        return lambda: self.loss(call_model(self.model, inputs), target)

    def _personalised(self, data: ClientData, vec: np.ndarray, alpha: float) -> np.ndarray:
        """``vec`` after Per-FedAvg's personalisation step: one SGD step of ``alpha`` on the client's
        first ``train.batch_size`` training rows."""
        self.layout.load(self.model, vec)
        inputs, target = batch_fetcher(data.train)(data.train_rows[: self.cfg.train.batch_size])
        personalise(self.model, self._loss_on(inputs, target), alpha)
        return self.layout.flatten(self.model)

    def _score(self, ins: FitIns, personal: np.ndarray | None) -> EvalRes:
        data = self.data_of(ins.client_id)
        if not data.num_val:
            return EvalRes(ins.client_id, ins.round, 0, {})
        candidates, _ = self._candidates(ins, personal)
        chosen, _ = self._choose(data, candidates)
        scored = candidates[chosen]
        alpha = float(ins.config.get("inner_lr", 0.0))
        if alpha > 0 and data.num_train:  # perfedavg: scored as this client would use it, personalised
            scored = self._personalised(data, scored, alpha)
        metrics: dict[str, Any] = dict(self.scorer.score(scored, data.val, data.val_rows))
        if len(candidates) > 1:
            metrics["model"] = chosen
        return EvalRes(ins.client_id, ins.round, data.num_val, metrics)
