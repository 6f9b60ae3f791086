"""The private upload path: DP clipping and noise on clients, secure aggregation, accounting on the server.

:class:`PrivateUpload` is an :class:`~vatra.federated._base.UploadHook`. On a client, ``encode``
clips the update (client-level DP) and adds the client's share of the noise (``noise_at =
"clients"``). On the server, ``combine`` runs secure aggregation through the executor's channel
(or sums in the clear), adds server-side noise, adapts the clip norm, steps the accountant and
hands the strategy one result: the mean. In simulation :class:`PrivateExecutor` stands for the
client devices: it keeps each trained update and answers the protocol's stages, so the server
path only ever sees masked words.

What a client reports besides its update is cut to :data:`FIT_METRICS_WHITELIST` (evaluation
replies: :func:`filter_eval_metrics`): no loss, update norm or cluster choice of one client leaves
it. Adaptive clipping's count (Andrew et al. 2021) is one more coordinate of the update vector, so
it is summed, masked and noised with the update, never seen alone. Without secure aggregation the
server refuses an upload no honest client sends (:func:`.bounds.check_private_upload`).
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes, UploadHook
from vatra.federated.privacy.accountant import Accountant
from vatra.federated.privacy.bounds import check_private_upload, next_clip_norm
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

WEIGHT_WORDS = 1  # the weight w ends each masked vector, summed mod 2^32 whatever secure_aggregation.bits is
LINEAR = ("fedavg", "fedprox", "fedadam", "fedyogi")
FIT_METRICS_WHITELIST = ("duration_s", "train_time_s")  # a fit result's metrics under privacy
EVAL_METRICS_WHITELIST = ("accuracy", "num_examples")  # an evaluation reply's metrics under privacy


def filter_eval_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The part of a client's evaluation reply that may leave it when privacy is on."""
    return {k: metrics[k] for k in EVAL_METRICS_WHITELIST if k in metrics}


def _secure_rng() -> np.random.Generator:
    """Noise must not be reproducible from the run's seed: seed from the OS entropy pool."""
    return np.random.default_rng(int.from_bytes(os.urandom(16), "little"))


