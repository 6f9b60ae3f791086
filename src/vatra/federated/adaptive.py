"""Adaptive, Oort-like client selection (Lai et al., OSDI 2021): useful data on fast devices first.

Utility of client i = statistical utility × system factor + staleness bonus:

- statistical utility ``nᵢ · ℓᵢ`` — samples times the loss it reported before its last training
  (clients whose data the model still gets wrong teach it most), normalised to [0, 1];
- system factor ``(T / tᵢ)^2`` when its last round took ``tᵢ > T`` (else 1), where ``T`` is
  ``preferred_time_s`` or, when 0, the 40th percentile of the known durations;
- staleness bonus ``√(0.1 · ln r / last_roundᵢ)`` so clients not picked for long come back;
- each drop-out halves the utility.

A share ε of each round's picks explores clients never tried (ε = ``exploration``·0.98^r, at least
0.05 while unexplored clients remain); the rest is sampled ∝ utility from the top 1.3·k.

A client's loss and duration are its own claims: :meth:`AdaptiveSelector.check_result` refuses a
loss outside [0, float32's largest] and a negative duration (the server drops that client for the
round), so every utility stays finite and non-negative and one client cannot reset the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vatra.config import FederatedConfig
from vatra.federated._base import MAX_REPORTED, Failure, FitRes, Selector, check_range
from vatra.federated.selection import sorted_ids


class AdaptiveSelector(Selector):
    name = "adaptive"

    def __init__(self, cfg: FederatedConfig, seed: int) -> None:
        super().__init__(cfg, seed)
        n = cfg.clients
        self.stat = np.full(n, np.nan)  # nᵢ·ℓᵢ, NaN = never tried
        self.duration = np.full(n, np.nan)
        self.last_round = np.zeros(n, dtype=np.int64)
        self.failures = np.zeros(n, dtype=np.int64)

    def utilities(self, rnd: int, clients: np.ndarray) -> np.ndarray:
        stat = self.stat[clients]
        util = stat / max(float(np.nanmax(self.stat)), 1e-12)
        known = self.duration[~np.isnan(self.duration)]
        pref = self.cfg.preferred_time_s or (float(np.percentile(known, 40)) if len(known) else 0.0)
        t = self.duration[clients]
        slow = (pref > 0) & (t > pref)
        util = np.where(slow, util * (pref / np.where(slow, t, 1.0)) ** 2, util)
        util = util + np.sqrt(0.1 * np.log(max(rnd, 1)) / np.maximum(self.last_round[clients], 1))
        return util * 0.5 ** self.failures[clients]

    def select(self, rnd: int, available: Sequence[int], k: int) -> list[int]:
        pool = sorted_ids(available)  # no Python work per client
        k = min(k, len(pool))
        rng = np.random.default_rng([self.seed, 5, rnd])
        fresh = pool[np.isnan(self.stat[pool])]
        tried = pool[~np.isnan(self.stat[pool])]
        eps = max(self.cfg.exploration * 0.98**rnd, 0.05) if len(fresh) else 0.0
        n_explore = min(len(fresh), max(round(eps * k), k - len(tried)))
        explore = rng.choice(fresh, size=n_explore, replace=False) if n_explore else np.empty(0, np.int64)
        n_exploit = k - n_explore
        exploit = np.empty(0, dtype=np.int64)
        if n_exploit:
            util = self.utilities(rnd, tried)
            order = np.lexsort((tried, -util))  # highest utility first, ties by id
            top = order[: max(n_exploit, int(np.ceil(1.3 * n_exploit)))]
            w = util[top] + 1e-9  # all-zero utilities (only drop-outs left) still sample
            p = w / w.sum()
            exploit = tried[rng.choice(top, size=n_exploit, replace=False, p=p)]
        return sorted(int(c) for c in np.concatenate([explore, exploit]))

    def check_result(self, res: FitRes) -> str | None:
        """``loss_before`` in [0, float32's largest] (a utility is ≥ 0, and n·ℓ stays finite) and a
        non-negative ``duration_s`` (a negative one would move the percentile for everyone)."""
        if not 0 <= res.client_id < len(self.stat):
            return f"client id {res.client_id} is outside [0, {len(self.stat)})"
        return check_range(res.metrics, "loss_before", 0.0, MAX_REPORTED) or check_range(
            res.metrics, "duration_s", 0.0, MAX_REPORTED
        )

    def observe(self, rnd: int, results: Sequence[FitRes], failures: Sequence[Failure]) -> None:
        for r in results:
            if r.client_id < 0:
                continue
            self.stat[r.client_id] = r.num_samples * float(r.metrics.get("loss_before", 1.0))
            self.duration[r.client_id] = float(r.metrics.get("duration_s", 0.0))
            self.last_round[r.client_id] = rnd
        for f in failures:
            self.failures[f.client_id] += 1
            self.last_round[f.client_id] = rnd
            if np.isnan(self.stat[f.client_id]):
                self.stat[f.client_id] = 0.0  # tried: do not explore a dropped client again

    def state(self) -> dict[str, Any]:
        """The per-client arrays themselves (the server checkpoints arrays as tensors: no per-client
        Python work at a million clients)."""
        return {"stat": self.stat, "duration": self.duration, "last_round": self.last_round} | {
            "failures": self.failures
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """From :meth:`state`, or from an older checkpoint's JSON lists (None for NaN)."""
        self.stat = _floats(state["stat"])
        self.duration = _floats(state["duration"])
        self.last_round = np.array(state["last_round"], dtype=np.int64)
        self.failures = np.array(state["failures"], dtype=np.int64)


def _floats(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(np.float64)
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
