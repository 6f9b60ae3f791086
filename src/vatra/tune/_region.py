"""The adaptive sampler's region: which parameters are narrowed or frozen, and the study the inner
sampler sees through it.

A region is plain JSON (it lives in the study's user attrs, so every worker on a shared storage reads
the same one). Per parameter it holds the ORIGINAL distribution and one of: a narrowed ``[low, high]``
(numeric), a kept subset of choices (categorical), or a frozen value. Trials always record the original
distribution; only the inner sampler sees narrowed ones, through :class:`RegionStudy`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Container
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    json_to_distribution,
)
from optuna.trial import FrozenTrial, TrialState

# Where optuna's TPE and GP samplers share a running trial's relative params with other workers; a
# running trial's not-yet-suggested params are read from here to decide whether it lies in the region.
_RELATIVE_PARAMS_KEYS = ("tpe:relative_params", "gp:relative_params")

ParamRegion = dict[str, Any]
"""``{"dist": <optuna distribution JSON>, and one of "low"/"high" | "keep" | "frozen"}``."""


def is_numeric(dist: BaseDistribution) -> bool:
    return isinstance(dist, FloatDistribution | IntDistribution)


def to_unit(dist: FloatDistribution | IntDistribution, value: float) -> float:
    """The space ranges are measured in: log for log-scaled parameters, linear otherwise."""
    return math.log(value) if dist.log else float(value)


def from_unit(dist: FloatDistribution | IntDistribution, u: float) -> float:
    return math.exp(u) if dist.log else u


def narrowed_distribution(pr: ParamRegion) -> BaseDistribution | None:
    """The distribution the inner sampler proposes from; ``None`` for a frozen parameter."""
    dist = json_to_distribution(pr["dist"])
    if "frozen" in pr:
        return None
    if isinstance(dist, CategoricalDistribution):
        return CategoricalDistribution([dist.choices[i] for i in pr["keep"]])
    assert isinstance(dist, FloatDistribution | IntDistribution)
    return _snap(dist, pr["low"], pr["high"])


def _snap(dist: FloatDistribution | IntDistribution, low: float, high: float) -> BaseDistribution:
    """``[low, high]`` as a distribution of the same kind, aligned to the original's step grid."""
    if dist.step is None:
        return FloatDistribution(low, high, log=dist.log)
    step = dist.step
    lo = dist.low + math.ceil((low - dist.low) / step - 1e-9) * step
    hi = dist.low + math.floor((high - dist.low) / step + 1e-9) * step
    lo, hi = max(lo, dist.low), min(hi, dist.high)
    if hi <= lo:  # narrower than one step: keep the two grid points around it
        lo = max(dist.low, lo - step)
        hi = min(dist.high, lo + step)
    if isinstance(dist, IntDistribution):
        return IntDistribution(round(lo), round(hi), log=dist.log, step=int(step))
    return FloatDistribution(lo, hi, step=step)


def frozen_value(pr: ParamRegion) -> Any:
    return json_to_distribution(pr["dist"]).to_external_repr(pr["frozen"])


def describe(pr: ParamRegion | None) -> dict[str, Any] | None:
    """A region entry as a person reads it in ``events.jsonl``: bounds, kept choices or frozen value."""
    if pr is None:
        return None
    dist = json_to_distribution(pr["dist"])
    if "frozen" in pr:
        return {"frozen": frozen_value(pr)}
    if isinstance(dist, CategoricalDistribution):
        return {"choices": [dist.choices[i] for i in pr["keep"]]}
    return {"low": pr["low"], "high": pr["high"], "log": bool(getattr(dist, "log", False))}


def original_describe(dist: BaseDistribution) -> dict[str, Any]:
    if isinstance(dist, CategoricalDistribution):
        return {"choices": list(dist.choices)}
    assert isinstance(dist, FloatDistribution | IntDistribution)
    return {"low": dist.low, "high": dist.high, "log": dist.log}


def known_params(trial: FrozenTrial) -> dict[str, Any]:
    """A trial's params, plus, for a running trial, the relative params its sampler already chose."""
    if trial.state.is_finished():
        return trial.params
    merged: dict[str, Any] = {}
    for key in _RELATIVE_PARAMS_KEYS:
        chunks, i = [], 0
        while (chunk := trial.system_attrs.get(f"{key}:{i}")) is not None:
            chunks.append(chunk)
            i += 1
        if chunks:
            # another worker may be mid-write: its params then come from trial.params below
            with contextlib.suppress(json.JSONDecodeError):
                merged.update(json.loads("".join(chunks)))
    merged.update(trial.params)
    return merged