class PrivateUpload(UploadHook):
    name = "private"

    def __init__(self, cfg: Config, run_dir: RunDir | None = None, *, device: bool = False) -> None:
        self.cfg = cfg
        self.device = device  # a deployed client: keeps its update and answers the protocol itself
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
        if fc.strategy == "clustered":
            raise ConfigError(
                "federated.strategy = 'clustered' needs each client's cluster choice and loss, which "
                "secure aggregation and privacy keep on the client; use one of " + ", ".join(LINEAR)
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
        # adaptive clipping: the update vector carries one more coordinate, the unclipped bit
        self.count_coords = int(self.dp.mode == "client" and self.dp.adaptive_clip)
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
        res.metrics = {k: res.metrics[k] for k in FIT_METRICS_WHITELIST if k in res.metrics}
        return self._keep_on_device(res) if self.sa.enabled and self.device else res

    def _clip_and_noise(self, res: FitRes, ins: FitIns) -> FitRes:
        """Clip Δ to L2 norm C; with adaptive clipping append the bit [‖Δ‖ ≤ C]; add this client's
        noise share (``noise_at = "clients"``): m shares of variance σ²/m sum to σ² over the round."""
        clip = float(ins.config.get("dp_clip_norm", self.dp.clip_norm))
        delta = res.update.astype(np.float64)
        norm = float(np.linalg.norm(delta))
        update = delta * min(1.0, clip / max(norm, 1e-12))
        if self.count_coords:
            update = np.append(update, float(norm <= clip))  # (d + 1,)
        if self.dp.noise_at == "clients":
            m = math.sqrt(int(ins.config.get("dp_clients", 1)))
            rng = _secure_rng()
            d = delta.size
            update[:d] += rng.normal(0.0, self.noise_std(clip) / m, d)
            update[d:] += rng.normal(0.0, self.count_std() / m, self.count_coords)
        res.update = update.astype(np.float32)
        return res

    def encode_eval(self, res: EvalRes) -> EvalRes:
        res.metrics = filter_eval_metrics(res.metrics)
        return res

    def _keep_on_device(self, res: FitRes) -> FitRes:
        """Deployed client with secure aggregation: the update stays here; the upload says 'trained'.

        One protocol endpoint for the client's whole life: it trains each round once, rounds only
        going up, and masks each update in one protocol run of its round (:class:`ClientParty`):
        a server that ran two sums over the same update with other survivors could subtract them."""
        if self.party is None:
            self.party = ClientParty(res.client_id, self.sa, wide=WEIGHT_WORDS)
        self.party.trained(res.round, partial(self.input_words, res))  # SecAggError for an old round
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

    def check_result(self, res: FitRes) -> str | None:
        """Client-level DP in the clear: the update within the clip norm it was sent and the count
        a bit, each widened by the noise the client adds itself (under secure aggregation the
        server sees placeholders; the masked sum is not checkable per client)."""
        if self.dp.mode != "client" or self.sa.enabled:
            return None
        m = math.sqrt(max(self.channel.selected if self.channel is not None else 1, 1))
        own = self.dp.noise_at == "clients"
        noise = self.noise_std(self.clip_norm) / m if own else 0.0
        count = self.count_std() / m if own else 0.0
        return check_private_upload(res.update, self.count_coords, self.clip_norm, noise, count)

    def noise_std(self, clip: float) -> float:
        """Std of the noise on the sum; with adaptive clipping part of z pays for the noisy count."""
        z = self.dp.noise_multiplier
        if self.dp.adaptive_clip and z > 0:
            sigma_b = (self.cfg.federated.clients_per_round or self.cfg.federated.clients) / 20
            z = (z**-2 - (2 * sigma_b) ** -2) ** -0.5  # Andrew et al. (2021), Thm 1
        return z * clip

    def count_std(self) -> float:
        """Std of the noise on the round's clip count: σ_b = m/20 (Andrew et al.'s choice)."""
        if not self.count_coords or self.dp.noise_multiplier <= 0:
            return 0.0
        return (self.cfg.federated.clients_per_round or self.cfg.federated.clients) / 20

    @property
    def count_clip(self) -> float:
        """Fixed-point range of the count coordinate in the masked sum: the bit plus ≥ 10σ of noise."""
        return 1.0 + 10.0 * self.count_std()

    def client_plugins(self, model: Any) -> list[Any]:
        if self.dp.mode != "sample":
            return []
        from vatra.federated.privacy.dpsgd import DPSGD

        plugin = DPSGD(model, self.dp.clip_norm, self.dp.noise_multiplier, self._gsm.get(id(model)))
        self._gsm[id(model)] = plugin.gsm
        return [plugin]

    def input_words(self, res: FitRes, clients: int) -> np.ndarray:
        """A client's masked-sum input: [q(w·Δ/unit) …, q(count), w] as words mod 2^bits."""
        weighted = self.dp.mode != "client"
        w = min(res.num_samples, self.sa.max_weight) if weighted else 1
        unit = self.sa.max_weight if weighted else 1
        d = res.update.size - self.count_coords
        body = Quantizer(self.sa.bits, self.sa.clip, clients).encode(res.update[:d] * (w / unit))
        count = Quantizer(self.sa.bits, self.count_clip, clients).encode(res.update[d:])
        return np.concatenate([body, count, np.array([w], dtype=np.uint32)])

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
        # clients given a noise share: those sent the task, not only those that answered
        selected = self.channel.selected if self.channel is not None else len(results)
        if self.sa.enabled:
            assert self.channel is not None, "secure aggregation needs PrivateUpload.wrap(executor)"
            dim = self.channel.expected + 1  # the update (with its count coordinate), its weight
            seed = self.cfg.run.seed * 100_003 + rnd
            server = SecAggServer(rnd, self.sa, cids, dim, seed=seed, wide=WEIGHT_WORDS)
            try:
                words = secure_sum(server, self.channel)
            except RoundAborted as err:
                self.facts = {"secagg_aborted": True, "secagg_threshold": server.t, "secagg_dropouts": None}
                self._log("secagg_aborted", round=rnd, reason=str(err), survivors=server.survivors)
                if server.rejected:
                    self._log("secagg_rejected", round=rnd, clients=server.rejected)
                return []
            n1 = len(server.keys)
            unit = self.sa.max_weight if self.dp.mode != "client" else 1
            d = self.channel.expected - self.count_coords
            total = Quantizer(self.sa.bits, self.sa.clip, n1).decode_sum(words[:d]) * unit
            count = Quantizer(self.sa.bits, self.count_clip, n1).decode_sum(words[d:-1])
            weight = float(words[-1])
            survivors = server.survivors["summed"]
            self.facts = {
                "secagg_threshold": server.t,
                "secagg_survivors": survivors,
                "secagg_dropouts": len(cids) - survivors,
                "secagg_aborted": False,
            }
            if rejected := {**self.channel.link.rejected, **server.rejected}:
                self._log("secagg_rejected", round=rnd, clients=rejected)
            if weight > unit * survivors or (self.dp.mode == "client" and weight != survivors):
                # an honest client's weight is at most max_weight (1 under client-level DP); the sum
                # hides who sent more, so the round's result is refused, not one client's
                self.facts["secagg_aborted"] = True
                why = f"summed weight {weight:.0f} of {survivors} clients, each at most {unit}"
                self._log("secagg_weight_refused", round=rnd, reason=why)
                return []
        else:
            summed = np.sum([r.update.astype(np.float64) for r in results], axis=0)
            d = summed.size - self.count_coords
            total, count = summed[:d], summed[d:]
            weight, survivors = float(len(results)), len(results)
        if self.dp.mode == "client":
            total = self._privatize(total, max(selected, survivors), survivors, float(count.sum()))
        return [FitRes(-1, rnd, max(1, round(weight)), (total / max(weight, 1.0)).astype(np.float32), {})]

    def _privatize(self, total: np.ndarray, selected: int, survivors: int, count: float) -> np.ndarray:
        """Noise (server side), one accountant step and the clip norm's update, from the sums only."""
        z = self.dp.noise_multiplier
        if self.dp.noise_at == "server" and z > 0:
            rng = _secure_rng()
            total = total + rng.normal(0.0, self.noise_std(self.clip_norm), total.shape)
            count += rng.normal(0.0, self.count_std()) if self.count_coords else 0.0
            z_eff = z
        else:  # each survivor added 1/selected of the variance (of the update and of the count)
            z_eff = z * math.sqrt(survivors / selected)
        self.accountant.step(z_eff, self.sample_rate)
        self.facts.update(
            dp_noise_multiplier=z_eff, dp_sample_rate=self.sample_rate, dp_clip_norm=self.clip_norm
        )
        if self.count_coords:  # geometric step towards the clip_quantile of the update norms
            share = count / max(survivors, 1)
            self.clip_norm = next_clip_norm(
                self.clip_norm, share, self.dp.clip_lr, self.dp.clip_quantile, self.dp.clip_norm
            )
            self.facts["dp_next_clip_norm"] = self.clip_norm
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

    def state(self) -> dict[str, Any]:
        """JSON-able: the accountants' histories and the current clip norm (the server checkpoints it)."""
        return {
            "clip_norm": self.clip_norm,
            "accountant": self.accountant.history(),
            "per_client": {str(c): a.history() for c, a in sorted(self.per_client.items())},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` saved: ε goes on counting from where the checkpoint left it."""
        try:
            self.clip_norm = float(state["clip_norm"])
            if not 0 < self.clip_norm < math.inf:
                raise ValueError(f"clip_norm {self.clip_norm} is not a positive finite number")
            self.accountant = Accountant(self.dp.delta, state["accountant"])
            self.per_client = {int(c): Accountant(self.dp.delta, h) for c, h in state["per_client"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise VatraError(f"the checkpoint's privacy state is malformed ({err!r})") from None

    def resume(self, rows: list[dict[str, Any]]) -> None:
        """Fallback for a checkpoint without the hook's state: client-level ε and clip norm from the
        metrics rows (sample-level per-client accountants cannot be rebuilt from them)."""
        for row in sorted(rows, key=lambda r: r["round"]):
            if "dp_noise_multiplier" in row:
                self.accountant.step(row["dp_noise_multiplier"], row["dp_sample_rate"])
                self.clip_norm = row.get(
                    "dp_next_clip_norm", row["dp_clip_norm"]
                )  # older rows: one step behind

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
        self.selected = 0
        self.updates: dict[int, FitRes] = {}
        self.link: CountingChannel
        if hasattr(inner, "stage_tasks"):  # the gRPC hub: clients answer over the network
            self.link = HubChannel(inner)
        else:  # simulation: this object plays the devices
            self.link = LocalParties(hook.sa, self._words, wide=WEIGHT_WORDS)
        if (drop := hook.cfg.chaos.drop_clients_at) is not None:
            self.link.chaos = (drop.round, drop.stage, drop.count)  # the highest ids drop

    def available(self) -> list[int]:
        return self.inner.available()

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        for i in ins.values():
            i.config.update(self.hook.client_config(len(ins)))
        self.selected = len(ins)
        self.expected = expected + self.hook.count_coords  # uploads carry the clip count too
        results, failures, down, up = self.inner.fit(rnd, ins, self.expected)
        if not self.hook.sa.enabled or not isinstance(self.link, LocalParties):
            return results, failures, down, up
        self.updates = {r.client_id: r for r in results}
        self.link.trained(rnd, list(self.updates))  # each simulated device masks its update in round rnd only
        meta = [
            FitRes(r.client_id, r.round, r.num_samples, np.zeros(0, np.float32), r.metrics) for r in results
        ]
        return meta, failures, down, sum(len(encode_res(m)) for m in meta)

    def _words(self, cid: int, clients: int) -> np.ndarray:
        """What simulated device ``cid`` masks: its update (:meth:`PrivateUpload.input_words`)."""
        return self.hook.input_words(self.updates[cid], clients)

    def exchange(self, stage: str, rnd: int, requests: dict[int, Any]) -> dict[int, Any]:
        return self.link.exchange(stage, rnd, requests)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[Any], list[Failure]]:
        return self.inner.evaluate(rnd, ins)

    @property
    def declared(self) -> dict[int, int] | None:
        """The training rows each deployed client declared at join (None in simulation)."""
        return getattr(self.inner, "declared", None)

    def close(self) -> None:
        self.inner.close()


def build_private_hook(
    cfg: Config, run_dir: RunDir | None = None, *, device: bool = False
) -> PrivateUpload | None:
    """The private upload path when secure aggregation or DP is on; None otherwise."""
    if cfg.federated.secure_aggregation.enabled or cfg.federated.privacy.mode != "none":
        return PrivateUpload(cfg, run_dir, device=device)
    return None
