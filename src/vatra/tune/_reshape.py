"""One reshaping of the adaptive sampler's region: reward the last move, pick the next one, apply it.

The input is the stored state of the previous reshaping and the trials the reshaping sees; the output
is the next state (plain JSON) and its event. Everything here is a pure function of those inputs and
the seed, so every worker that computes a version computes the same one; the result is stored anyway
(see :mod:`vatra.tune.adaptive`), so a worker that joins later follows the region without replaying.

Moves, and when each applies:

* ``narrow``: the most important free parameter, if at least as important as an equal share, whose
  top-quantile spread (padded) is at most ``SHRINK`` of its current width; categorical ones drop
  the choices absent from the top quantile.
* ``freeze``: the least important parameter, if its importance is below ``FREEZE_BELOW`` of an equal
  share and it appears in at least twice ``warmup`` trials, pinned at the best trial's value.
* ``widen``: the most recently reshaped parameter doubles its width (or is unfrozen).
* ``keep``: no change.

Two triggers override the bandit, because both are evidence the region excludes the optimum: the best
trial sitting at an inner edge of a narrowed range (that side grows by the range's width), and no
improvement over ``STALL_WINDOWS`` reshapings (the last reshaped parameter returns to its original).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.trial import FrozenTrial

from vatra.tune._region import ParamRegion, describe, from_unit, original_describe, to_unit

MOVES = ("narrow", "freeze", "widen", "keep")
# Pseudo-observations (one each) so a short study starts by narrowing rather than trying every arm
# once: with ~10 reshapings in a 100-trial study, pure UCB1 would spend 4 of them exploring.
PRIOR_MEAN = {"narrow": 0.3, "freeze": 0.2, "widen": 0.1, "keep": 0.1}
UCB_C = 0.2  # exploration weight; rewards lie in [0, 1] and are typically below 0.3
SHRINK = 0.7  # a narrowing must cut the width to at most this fraction, or it is not worth a move
PAD = 0.25  # the top-quantile spread is padded by this fraction of itself on each side ...
MIN_PAD = 0.05  # ... and by at least this fraction of the original width
EDGE = 0.1  # "at the edge": within this fraction of the range's width from an inner bound
FREEZE_BELOW = 0.25  # freeze when importance < this × (1 / number of parameters)
STALL_WINDOWS = 2  # reshapings without improvement before the last reshaping is undone
MIN_TOP_CATEGORICAL = 5  # top-quantile trials needed before choices are dropped


def empty_state() -> dict[str, Any]:
    return {
        "version": 0,
        "region": {},
        "order": [],
        "best": None,
        "improved_version": 0,
        "bandit": {m: [0, 0.0] for m in MOVES},
        "move": None,
    }


def importances(study: optuna.study.Study, top_quantile: float) -> dict[str, float]:
    """PED-ANOVA importances normalised to sum to 1; empty when they cannot be computed yet."""
    evaluator = optuna.importance.PedAnovaImportanceEvaluator(target_quantile=top_quantile)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "too few trials" warnings: the fallback handles it
            raw = evaluator.evaluate(study)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
    total = sum(raw.values())
    if not math.isfinite(total) or total <= 0:
        return {}
    return {k: float(v) / total for k, v in sorted(raw.items())}


class _Param:
    """One parameter's view of the finished trials: only trials that suggested it, with the
    distribution it has in the latest of them (conditional parameters have fewer trials)."""

    def __init__(self, name: str, trials: list[FrozenTrial], sign: float) -> None:
        self.name = name
        self.dist: BaseDistribution = trials[-1].distributions[name]
        own = [t for t in trials if t.distributions.get(name) == self.dist]
        self.ranked = sorted(own, key=lambda t: (sign * float(t.value or 0.0), t.number))
        self.n = len(self.ranked)

    def top(self, quantile: float) -> list[FrozenTrial]:
        return self.ranked[: max(2, math.ceil(quantile * self.n))]

    def bounds(self, pr: ParamRegion | None) -> tuple[float, float]:
        """Current ``[low, high]`` in unit space (log for log parameters)."""
        d = self.dist
        assert isinstance(d, FloatDistribution | IntDistribution)
        if pr is not None and "low" in pr:
            return to_unit(d, pr["low"]), to_unit(d, pr["high"])
        return to_unit(d, d.low), to_unit(d, d.high)


def _numeric_entry(p: _Param, lo: float, hi: float) -> ParamRegion | None:
    """A narrowed entry for unit bounds ``[lo, hi]``, or ``None`` when that is the original range."""
    d = p.dist
    assert isinstance(d, FloatDistribution | IntDistribution)
    low, high = max(d.low, from_unit(d, lo)), min(d.high, from_unit(d, hi))
    if isinstance(d, IntDistribution):
        low, high = max(d.low, math.floor(low)), min(d.high, math.ceil(high))
    if low <= d.low and high >= d.high:
        return None
    return {"dist": distribution_to_json(d), "low": low, "high": high}


def _narrow(p: _Param, pr: ParamRegion | None, q: float) -> tuple[ParamRegion, str] | None:
    top = p.top(q)
    if isinstance(p.dist, CategoricalDistribution):
        if len(top) < MIN_TOP_CATEGORICAL:
            return None
        keep = sorted({p.dist.choices.index(t.params[p.name]) for t in top})
        current = pr["keep"] if pr is not None and "keep" in pr else range(len(p.dist.choices))
        if len(keep) < 2 or len(keep) >= len(current):
            return None
        reason = f"choices {[p.dist.choices[i] for i in keep]} hold the top {len(top)} of {p.n} trials"
        return {"dist": distribution_to_json(p.dist), "keep": keep}, reason
    assert isinstance(p.dist, FloatDistribution | IntDistribution)
    units = [to_unit(p.dist, t.params[p.name]) for t in top]
    a, b = min(units), max(units)
    o_lo, o_hi = p.bounds(None)
    pad = max(PAD * (b - a), MIN_PAD * (o_hi - o_lo))
    lo, hi = max(o_lo, a - pad), min(o_hi, b + pad)
    c_lo, c_hi = p.bounds(pr)
    if hi - lo > SHRINK * (c_hi - c_lo):
        return None
    entry = _numeric_entry(p, lo, hi)
    if entry is None:
        return None
    lo_v, hi_v = from_unit(p.dist, a), from_unit(p.dist, b)
    return entry, f"the top {len(top)} of {p.n} trials have {p.name} in [{lo_v:.4g}, {hi_v:.4g}]"


def _widen(p: _Param, pr: ParamRegion, *, side: str | None) -> ParamRegion | None:
    """Grow a region back toward the original: one side by the range's width (``side``) or both sides
    by half of it; a frozen or categorical parameter returns to its original distribution."""
    if "frozen" in pr or "keep" in pr:
        return None
    lo, hi = p.bounds(pr)
    w = hi - lo
    if side == "upper":
        hi += w
    elif side == "lower":
        lo -= w
    else:
        lo, hi = lo - w / 2, hi + w / 2
    return _numeric_entry(p, lo, hi)


def _edge(p: _Param, pr: ParamRegion, best: FrozenTrial) -> str | None:
    """Which inner bound of a narrowed range the best trial sits at, if any."""
    if "low" not in pr or p.name not in best.params or best.distributions[p.name] != p.dist:
        return None
    lo, hi = p.bounds(pr)
    o_lo, o_hi = p.bounds(None)
    assert isinstance(p.dist, FloatDistribution | IntDistribution)
    u = to_unit(p.dist, best.params[p.name])
    tol = EDGE * (hi - lo)
    if hi < o_hi and u >= hi - tol:
        return "upper"
    if lo > o_lo and u <= lo + tol:
        return "lower"
    return None


def _choose(bandit: dict[str, list[float]], allowed: list[str], rng: np.random.Generator) -> str:
    """UCB1 over the allowed moves, with one pseudo-observation of ``PRIOR_MEAN`` per move."""
    total = sum(bandit[m][0] + 1 for m in MOVES)
    scores = []
    for m in allowed:
        n, s = bandit[m][0] + 1, bandit[m][1] + PRIOR_MEAN[m]
        scores.append(s / n + UCB_C * math.sqrt(math.log(total) / n))
    best = max(scores)
    ties = [m for m, sc in zip(allowed, scores, strict=True) if sc >= best - 1e-12]
    return ties[int(rng.integers(len(ties)))]


def _reward_so_far(bandit: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {m: {"n": int(v[0]), "total": float(v[1])} for m, v in bandit.items()}


def reshape(
    state: dict[str, Any],
    trials: list[FrozenTrial],
    imps: dict[str, float],
    *,
    minimize: bool,
    version: int,
    trial_number: int,
    top_quantile: float,
    warmup: int,
    seed: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state after reshaping ``state`` in light of the COMPLETE ``trials``, and the event.
    ``trial_number`` is the last trial the reshaping saw; ``seed`` breaks the bandit's ties."""
    sign = 1.0 if minimize else -1.0
    if len(trials) < 2:  # every trial so far pruned or failed: nothing to learn from
        event = {"trial": trial_number, "version": version, "move": "keep", "param": None}
        event |= {"old_region": None, "new_region": None, "reason": "fewer than 2 complete trials"}
        event |= {"importances": {}, "reward": None, "best_value": None, "n_trials": len(trials)}
        event["reward_so_far"] = _reward_so_far(state["bandit"])
        return {**state, "version": version, "move": None, "event": event}, event
    region: dict[str, ParamRegion] = {k: dict(v) for k, v in state["region"].items()}
    order: list[str] = list(state["order"])
    bandit = {m: list(v) for m, v in state["bandit"].items()}
    signed = np.array([sign * float(t.value) for t in trials if t.value is not None])
    best_trial = min(trials, key=lambda t: (sign * float(t.value or 0.0), t.number))
    best = float(signed.min())

    reward = None
    if state["move"] is not None and state["best"] is not None:
        prev = float(state["best"])
        gap = float(np.median(signed)) - prev
        gain = prev - best
        reward = float(np.clip(gain / gap, 0.0, 1.0)) if gap > 0 else float(gain > 0)
        bandit[state["move"]][0] += 1
        bandit[state["move"]][1] += reward
    improved = state["best"] is None or best < float(state["best"]) - 1e-12 * abs(best)
    improved_version = version if improved else int(state["improved_version"])

    params = {
        name: _Param(name, [t for t in trials if name in t.params], sign)
        for name in sorted({k for t in trials for k in t.params})
    }
    # A frozen parameter looks important to PED-ANOVA because the sampler itself concentrated it;
    # decisions use the free parameters' importances only.
    free_imps = {n: v for n, v in imps.items() if "frozen" not in region.get(n, {})}
    total = sum(free_imps.values())
    imps = {n: v / total for n, v in free_imps.items()} if total > 0 else {}
    rng = np.random.default_rng([seed, version])
    move, name, new, reason = "keep", None, None, ""

    # Triggers first: evidence that the optimum lies outside the region.
    edges = [(n, s) for n in order if (s := _edge(params[n], region[n], best_trial)) is not None]
    if edges:
        name, side = max(edges, key=lambda e: imps.get(e[0], 0.0))
        move, new = "widen", _widen(params[name], region[name], side=side)
        reason = (
            f"best trial #{best_trial.number} has {name}={best_trial.params[name]:.4g} at the {side} "
            f"edge of the narrowed range; the optimum may lie outside it"
        )
    elif order and version - improved_version >= STALL_WINDOWS:
        name, move, new = order[-1], "widen", None
        reason = f"no improvement of the best value over the last {STALL_WINDOWS} reshapings"
        improved_version = version  # give the wider region a fair window before undoing more
    else:
        free = [n for n in params if "frozen" not in region.get(n, {}) and params[n].n >= warmup]
        by_importance = sorted(free, key=lambda n: (-imps.get(n, 0.0), n)) if imps else free
        share = 1.0 / max(1, len(imps))
        worth = [n for n in by_importance if not imps or imps.get(n, 0.0) >= share]
        narrow = next(
            ((n, r) for n in worth if (r := _narrow(params[n], region.get(n), top_quantile))),
            None,
        )
        # a freeze needs twice the evidence of a narrowing: a frozen value is never sampled again
        cold = [
            n
            for n in reversed(by_importance)
            if imps and imps.get(n, 0.0) < FREEZE_BELOW * share and params[n].n >= 2 * warmup
        ]
        allowed = ["keep"]
        allowed += ["narrow"] if narrow else []
        allowed += ["freeze"] if cold and len(free) > 2 else []
        allowed += ["widen"] if order else []
        move = _choose(bandit, allowed, rng)
        if move == "narrow" and narrow is not None:
            name, (new, why) = narrow[0], narrow[1]
            reason = f"{why}; importance {imps.get(name, float('nan')):.3f}"
        elif move == "freeze":
            name = cold[0]
            value = params[name].ranked[0].params[name]
            new = {"dist": distribution_to_json(params[name].dist)}
            new["frozen"] = params[name].dist.to_internal_repr(value)
            reason = (
                f"importance {imps.get(name, 0.0):.3f} < {FREEZE_BELOW * share:.3f} "
                f"(a quarter of an equal share); frozen at trial "
                f"#{params[name].ranked[0].number}'s value"
            )
        elif move == "widen":
            name = order[-1]
            new = _widen(params[name], region[name], side=None)
            reason = "bandit chose to widen the most recently reshaped parameter"
        else:
            reason = "bandit chose keep" if len(allowed) > 1 else "no move applies"

    old = region.get(name) if name is not None else None
    if name is not None:
        order = [n for n in order if n != name]
        if new is None:
            region.pop(name, None)
        else:
            region[name] = new
            order.append(name)

    def shown(pr: ParamRegion | None) -> dict[str, Any] | None:
        if name is None:
            return None
        return describe(pr) if pr is not None else original_describe(params[name].dist)

    event = {
        "trial": trial_number,
        "version": version,
        "move": move,
        "param": name,
        "old_region": shown(old),
        "new_region": shown(new),
        "reason": reason,
        "importances": imps,
        "reward": reward,
        "reward_so_far": _reward_so_far(bandit),
        "best_value": sign * best,
        "n_trials": len(trials),
    }
    new_state = {
        "version": version,
        "region": region,
        "order": order,
        "best": best,
        "improved_version": improved_version,
        "bandit": bandit,
        "move": move,
        "event": event,
    }
    return new_state, event
