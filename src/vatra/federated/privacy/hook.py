"""The private upload path: DP clipping and noise on clients, secure aggregation, accounting on the server.

:class:`PrivateUpload` is an :class:`~vatra.federated._base.UploadHook`. On a client, ``encode``
clips the update (client-level DP) and adds the client's share of the noise (``noise_at =
"clients"``). On the server, ``combine`` runs secure aggregation through the executor's channel
(or sums in the clear), adds server-side noise, adapts the clip norm, steps the accountant and
hands the strategy one result: the mean. In simulation :class:`PrivateExecutor` stands for the
client devices: it keeps each trained update and answers the protocol's stages, so the server
path only ever sees masked words.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.errors import ConfigError
from vatra.federated._base import Failure, FitIns, FitRes, UploadHook
from vatra.federated.privacy.accountant import Accountant
from vatra.federated.secagg import (
    ClientParty,
    LocalParties,
    Quantizer,
    RoundAborted,
    SecAggServer,
    secure_sum,
)
from vatra.federated.secagg.channel import CountingChannel
from vatra.federated.secagg.deploy import HubChannel
from vatra.federated.wire import encode_res
from vatra.rundir import RunDir

LINEAR = ("fedavg", "fedprox", "fedadam", "fedyogi")


def _secure_rng() -> np.random.Generator:
    """Noise must not be reproducible from the run's seed: seed from the OS entropy pool."""
    return np.random.default_rng(int.from_bytes(os.urandom(16), "little"))


class PrivateUpload(UploadHook):
    name = "private"

    def __init__(self, cfg: Config, run_dir: RunDir | None = None, *, device: bool = False) -> None:
        self.cfg = cfg
        self.device = device  # a deployed client: keeps its update and answers the protocol itself
        self.pending: FitRes | None = None
        self.party: ClientParty | None = None
        self.sa = cfg.federated.secure_aggregation
        self.dp = cfg.federated.privacy
        self.run_dir = run_dir
        fc = cfg.federated
        if (self.sa.enabled or self.dp.mode == "client") and fc.strategy not in LINEAR:
            raise ConfigError(
                f"federated.strategy = {fc.strategy!r} needs every update; secure aggregation and "
                f"client-level DP give the mean only — use one of {', '.join(LINEAR)}"
            )
        if fc.compression != "none":
            raise ConfigError(
                f"federated.compression = {fc.compression!r} cannot be combined with secure aggregation or "
                "privacy (masked words and clipped, noised updates are not compressed); set it to 'none'"
            )
        if self.dp.mode == "sample" and cfg.train.grad_accum != 1:
            raise ConfigError("privacy.mode = 'sample' needs train.grad_accum = 1 (per-sample gradients)")
        m = fc.clients_per_round or fc.clients
        if self.dp.adaptive_clip and self.dp.noise_multiplier > 0 and self.dp.noise_multiplier >= m / 10:
            raise ConfigError(
                f"privacy.adaptive_clip: the noisy clip count (std m/20 = {m / 20:g}) would use the whole "
                f"noise_multiplier {self.dp.noise_multiplier:g}; needs noise_multiplier < m/10 = {m / 10:g}"
            )
        self.clip_norm = self.dp.clip_norm
        self.accountant = Accountant(self.dp.delta)
        self.per_client: dict[int, Accountant] = {}  # sample-level DP: one accountant per client
        self.channel: PrivateExecutor | None = None
        self.facts: dict[str, Any] = {}
        self.samples: dict[int, int] = {}
        self._gsm: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:  # sent to client processes: the config only
        return {"cfg": self.cfg, "device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"], device=state["device"])  # type: ignore[misc]

    # ------------------------------------------------------------ client side
    @property
    def sample_rate(self) -> float:
        fc = self.cfg.federated
        return (fc.clients_per_round or fc.clients) / fc.clients

    def encode(self, res: FitRes, ins: FitIns) -> FitRes:
        res = self._clip_and_noise(res, ins) if self.dp.mode == "client" else res
        return self._keep_on_device(res) if self.sa.enabled and self.device else res

    def _clip_and_noise(self, res: FitRes, ins: FitIns) -> FitRes:
        clip = float(ins.config.get("dp_clip_norm", self.dp.clip_norm))
        norm = float(np.linalg.norm(res.update.astype(np.float64)))
        update = res.update.astype(np.float64) * min(1.0, clip / max(norm, 1e-12))
        if self.dp.noise_at == "clients":  # m shares of variance (zC)²/m: the sum carries (zC)²
            m = int(ins.config.get("dp_clients", 1))
            update += _secure_rng().normal(0.0, self.noise_std(clip) / math.sqrt(m), update.shape)
        res.update = update.astype(np.float32)
        res.metrics.update(update_norm=norm, dp_unclipped=int(norm <= clip))
        return res

    def _keep_on_device(self, res: FitRes) -> FitRes:
        """Deployed client with secure aggregation: the update stays here; the upload says 'trained'."""
        self.pending = res
        self.party = ClientParty(res.client_id, self.sa, lambda cid, n1: self.input_words(res, n1))
        return FitRes(res.client_id, res.round, res.num_samples, np.zeros(0, np.float32), res.metrics)

    def respond(self, blob: bytes) -> bytes:
        if self.party is None:
            raise ConfigError("secure-aggregation message before any training on this client")
        return self.party.respond_or_refuse(blob)

    def decode(self, res: FitRes) -> FitRes:
        """Server: a deployed client's 'trained' notice gets a zero placeholder (never its update)."""
        if self.sa.enabled and res.update.size == 0 and self.channel is not None:
            res.update = np.zeros(self.channel.expected, np.float32)
        return res

    def noise_std(self, clip: float) -> float:
        """Std of the noise on the sum; with adaptive clipping part of z pays for the noisy count."""
        z = self.dp.noise_multiplier
        if self.dp.adaptive_clip and z > 0:
            sigma_b = (self.cfg.federated.clients_per_round or self.cfg.federated.clients) / 20
            z = (z**-2 - (2 * sigma_b) ** -2) ** -0.5  # Andrew et al. (2021), Thm 1
        return z * clip

    def client_plugins(self, model: Any) -> list[Any]:
        if self.dp.mode != "sample":
            return []
        from vatra.federated.privacy.dpsgd import DPSGD

        plugin = DPSGD(model, self.dp.clip_norm, self.dp.noise_multiplier, self._gsm.get(id(model)))
        self._gsm[id(model)] = plugin.gsm
        return [plugin]

    def input_words(self, res: FitRes, clients: int) -> np.ndarray:
        """A client's masked-sum input: [q(w·Δ/unit) …, w, unclipped] as words mod 2^bits."""
        weighted = self.dp.mode != "client"
        w = min(res.num_samples, self.sa.max_weight) if weighted else 1
        unit = self.sa.max_weight if weighted else 1
        body = Quantizer(self.sa.bits, self.sa.clip, clients).encode(res.update * (w / unit))
        tail = np.array([w, int(res.metrics.get("dp_unclipped", 0))], dtype=np.uint32)
        return np.concatenate([body, tail])

    # ------------------------------------------------------------ server side
    def wrap(self, executor: Any) -> Any:
        self.channel = PrivateExecutor(executor, self)
        return self.channel

    def client_config(self, selected: int) -> dict[str, Any]:
        return {"dp_clip_norm": self.clip_norm, "dp_clients": selected}

    def _log(self, kind: str, **facts: Any) -> None:
        if self.run_dir is not None:
            self.run_dir.log_event(kind, **facts)

    def combine(self, rnd: int, results: list[FitRes]) -> list[FitRes]:
        self.facts = {}
        self.samples = {r.client_id: r.num_samples for r in results}
        if not results or (not self.sa.enabled and self.dp.mode != "client"):
            return results
        cids = sorted(r.client_id for r in results)
        if self.sa.enabled:
            assert self.channel is not None, "secure aggregation needs PrivateUpload.wrap(executor)"
            dim = self.channel.expected + 2  # the update, its weight, the unclipped bit
            server = SecAggServer(rnd, self.sa, cids, dim, seed=self.cfg.run.seed * 100_003 + rnd)
            try:
                words = secure_sum(server, self.channel)
            except RoundAborted as err:
                self.facts = {"secagg_aborted": True, "secagg_threshold": server.t, "secagg_dropouts": None}
                self._log("secagg_aborted", round=rnd, reason=str(err), survivors=server.survivors)
                return []
            n1 = len(server.keys)
            unit = self.sa.max_weight if self.dp.mode != "client" else 1
            total = Quantizer(self.sa.bits, self.sa.clip, n1).decode_sum(words[:-2]) * unit
            weight, unclipped = float(words[-2]), float(words[-1])
            survivors = server.survivors["summed"]
            self.facts = {
                "secagg_threshold": server.t,
                "secagg_survivors": survivors,
                "secagg_dropouts": len(cids) - survivors,
                "secagg_aborted": False,
            }
            if rejected := self.channel.link.rejected:
                self._log("secagg_rejected", round=rnd, clients=rejected)
        else:
            total = np.sum([r.update.astype(np.float64) for r in results], axis=0)
            weight, survivors = float(len(results)), len(results)
            unclipped = float(sum(r.metrics.get("dp_unclipped", 0) for r in results))
        if self.dp.mode == "client":
            total = self._privatize(total, len(cids), survivors, unclipped)
        return [FitRes(-1, rnd, max(1, round(weight)), (total / max(weight, 1.0)).astype(np.float32), {})]

    def _privatize(self, total: np.ndarray, selected: int, survivors: int, unclipped: float) -> np.ndarray:
        z = self.dp.noise_multiplier
        if self.dp.noise_at == "server" and z > 0:
            total = total + _secure_rng().normal(0.0, self.noise_std(self.clip_norm), total.shape)
            z_eff = z
        else:  # each survivor added 1/selected of the variance
            z_eff = z * math.sqrt(survivors / selected)
        self.accountant.step(z_eff, self.sample_rate)
        self.facts.update(
            dp_noise_multiplier=z_eff, dp_sample_rate=self.sample_rate, dp_clip_norm=self.clip_norm
        )
        if self.dp.adaptive_clip:
            noisy = unclipped + (_secure_rng().normal(0.0, selected / 20) if z > 0 else 0.0)
            self.clip_norm *= math.exp(-self.dp.clip_lr * (noisy / selected - self.dp.clip_quantile))
        return total

    def round_metrics(self, rnd: int, metrics: dict[str, Any]) -> None:
        metrics.update(self.facts)
        if self.channel is not None and self.sa.enabled:
            metrics["bytes_up"] += self.channel.link.bytes_up
            metrics["bytes_down"] += self.channel.link.bytes_down
            self.channel.link.bytes_up = self.channel.link.bytes_down = 0
        if self.dp.mode == "client":
            metrics.update(epsilon=self.accountant.epsilon(), delta=self.dp.delta)
        elif self.dp.mode == "sample":
            batch, steps = self.cfg.train.batch_size, self.cfg.federated.local_steps
            for cid, n in self.samples.items():
                acc = self.per_client.setdefault(int(cid), Accountant(self.dp.delta))
                acc.step(self.dp.noise_multiplier, min(1.0, batch / n), steps)
            eps = max((a.epsilon() for a in self.per_client.values()), default=0.0)
            metrics.update(epsilon=eps, delta=self.dp.delta)

    def allow_round(self, rnd: int) -> bool:
        if self.dp.mode != "client" or not self.dp.target_epsilon:
            return True
        nxt = self.accountant.epsilon_after(self.dp.noise_multiplier, self.sample_rate)
        if nxt <= self.dp.target_epsilon:
            return True
        if rnd == 1:
            raise ConfigError(
                f"privacy.target_epsilon = {self.dp.target_epsilon:g} is below ε after one round "
                f"({nxt:.3g}); raise it or raise privacy.noise_multiplier"
            )
        self._log("privacy_budget_reached", round=rnd, epsilon=self.accountant.epsilon(), next_epsilon=nxt)
        return False

    def resume(self, rows: list[dict[str, Any]]) -> None:
        for row in sorted(rows, key=lambda r: r["round"]):
            if "dp_noise_multiplier" in row:
                self.accountant.step(row["dp_noise_multiplier"], row["dp_sample_rate"])
                self.clip_norm = row["dp_clip_norm"]

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sa.enabled:
            out["secure_aggregation"] = {
                "mode": self.sa.mode,
                "threshold": max((r.get("secagg_threshold") or 0 for r in rows), default=0),
                "dropouts_survived": sum(r.get("secagg_dropouts") or 0 for r in rows),
                "rounds_aborted": sum(bool(r.get("secagg_aborted")) for r in rows),
            }
        if self.dp.mode != "none":
            last = rows[-1] if rows else {}
            out["privacy"] = {
                "mode": self.dp.mode,
                "epsilon": last.get("epsilon", 0.0),
                "delta": self.dp.delta,
            }
        return out