class Region:
    """A stored region compiled for lookups: per reshaped parameter its original distribution, the
    narrowed one (``None`` when frozen) and the frozen value. Views of finished trials are cached, as
    finished trials never change; a region is immutable, one per stored version."""

    def __init__(self, entries: dict[str, ParamRegion]) -> None:
        self.entries = entries
        self._original = {n: json_to_distribution(pr["dist"]) for n, pr in entries.items()}
        self._narrowed = {n: narrowed_distribution(pr) for n, pr in entries.items()}
        self._frozen = {n: frozen_value(pr) for n, pr in entries.items() if "frozen" in pr}
        self._views: dict[int, FrozenTrial | None] = {}

    def applies(self, name: str, dist: BaseDistribution) -> bool:
        """Whether ``name`` suggested with ``dist`` is reshaped (a parameter whose distribution changed
        since the reshaping is left to the inner sampler as it is)."""
        return name in self._original and self._original[name] == dist

    def narrowed(self, name: str) -> BaseDistribution | None:
        return self._narrowed[name]

    def frozen(self, name: str) -> Any:
        return self._frozen[name]

    def original(self, name: str) -> BaseDistribution:
        return self._original[name]

    def contains(self, name: str, value: Any) -> bool:
        """Whether ``value`` is inside the region of ``name`` (a frozen one: equals the frozen value)."""
        narrowed = self._narrowed[name]
        if narrowed is None:
            return bool(value == self._frozen[name])
        if isinstance(narrowed, CategoricalDistribution):
            return value in narrowed.choices
        assert isinstance(narrowed, FloatDistribution | IntDistribution)
        return bool(narrowed.low <= value <= narrowed.high)

    def view(self, trial: FrozenTrial) -> FrozenTrial | None:
        """``trial`` as the inner sampler sees it: narrowed distributions, frozen params removed;
        ``None`` when one of its params lies outside the region (it would mislead the inner model)."""
        if not self.entries:
            return trial
        finished = trial.state.is_finished()
        if finished and trial._trial_id in self._views:
            return self._views[trial._trial_id]
        params = dict(trial.params)
        dists = dict(trial.distributions)
        view: FrozenTrial | None = None
        for name, value in known_params(trial).items():
            if name not in self._original or (name in dists and dists[name] != self._original[name]):
                continue
            narrowed = self._narrowed[name]
            if narrowed is None:
                params.pop(name, None)
                dists.pop(name, None)
            elif not self.contains(name, value):
                break
            elif name in dists:
                dists[name] = narrowed
        else:
            view = copy.copy(trial)
            view._params = params
            view._distributions = dists
        if finished:
            self._views[trial._trial_id] = view
        return view


class RegionStudy(optuna.study.Study):
    """A read view of a study for the inner sampler: the same storage, directions and attributes, but
    ``get_trials`` returns in-region trials with narrowed distributions. The real study and its stored
    trials are never modified, so the dashboard, importances and other samplers read the originals."""

    def __init__(self, study: optuna.study.Study, region: Region) -> None:
        # Study.__init__ would re-open the study from storage; copy the handles instead. ``object.
        # __getattribute__`` because pruners may pass a restricted study (HyperbandPruner's brackets).
        for attr in ("study_name", "_study_id", "_storage", "_directions", "sampler", "pruner"):
            object.__setattr__(self, attr, object.__getattribute__(study, attr))
        self._thread_local = object.__getattribute__(study, "_thread_local")
        self._stop_flag = False
        self._base = study
        self._region = region

    def _get_trials(
        self,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
        use_cache: bool = False,
    ) -> list[FrozenTrial]:
        trials = self._base._get_trials(deepcopy=False, states=states, use_cache=use_cache)
        views = [v for v in map(self._region.view, trials) if v is not None]
        return copy.deepcopy(views) if deepcopy else views

    def stop(self) -> None:
        self._base.stop()


class TrialsView(RegionStudy):
    """A study whose trials are a fixed list: what a reshaping's importances are computed from."""

    def __init__(self, study: optuna.study.Study, trials: list[FrozenTrial]) -> None:
        super().__init__(study, Region({}))
        self._trials = trials

    def _get_trials(
        self,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
        use_cache: bool = False,
    ) -> list[FrozenTrial]:
        trials = [t for t in self._trials if states is None or t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials
