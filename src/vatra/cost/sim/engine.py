"""The discrete-event simulation of one job on a fleet of spot (or on-demand) nodes under a policy.

Events: a price change (cost and hazard change), an interruption (drawn from the world's hazard,
or replayed from observed events), the end of a pause (checkpoint, move, restore), a checkpoint
falling due, a replacement node arriving, an hour boundary (the predictive policy decides), the
job's end. Between two events nothing changes, so cost and progress are integrated exactly.

The job is synchronous data parallel: an interruption of any node loses the work since the last
checkpoint, and the job restores on the nodes left (elastic) while a replacement is requested. A
node that joins, or a change of size, costs a checkpoint and a restore.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vatra.cost.sim.config import SimConfig
from vatra.cost.sim.hazard import HOUR, RECENT_H, HazardModel, World, features, young_daly
from vatra.cost.sim.traces import PriceTrace

POLICIES = ("on-demand", "spot fixed", "spot young-daly", "spot predictive")


@dataclass
class Outcome:
    """One policy's run: what it cost, when it finished, what interruptions took."""

    policy: str
    cost_usd: float = 0.0
    completion_h: float = math.nan
    lost_work_h: float = 0.0  # hours of work on job.nodes nodes redone after interruptions
    restarts: int = 0
    checkpoints: int = 0
    migrations: int = 0
    node_hours: float = 0.0
    finished: bool = False


@dataclass
class _Phase:
    kind: str  # "ckpt", "move" or "restore"
    seconds: float
    on_start: Callable[[], None] | None = None


