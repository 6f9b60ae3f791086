"""The DP upload hook: what leaves a client (a metric whitelist, the clipped and noised update) and the
server's DP state (noise on the sum, the accountant, the adaptive clip norm).

:class:`DPUpload` is an :class:`~vatra.federated._base.UploadHook`. On a client, ``encode`` clips
the update (client-level DP) and adds the client's share of the noise (``noise_at = "clients"``).
On the server, ``combine`` takes the round's sum — from its :class:`~vatra.federated._base.Combiner`
(secure aggregation) when it has one, else in the clear — adds server-side noise, adapts the clip
norm, steps the accountant and hands the strategy one result: the mean. :class:`DPExecutor` sends
each task the round's clip norm and client count (each client's noise share).

What a client reports besides its update is cut to :data:`FIT_METRICS_WHITELIST` (evaluation
replies: :func:`filter_eval_metrics`, which keeps the task's main metric): no loss, update norm or
cluster choice of one client leaves it. Adaptive clipping's count (Andrew et al. 2021) is one more
coordinate of the update vector, so it is summed, masked and noised with the update, never seen alone.
Without secure aggregation the server refuses an upload no honest client sends
(:func:`.bounds.check_private_upload`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import (
    Combiner,
    EvalRes,
    Executor,
    Failure,
    FitIns,
    FitRes,
    RoundSum,
    StageRunner,
    UploadHook,
)
from vatra.federated.privacy.accountant import Accountant
from vatra.federated.privacy.bounds import check_private_upload, next_clip_norm
from vatra.losses import head_main_metrics, main_metric
from vatra.rundir import RunDir

FIT_METRICS_WHITELIST = ("duration_s", "train_time_s")  # a fit result's metrics under privacy
EVAL_METRICS_WHITELIST = ("accuracy", "num_examples")  # an evaluation reply's metrics under privacy


def filter_eval_metrics(
    metrics: dict[str, Any], heads: Iterable[str] = (), target: str | None = None
) -> dict[str, Any]:
    """The part of a client's evaluation reply that may leave it when privacy is on: the whitelist,
    the task's main metric (r2, ndcg@k, ...; each multitask head's) and ``target`` (the run's
    ``federated.target_metric``), but never a loss."""
    main = main_metric(metrics)
    kept = [*EVAL_METRICS_WHITELIST, *([main] if main else []), *head_main_metrics(metrics, heads)]
    kept += [target] if target else []
    return {k: metrics[k] for k in dict.fromkeys(kept) if k in metrics and not k.endswith("loss")}


def _secure_rng() -> np.random.Generator:
    """Noise must not be reproducible from the run's seed: seed from the OS entropy pool."""
    return np.random.default_rng(int.from_bytes(os.urandom(16), "little"))


