"""The A/B policy on a serving log: the primary metric's sequential test, the guardrails that stop
harm early, and the one decision (promote, roll back, stop for futility, continue) with its
evidence. Every rule is checked after every outcome or request, and the decision is the first rule
that fired, at the moment it fired: a stopping time, which the always-valid test allows."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from vatra.errors import ConfigError
from vatra.serve.ab._records import ABConfig, ABResult, Action, Decision, Evidence, Guardrail
from vatra.serve.ab.logs import ABLog
from vatra.serve.ab.sequential import SequentialStats, sequential_test

SERIES_POINTS = 200  # points of the effect-over-time chart


def _evidence(s: SequentialStats, t: NDArray[np.float64], i: int) -> Evidence:
    return Evidence(
        t=float(t[i]),
        n_champion=int(s.n_a[i]),
        n_challenger=int(s.n_b[i]),
        mean_champion=float(s.mean_a[i]),
        mean_challenger=float(s.mean_b[i]),
        effect=float(s.effect[i]),
        lo=float(s.lo[i]),
        hi=float(s.hi[i]),
        p=float(s.p[i]),
    )


def _first(mask: NDArray[np.bool_]) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _variants(log: ABLog, cfg: ABConfig) -> tuple[str, str]:
    names = sorted(log.versions)
    if cfg.champion not in log.versions:
        raise ConfigError(
            f"no request from the champion variant {cfg.champion!r} in the log (variants: "
            f"{', '.join(names) or 'none'}); pass --champion NAME"
        )
    others = [v for v in names if v != cfg.champion]
    if cfg.challenger is not None:
        if cfg.challenger not in log.versions:
            raise ConfigError(f"no request from the challenger variant {cfg.challenger!r} in the log")
        return cfg.champion, cfg.challenger
    if len(others) != 1:
        raise ConfigError(
            f"the log has {len(others)} variants besides {cfg.champion!r} "
            f"({', '.join(others) or 'none'}); pass --challenger NAME"
        )
    return cfg.champion, others[0]


def _window_start(log: ABLog, champ: str, chall: str) -> float:
    """When the current experiment began: after the last request that either arm served with a
    version other than its latest (an alias moved: a promotion, a rollback, a new challenger).
    Earlier rows belong to another experiment; mixing them in would compare other models."""
    r = log.requests
    start = -math.inf
    for v in (champ, chall):
        old = (r.variant == v) & (r.version != log.latest[v])
        if old.any():
            start = max(start, float(r.t[old].max()))
    return start


def _guardrails(log: ABLog, cfg: ABConfig, champ: str, chall: str, start: float) -> list[Guardrail]:
    """The error-rate and latency guardrails on every request of the two arms: each is a binary
    sequential test of a harm indicator (the request failed; it was slower than the line)."""
    r = log.requests
    keep = ((r.variant == champ) | (r.variant == chall)) & (r.t > start)
    t, is_b, err, lat = r.t[keep], r.variant[keep] == chall, r.error[keep], r.latency_ms[keep]
    out: list[Guardrail] = []
    for name, harm, desc, skip in _harms(cfg, t, is_b, err, lat):
        x, b, tt = harm[skip:].astype(np.float64), is_b[skip:], t[skip:]
        a_rate = float(x[~b].mean()) if (~b).any() else float("nan")
        b_rate = float(x[b].mean()) if b.any() else float("nan")
        if not x.size:
            out.append(Guardrail(name, desc, a_rate, b_rate, None))
            continue
        s = sequential_test(x, b, metric="binary", alpha=cfg.alpha, horizon=cfg.horizon, min_n=cfg.min_n)
        margin = cfg.error_margin if name == "error_rate" else 0.0
        i = _first(s.lo > margin)
        tripped = _evidence(s, tt, i) if i is not None else None
        out.append(Guardrail(name, desc, a_rate, b_rate, _evidence(s, tt, x.size - 1), tripped))
    return out


def _harms(
    cfg: ABConfig,
    t: NDArray[np.float64],
    is_b: NDArray[np.bool_],
    err: NDArray[np.bool_],
    lat: NDArray[np.float64],
) -> list[tuple[str, NDArray[np.bool_], str, int]]:
    """``(name, harm indicator per request, description, requests to skip at the start)``."""
    harms = [("error_rate", err, "share of requests that failed", 0)]
    if cfg.latency_ms is not None:
        harms.append(("latency_p95", lat > cfg.latency_ms, f"share slower than {cfg.latency_ms:.4g} ms", 0))
    else:
        champ_idx = np.flatnonzero(~is_b)
        if champ_idx.size > cfg.latency_burn_in:
            cut = int(champ_idx[cfg.latency_burn_in - 1]) + 1
            line = float(np.percentile(lat[champ_idx[: cfg.latency_burn_in]], 95))
            desc = (
                f"share slower than the champion's p95 over its first {cfg.latency_burn_in} "
                f"requests ({line:.4g} ms)"
            )
            harms.append(("latency_p95", lat > line, desc, cut))
    return harms


def analyse(log: ABLog, cfg: ABConfig) -> ABResult:
    """Run every rule over the log and take the first that fired."""
    champ, chall = _variants(log, cfg)
    start = _window_start(log, champ, chall)
    o = log.outcomes
    current = ((o.variant == champ) & (o.version == log.latest[champ])) | (
        (o.variant == chall) & (o.version == log.latest[chall])
    )
    keep = current & (o.pred_t > start)
    values, is_b, t = o.value[keep], o.variant[keep] == chall, o.t[keep]
    notes: list[str] = []
    if math.isfinite(start):
        left_out = int((log.requests.t <= start).sum())
        notes.append(
            f"an alias moved during the log: only the requests after t={start:.3f} (champion "
            f"{log.latest[champ]}, challenger {log.latest[chall]}) are this experiment; "
            f"{left_out} earlier requests left out"
        )
    if cfg.metric == "binary" and values.size and not np.isin(values, (0.0, 1.0)).all():
        bad = int((~np.isin(values, (0.0, 1.0))).sum())
        raise ConfigError(
            f"{bad} outcome values are not 0 or 1, so the metric is not binary: pass --metric continuous"
        )
    guards = _guardrails(log, cfg, champ, chall, start)
    trips: list[tuple[float, int, Decision]] = []
    events: list[tuple[float, int, Decision]] = []
    for g in guards:
        if g.tripped is not None:
            reason = (
                f"guardrail {g.name}: the challenger's {g.description} is higher "
                f"({g.challenger:.4g} vs {g.champion:.4g})"
            )
            trips.append((g.tripped.t, 0, Decision("rollback", f"guardrail:{g.name}", reason, g.tripped)))
    primary: Evidence | None = None
    series = series_t = None
    if values.size:
        s = sequential_test(
            values, is_b, metric=cfg.metric, alpha=cfg.alpha, horizon=cfg.horizon, min_n=cfg.min_n
        )
        primary = _evidence(s, t, values.size - 1)
        sign = 1.0 if cfg.higher_is_better else -1.0
        lo_better, hi_better = (s.lo, s.hi) if sign > 0 else (-s.hi, -s.lo)
        rules: list[tuple[str, Action, NDArray[np.bool_], str]] = [
            ("win", "promote", lo_better > 0, "the challenger is better: its interval excludes 0"),
            ("lose", "rollback", hi_better < 0, "the challenger is worse: its interval excludes 0"),
        ]
        if cfg.mde is not None:
            why = (
                f"futility: the interval rules out an improvement of {cfg.mde:.4g} "
                "(the minimum effect of interest)"
            )
            rules.append(("futility", "stop", hi_better < cfg.mde, why))
        for order, (rule, action, mask, reason) in enumerate(rules, start=1):
            i = _first(mask)
            if i is not None:
                events.append((float(t[i]), order, Decision(action, rule, reason, _evidence(s, t, i))))
        pts = np.unique(np.linspace(0, values.size - 1, min(SERIES_POINTS, values.size)).astype(np.int64))
        series = SequentialStats(*(np.take(getattr(s, f), pts) for f in SequentialStats.__dataclass_fields__))
        series_t = t[pts]
    else:
        notes.append("no outcome joined to a prediction of these variants yet: only the guardrails ran")
    # A tripped guardrail wins over any primary rule, even one that fired earlier: not promoting
    # never adds a false promotion, and a promotion of a harmful challenger is what guardrails stop.
    if trips:
        decision = min(trips, key=lambda e: e[0])[2]
        if events:
            first = min(events, key=lambda e: (e[0], e[1]))[2].rule
            notes.append(f"the primary rule {first!r} fired too, but a guardrail tripped: rollback")
    elif events:
        decision = min(events, key=lambda e: (e[0], e[1]))[2]
    else:
        decision = Decision("continue", "none", "no rule fired yet: keep collecting outcomes", primary)
    in_window = log.requests.t > start
    traffic = {v: int(((log.requests.variant == v) & in_window).sum()) for v in sorted(log.versions)}
    return ABResult(
        config=cfg,
        champion=champ,
        challenger=chall,
        traffic=traffic,
        versions={k: dict(v) for k, v in log.versions.items()},
        latest=dict(log.latest),
        skipped=dict(log.skipped),
        primary=primary,
        series=series,
        series_t=series_t,
        guardrails=guards,
        decision=decision,
        notes=notes,
    )