@dataclass
class Job:
    """One policy's simulated job (construct, then :meth:`run`)."""

    cfg: SimConfig
    policy: str
    trace: PriceTrace
    start: float
    zone: str
    rng: np.random.Generator
    world: World | None = None  # draws interruptions; None with replayed events
    events: dict[str, np.ndarray] | None = None  # zone -> sorted event times (replay)
    model: HazardModel | None = None
    constant_p: float = 0.0  # per node-hour, from the history (Young/Daly's MTBF)
    out: Outcome = field(init=False)

    def __post_init__(self) -> None:
        f = self.cfg.fleet
        self.out = Outcome(self.policy)
        self.spot = self.policy != "on-demand"
        self.t = self.start
        self.progress = self.saved = self.pending_save = self.since_save = 0.0
        self.n = self.target = f.fixed_nodes
        self.phases: deque[_Phase] = deque()
        self.busy_until = math.nan
        self.arrivals: list[float] = []
        self.recent: list[float] = []  # times of this job's interruptions
        self.p_now = self.constant_p
        self.exposure = float(self.rng.exponential())
        self.replayed: dict[str, int] = {}
        self.horizon = self.trace.end if self.spot else math.inf

    # ----------------------------------------------------------------- fleet
    def price(self) -> float:
        return self.trace.price(self.zone, self.t) if self.spot else self.cfg.fleet.on_demand_usd_per_h

    def rate(self) -> float:
        """Steps per second now (nothing while paused)."""
        busy = bool(self.phases) or self.n == 0
        return 0.0 if busy else self.n / self.cfg.job.nodes / self.cfg.step_s

    def interval(self) -> float:
        pol, c = self.cfg.policy, self.cfg.job.checkpoint_s or 0.0
        if self.policy in ("on-demand", "spot fixed"):
            return pol.fixed_interval_s
        p = max(self.constant_p if self.policy == "spot young-daly" else self.p_now, 1e-12)
        mtbf = HOUR / (-math.log1p(-p) * max(self.n, 1))  # the job fails when any of its n nodes does
        return max(young_daly(c, mtbf), self.cfg.step_s)  # at least a step between two saves

    # ----------------------------------------------------------------- events
    def _next_interruption(self) -> float:
        if not self.spot or self.n == 0:
            return math.inf
        if self.events is not None:
            times = self.events.get(self.zone, np.empty(0))
            i = max(bisect.bisect_left(times, self.t), self.replayed.get(self.zone, 0))
            return float(times[i]) if i < len(times) else math.inf
        assert self.world is not None
        lam = self.n * self.world.rate(self.zone, self.t)
        return self.t + self.exposure / lam if lam > 0 else math.inf

    def _candidates(self) -> list[tuple[float, int, str]]:
        """(time, priority, event): ties go to the lower priority number first."""
        c = [(self.horizon, 9, "horizon"), (self._next_interruption(), 0, "interrupt")]
        if self.phases:
            c.append((self.busy_until, 1, "phase_end"))
        elif self.n > 0:
            r = self.rate()
            c.append((self.t + (self.cfg.job.total_steps - self.progress) / r, 2, "done"))
            c.append((self.t + max(self.interval() - self.since_save, 0.0), 3, "checkpoint"))
        if self.arrivals:
            c.append((min(self.arrivals), 4, "arrival"))
        if self.spot:
            c.append((self.trace.next_change(self.zone, self.t), 5, "price"))
        if self.policy == "spot predictive":
            c.append(((math.floor(self.t / HOUR) + 1) * HOUR, 6, "hour"))
        return c

    def _advance(self, t_next: float) -> None:
        dt = t_next - self.t
        self.out.cost_usd += self.n * self.price() * dt / HOUR
        self.out.node_hours += self.n * dt / HOUR
        if self.spot and self.world is not None and self.n > 0:
            self.exposure -= self.n * self.world.rate(self.zone, self.t) * dt
        if not self.phases and self.n > 0:
            self.progress += self.rate() * dt
            self.since_save += dt
        self.t = t_next

    def _start(self, *phases: _Phase) -> None:
        self.phases = deque(phases)
        self._begin_phase()

    def _begin_phase(self) -> None:
        phase = self.phases[0]
        if phase.kind == "ckpt":
            self.pending_save = self.progress
            self.out.checkpoints += 1
        if phase.on_start is not None:
            phase.on_start()
        self.busy_until = self.t + phase.seconds

    def _ckpt(self) -> _Phase:
        return _Phase("ckpt", self.cfg.job.checkpoint_s or 0.0)

    def _restore(self, on_start: Callable[[], None] | None = None) -> _Phase:
        return _Phase("restore", self.cfg.job.restore_s or 0.0, on_start)

    def _resize(self, n: int) -> None:
        def to_n() -> None:
            self.n = n

        self._start(self._ckpt(), self._restore(to_n))

    def run(self) -> Outcome:
        total = self.cfg.job.total_steps
        while True:
            t_next, _, kind = min(self._candidates())
            self._advance(min(t_next, self.horizon))
            if kind == "done" or (self.progress >= total - 1e-9 and not self.phases):
                self.out.finished = True
                self.out.completion_h = (self.t - self.start) / HOUR
                return self.out
            if kind == "horizon":
                return self.out
            getattr(self, f"_on_{kind}")()

    def _on_interrupt(self) -> None:
        if self.events is not None:
            times = self.events[self.zone]
            i = max(bisect.bisect_left(times, self.t), self.replayed.get(self.zone, 0))
            self.replayed[self.zone] = i + 1
        self.exposure = float(self.rng.exponential())
        self.out.lost_work_h += (self.progress - self.saved) * self.cfg.step_s / HOUR
        self.out.restarts += 1
        self.progress = self.saved
        self.since_save = 0.0
        self.recent.append(self.t)
        self.n -= 1
        self.arrivals.append(self.t + self.cfg.fleet.replace_s)
        self.phases.clear()
        if self.n > 0:
            self._start(self._restore())

    def _on_phase_end(self) -> None:
        done = self.phases.popleft()
        if done.kind == "ckpt":
            self.saved = self.pending_save
            self.since_save = 0.0
        if self.phases:
            self._begin_phase()

    def _on_checkpoint(self) -> None:
        self._start(self._ckpt())

    def _on_arrival(self) -> None:
        self.arrivals.remove(min(self.arrivals))
        if self.n >= self.target:
            return  # the fleet shrank meanwhile: the node is not taken
        if self.n == 0:
            self.n = 1
            self._start(self._restore())
        elif self.phases and self.phases[-1].kind == "restore":
            self.n += 1  # joins the restart under way
        else:
            self._resize(self.n + 1)

    def _on_price(self) -> None:
        pass  # cost and hazard are read afresh at every event

    def _on_hour(self) -> None:
        """The predictive policy: predict each zone's risk; move before a predicted interruption;
        checkpoint more often near risk; run max_nodes in cheap hours and min_nodes otherwise."""
        assert self.model is not None
        f, pol = self.cfg.fleet, self.cfg.policy
        since = self.t - RECENT_H * HOUR
        recent = sum(1 for s in self.recent if s >= since) / max(self.n, 1)
        zones = self.trace.zones
        x = np.array([features(self.trace, z, self.t, recent if z == self.zone else 0.0) for z in zones])
        risk = dict(zip(zones, self.model.predict(x), strict=True))
        self.p_now = float(risk[self.zone])
        if self.phases or self.n == 0:
            return
        cheap = self.trace.price(self.zone, self.t) / self.trace.medians[self.zone] <= pol.scale_up_below
        self.target = f.max_nodes if cheap else f.min_nodes
        # Expected cost of a node-hour in each zone: its price plus the work an interruption costs
        # (half an interval redone and a restore, by all n nodes), weighted by the predicted risk.
        lost_h = (self.interval() / 2 + (self.cfg.job.restore_s or 0.0)) / HOUR
        per_h = {z: self.trace.price(z, self.t) * (1 + risk[z] * self.n * lost_h) for z in zones}
        best = min(zones, key=lambda z: per_h[z])
        move_h = ((self.cfg.job.checkpoint_s or 0.0) + pol.migrate_s + (self.cfg.job.restore_s or 0.0)) / HOUR
        if self.p_now > pol.risk_threshold and per_h[best] * (1 + move_h) < per_h[self.zone]:
            self._migrate(best)  # a move pays for itself within the hour
        elif self.target < self.n:
            self._resize(self.target)
        elif self.p_now > pol.risk_threshold and self.since_save > (self.cfg.job.checkpoint_s or 0.0):
            self._start(self._ckpt())  # a proactive checkpoint before the predicted interruption
        missing = self.target - self.n - len(self.arrivals)
        self.arrivals += [self.t + f.replace_s] * max(missing, 0)

    def _migrate(self, zone: str) -> None:
        def move() -> None:
            self.zone = zone
            self.n = min(self.n, self.target)
            self.exposure = float(self.rng.exponential())

        self.out.migrations += 1
        self._start(self._ckpt(), _Phase("move", self.cfg.policy.migrate_s, move), self._restore())