class PrivateExecutor:
    """Wraps a client executor: sends DP settings with each task; with secure aggregation it plays
    the client devices, which keep their updates and answer the protocol through a byte-counting
    channel. Only masked words reach ``PrivateUpload.combine``."""

    def __init__(self, inner: Any, hook: PrivateUpload) -> None:
        self.inner = inner
        self.hook = hook
        self.expected = 0
        self.updates: dict[int, FitRes] = {}
        self.link: CountingChannel
        if hasattr(inner, "stage_tasks"):  # the gRPC hub: clients answer over the network
            self.link = HubChannel(inner)
        else:  # simulation: this object plays the devices
            self.link = LocalParties(hook.sa, lambda cid, n1: hook.input_words(self.updates[cid], n1))
        if (drop := hook.cfg.chaos.drop_clients_at) is not None:
            self.link.chaos = (drop.round, drop.stage, drop.count)  # the highest ids drop

    def available(self) -> list[int]:
        return self.inner.available()

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        for i in ins.values():
            i.config.update(self.hook.client_config(len(ins)))
        self.expected = expected
        results, failures, down, up = self.inner.fit(rnd, ins, expected)
        if not self.hook.sa.enabled or isinstance(self.link, HubChannel):
            return results, failures, down, up
        self.updates = {r.client_id: r for r in results}
        meta = [
            FitRes(r.client_id, r.round, r.num_samples, np.zeros(0, np.float32), r.metrics) for r in results
        ]
        return meta, failures, down, sum(len(encode_res(m)) for m in meta)

    def exchange(self, stage: str, rnd: int, requests: dict[int, Any]) -> dict[int, Any]:
        return self.link.exchange(stage, rnd, requests)

    def close(self) -> None:
        self.inner.close()


def build_private_hook(
    cfg: Config, run_dir: RunDir | None = None, *, device: bool = False
) -> PrivateUpload | None:
    """The private upload path when secure aggregation or DP is on; None otherwise."""
    if cfg.federated.secure_aggregation.enabled or cfg.federated.privacy.mode != "none":
        return PrivateUpload(cfg, run_dir, device=device)
    return None
