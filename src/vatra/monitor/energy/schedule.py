"""When to run: the cheapest (or cleanest) window of a price or intensity profile for a run of a given
length, in one piece or in chunks joined by checkpoints, before a deadline.

The profile is piecewise constant (:class:`~vatra.monitor.energy.profile.Profile`); where it has no
slot (a gap, or times past its end) the hour-of-day means stand in, so a historical profile plans the
days to come by its typical day. A run is taken to draw the same power throughout, so its cost is
the integral of the profile over the hours it runs (€ or gCO₂ per unit of energy, times its energy).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise

from vatra.errors import ConfigError
from vatra.monitor.energy.profile import Profile

HOUR = 3600.0


@dataclass(frozen=True)
class Window:
    """``[start, end)`` in unix seconds, with the profile's time-weighted mean over it."""

    start: float
    end: float
    mean: float

    @property
    def hours(self) -> float:
        return (self.end - self.start) / HOUR


class Pieces:
    """The profile cut into constant pieces over ``[earliest, deadline]``: at its slots' edges and
    at every whole UTC hour (where hour-of-day means change), with the running integral at each edge."""

    def __init__(self, profile: Profile, earliest: float, deadline: float) -> None:
        first_hour = math.ceil(earliest / HOUR) * HOUR
        hours = [first_hour + i * HOUR for i in range(int((deadline - first_hour) // HOUR) + 1)]
        inside = [t for t in (*profile.starts, *profile.ends) if earliest < t < deadline]
        self.edges = sorted({earliest, deadline, *inside, *(h for h in hours if h < deadline)})
        self.values = [profile.value_at((a + b) / 2) for a, b in pairwise(self.edges)]
        self.cum = [0.0]
        for (a, b), v in zip(pairwise(self.edges), self.values, strict=True):
            self.cum.append(self.cum[-1] + v * (b - a))

    def integral(self, t: float) -> float:
        """∫ value dt from ``earliest`` to ``t`` (linear inside a piece)."""
        i = min(bisect_right(self.edges, t) - 1, len(self.values) - 1)
        return self.cum[i] + self.values[i] * (t - self.edges[i])

    def window(self, a: float, b: float) -> Window:
        return Window(a, b, (self.integral(b) - self.integral(a)) / (b - a))


def _span(profile: Profile, duration_s: float, earliest: float, deadline: float | None) -> Pieces:
    if duration_s <= 0:
        raise ConfigError(f"the run's duration is {duration_s:g} s; give a positive --duration")
    end = deadline if deadline is not None else max(profile.ends[-1], earliest + 24 * HOUR)
    if end - earliest < duration_s:
        raise ConfigError(
            f"a run of {duration_s / HOUR:.2f} h does not fit between {utc(earliest)} and the deadline "
            f"{utc(end)}; give a later --deadline"
        )
    return Pieces(profile, earliest, end)


def cheapest_window(
    profile: Profile, duration_s: float, earliest: float, deadline: float | None = None
) -> Window:
    """The contiguous window of ``duration_s`` inside ``[earliest, deadline]`` (default: the
    profile's end, at least a day) with the least integral; ties go to the earliest.

    The integral is piecewise linear in the start time, with corners where the start or the end
    crosses an edge: the minimum is at one of those starts, so only they are tried.
    """
    p = _span(profile, duration_s, earliest, deadline)
    latest = p.edges[-1] - duration_s
    starts = {earliest, latest, *(e for e in p.edges if e <= latest), *(e - duration_s for e in p.edges)}
    best = min(
        (s for s in starts if earliest <= s <= latest), key=lambda s: (p.window(s, s + duration_s).mean, s)
    )
    return p.window(best, best + duration_s)


def cheapest_chunks(
    profile: Profile, duration_s: float, earliest: float, deadline: float | None = None
) -> list[Window]:
    """The cheapest pieces that add up to ``duration_s`` before the deadline, in time order, with
    touching pieces merged: the run pauses (a checkpoint) at each chunk's end and resumes at the
    next one's start. Cheapest first, ties to the earliest; the last piece taken is used from its
    start for what is left of the run."""
    p = _span(profile, duration_s, earliest, deadline)
    order = sorted(range(len(p.values)), key=lambda i: (p.values[i], p.edges[i]))
    taken: list[tuple[float, float]] = []
    left = duration_s
    for i in order:
        a, b = p.edges[i], p.edges[i + 1]
        use = min(b - a, left)
        taken.append((a, a + use))
        left -= use
        if left <= 1e-9:
            break
    merged: list[tuple[float, float]] = []
    for a, b in sorted(taken):
        if merged and abs(merged[-1][1] - a) < 1e-6:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return [p.window(a, b) for a, b in merged]


def plan_mean(chunks: list[Window]) -> float:
    """The time-weighted mean of a plan's chunks."""
    total = sum(c.end - c.start for c in chunks)
    return sum(c.mean * (c.end - c.start) for c in chunks) / total


_UNITS = {"d": 86400.0, "h": HOUR, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds from ``90m``, ``2h``, ``1h30m``, ``1d`` or plain seconds (``5400``)."""
    t = text.strip().lower()
    try:
        return float(t)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([dhms])", t)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([dhms])", "", t).strip():
        raise ConfigError(f"duration {text!r}: write it as 90m, 2h, 1h30m, 1d or seconds")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")