class DPUpload(UploadHook):
    """Client-level DP (``privacy.mode = "client"``), DP-SGD's accounting (``"sample"``), or none (the
    metric whitelist only, under secure aggregation). ``combiner`` sums the round when set."""

    name = "private"

    def __init__(self, cfg: Config, run_dir: RunDir | None = None) -> None:
        self.cfg = cfg
        self.dp = cfg.federated.privacy
        self.run_dir = run_dir
        self.combiner: Combiner | None = None
        if self.dp.mode == "sample" and cfg.train.grad_accum != 1:
            raise ConfigError("privacy.mode = 'sample' needs train.grad_accum = 1 (per-sample gradients)")
        fc = cfg.federated
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
        self.selected: int | None = None  # clients sent this round's task (each given a noise share)
        self.facts: dict[str, Any] = {}
        self.samples: dict[int, int] = {}
        self._gsm: dict[int, Any] = {}

    # ------------------------------------------------------------ client side
    @property
    def sample_rate(self) -> float:
        fc = self.cfg.federated
        return (fc.clients_per_round or fc.clients) / fc.clients

    def encode(self, res: FitRes, ins: FitIns) -> FitRes:
        res = self._clip_and_noise(res, ins) if self.dp.mode == "client" else res
        res.metrics = {k: res.metrics[k] for k in FIT_METRICS_WHITELIST if k in res.metrics}
        return self.combiner.keep(res) if self.combiner is not None else res

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
        target = self.cfg.federated.target_metric
        heads = self.cfg.train.multitask.heads
        res.metrics = filter_eval_metrics(res.metrics, heads, None if target == "auto" else target)
        return res

    def respond(self, blob: bytes) -> bytes:
        if self.combiner is None:
            return super().respond(blob)
        return self.combiner.respond(blob)

    def decode(self, res: FitRes) -> FitRes:
        return self.combiner.decode(res) if self.combiner is not None else res

    def check_result(self, res: FitRes) -> str | None:
        """Client-level DP in the clear: the update within the clip norm it was sent and the count
        a bit, each widened by the noise the client adds itself (under secure aggregation the
        server sees placeholders; the masked sum is not checkable per client)."""
        if self.dp.mode != "client" or self.combiner is not None:
            return None
        m = math.sqrt(max(self.selected or 1, 1))
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

    # ------------------------------------------------------------ server side
    def wrap(self, executor: Executor) -> Executor:
        """The DP wrapper, inside the combiner's (which reaches deployed clients through ``executor``)."""
        stages = executor if isinstance(executor, StageRunner) else None
        wrapped = DPExecutor(executor, self)
        return wrapped if self.combiner is None else self.combiner.wrap(wrapped, stages)

    def client_config(self, selected: int) -> dict[str, Any]:
        return {"dp_clip_norm": self.clip_norm, "dp_clients": selected}

    def _log(self, kind: str, **facts: Any) -> None:
        if self.run_dir is not None:
            self.run_dir.log_event(kind, **facts)

    def combine(self, rnd: int, results: list[FitRes]) -> list[FitRes]:
        self.facts = {}
        self.samples = {r.client_id: r.num_samples for r in results}
        if not results or (self.combiner is None and self.dp.mode != "client"):
            return results
        # clients given a noise share: those sent the task, not only those that answered
        selected = self.selected or len(results)
        if self.combiner is not None:
            got = self.combiner.sum(rnd, results)
            if got is None:  # the round is refused (logged by the combiner)
                return []
        else:  # client-level DP in the clear: the unweighted sum
            total = np.sum([r.update.astype(np.float64) for r in results], axis=0)
            got = RoundSum(total, float(len(results)), len(results))
        d = got.total.size - self.count_coords
        total, count, weight = got.total[:d], got.total[d:], got.weight
        if self.dp.mode == "client":
            total = self._privatize(total, max(selected, got.survivors), got.survivors, float(count.sum()))
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
        if self.combiner is not None:
            self.combiner.round_metrics(rnd, metrics)
        metrics.update(self.facts)
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
        out = self.combiner.summary(rows) if self.combiner is not None else {}
        if self.dp.mode != "none":
            last = rows[-1] if rows else {}
            out["privacy"] = {
                "mode": self.dp.mode,
                "epsilon": last.get("epsilon", 0.0),
                "delta": self.dp.delta,
            }
        return out


class DPExecutor:
    """Wraps a client executor: each task carries the round's clip norm and client count (each
    client's noise share), and uploads carry the clip count's coordinate."""

    def __init__(self, inner: Executor, hook: DPUpload) -> None:
        self.inner = inner
        self.hook = hook

    def available(self) -> list[int]:
        return self.inner.available()

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        for i in ins.values():
            i.config.update(self.hook.client_config(len(ins)))
        self.hook.selected = len(ins)
        return self.inner.fit(rnd, ins, expected + self.hook.count_coords)

    def evaluate(self, rnd: int, ins: dict[int, FitIns]) -> tuple[list[EvalRes], list[Failure]]:
        return self.inner.evaluate(rnd, ins)

    @property
    def declared(self) -> dict[int, int] | None:
        """The training rows each deployed client declared at join (None in simulation)."""
        return getattr(self.inner, "declared", None)
