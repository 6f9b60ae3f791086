"""``AdaptiveSampler``: an optuna sampler whose search region narrows and re-widens itself.

It wraps an inner sampler (TPE, GP or any ``BaseSampler``). Every ``every`` finished trials after
``warmup``, it reshapes the region the inner sampler proposes from (see :mod:`vatra.tune._reshape`
for the moves, their triggers and the bandit that picks among them) and logs why.

How the region reaches the inner sampler: the inner sampler is handed a read view of the study
(:class:`vatra.tune._region.RegionStudy`) whose trials are the in-region ones, with narrowed
distributions and frozen parameters removed, and it is asked to sample from the narrowed
distributions. The values it returns lie inside the original distributions, which is what every trial
records: the study stays a plain optuna study for the dashboard, importances and other samplers. A
fresh inner sampler is made per region version, because optuna samplers cache the search space they
inferred (a cached narrowed range would otherwise outlive the region).

How workers agree: each region version is stored in the study's user attrs under
``vatra.adaptive.v0001``, ``v0002``, … (the region, the bandit's statistics and the event). Version v
is computed from the first ``warmup + (v - 1) * every`` finished trials by number (once every trial
before them has ended), with bandit tie-breaks seeded by the study name: any worker that computes it
computes the same state. A worker that finds a version due and not stored computes it, writes it and
uses what is stored; every worker uses the highest stored version, so workers in different processes
or machines on one journal or RDB storage sample from the same region (two that race write the same
state). Each trial records the version it was sampled under in its system attrs
(``vatra.adaptive.version``).
"""

from __future__ import annotations

import copy
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from vatra.tune._region import ParamRegion, Region, RegionStudy, TrialsView
from vatra.tune._reshape import empty_state, importances, reshape

STATE_PREFIX = "vatra.adaptive.v"
TRIAL_VERSION_KEY = "vatra.adaptive.version"


def region_history(study: Study) -> list[dict[str, Any]]:
    """Every stored reshaping event of ``study``, in version order (for reports and ``events.jsonl``)."""
    attrs = study._storage.get_study_user_attrs(study._study_id)
    keys = sorted(k for k in attrs if k.startswith(STATE_PREFIX))
    return [dict(attrs[k]["event"]) for k in keys]


def stored_region(study: Study, version: int) -> dict[str, ParamRegion]:
    """The region of a stored version (``{}`` for version 0, before any reshaping)."""
    if version == 0:
        return {}
    attrs = study._storage.get_study_user_attrs(study._study_id)
    return dict(attrs[f"{STATE_PREFIX}{version:04d}"]["region"])


class AdaptiveSampler(BaseSampler):
    """Wraps ``inner`` and reshapes the region it samples from as the study goes.

    Args:
        inner: ``"tpe"`` (optuna's ``TPESampler``: multivariate, constant liar), ``"gp"``
            (``GPSampler``), or any sampler instance, which is deep-copied at each reshaping (its
            random state restarts from the instance's state then).
        seed: seeds the inner sampler (offset per region version); the same seed and trial sequence
            give the same proposals. Give each worker its own seed, as with any optuna sampler: the
            region is shared through the storage, and the bandit's tie-breaks are seeded by the study
            name so that every worker computes the same reshaping from the same trials.
        every: finished (complete or pruned) trials between reshapings.
        warmup: finished trials before the first reshaping; also the fewest trials a parameter needs
            before it is narrowed or frozen (conditional parameters appear in fewer trials).
        top_quantile: the share of best trials that defines "good values" and PED-ANOVA's target.
        log: called with each reshaping event this process computes: ``{trial, version, move, param,
            old_region, new_region, reason, importances, reward, reward_so_far, best_value,
            n_trials}``.

    Single-objective studies only.
    """

    def __init__(
        self,
        inner: str | BaseSampler = "tpe",
        *,
        seed: int | None = None,
        every: int = 10,
        warmup: int = 10,
        top_quantile: float = 0.25,
        log: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if isinstance(inner, str) and inner not in ("tpe", "gp"):
            raise ValueError(f'inner sampler {inner!r} is unknown: use "tpe", "gp" or a sampler instance')
        if every < 1 or warmup < 2:
            raise ValueError(f"every={every}, warmup={warmup}: need every >= 1 and warmup >= 2")
        if not 0.0 < top_quantile < 1.0:
            raise ValueError(f"top_quantile={top_quantile} must lie strictly between 0 and 1")
        self._inner_spec = inner
        self._seed = seed
        self._every = every
        self._warmup = warmup
        self._top_quantile = top_quantile
        self._log = log
        self._state: dict[str, Any] = empty_state()
        # Inner samplers by region version; trials of the previous version may still be running.
        self._inners: dict[int, BaseSampler] = {0: self._make_inner(0, conditional=False)}
        self._regions: dict[int, Region] = {}
        self._trial_state: dict[int, dict[str, Any]] = {}
        self._trial_space: dict[int, dict[str, BaseDistribution]] = {}

    def __str__(self) -> str:
        return f"AdaptiveSampler({self._inners[max(self._inners)].__class__.__name__})"

    @property
    def region(self) -> dict[str, ParamRegion]:
        """The latest region this process has used."""
        return dict(self._state["region"])

    def _make_inner(self, version: int, conditional: bool) -> BaseSampler:
        # version 0 is seeded like a plain TPESampler(seed=seed): the same random start, so a study
        # compared against one differs only from the first reshaping on
        seed = self._seed
        if seed is not None and version > 0:
            seed = (seed * 1_000_003 + version) % 2**32
        # After the first reshaping the study is past its random start; the inner sampler sees only
        # in-region trials, which may be few, and must model them rather than restart at random.
        startup = 10 if version == 0 else 2
        if self._inner_spec == "tpe":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # group: conditional parameters are modelled with the parameters they appear with
                return optuna.samplers.TPESampler(
                    seed=seed,
                    multivariate=True,
                    constant_liar=True,
                    group=conditional,
                    n_startup_trials=startup,
                )
        if self._inner_spec == "gp":
            return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
        assert isinstance(self._inner_spec, BaseSampler)
        return copy.deepcopy(self._inner_spec)

    def _inner_for(self, version: int, study: Study | None = None) -> BaseSampler:
        """The inner sampler of a region version, made when the version is first used."""
        if version not in self._inners:
            trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if study else []
            conditional = len({frozenset(t.params) for t in trials}) > 1
            self._inners[version] = self._make_inner(version, conditional)
            self._inners = {v: s for v, s in self._inners.items() if v >= max(self._inners) - 1}
        return self._inners[version]

    def _target_version(self, n_finished: int) -> int:
        return 0 if n_finished < self._warmup else 1 + (n_finished - self._warmup) // self._every

    def _stored(self, study: Study) -> dict[str, Any]:
        return study._storage.get_study_user_attrs(study._study_id)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._raise_error_if_multi_objective(study)
        attrs = self._stored(study)
        keys = [k for k in attrs if k.startswith(STATE_PREFIX)]
        state = self._state
        if keys and int(attrs[max(keys)]["version"]) > int(state["version"]):
            state = attrs[max(keys)]
        finished = _settled(study.get_trials(deepcopy=False))
        target = self._target_version(len(finished))
        while int(state["version"]) < target:
            version = int(state["version"]) + 1
            key = f"{STATE_PREFIX}{version:04d}"
            attrs = self._stored(study)
            if key not in attrs:
                basis = finished[: self._warmup + (version - 1) * self._every]
                new_state = self._reshape(study, state, basis, version)
                study._storage.set_study_user_attr(study._study_id, key, new_state)
                attrs = self._stored(study)
                if self._log is not None:
                    self._log(dict(attrs[key]["event"]))
            state = attrs[key]
        self._state = state
        self._trial_state[trial._trial_id] = state
        study._storage.set_trial_system_attr(trial._trial_id, TRIAL_VERSION_KEY, int(state["version"]))
        _, inner, view = self._context(study, trial)
        inner.before_trial(view, trial)

    def _reshape(
        self, study: Study, state: dict[str, Any], basis: list[FrozenTrial], version: int
    ) -> dict[str, Any]:
        complete = [scored for t in basis if (scored := _as_scored(t)) is not None]
        new_state, _ = reshape(
            state,
            complete,
            importances(TrialsView(study, complete), self._top_quantile),
            minimize=study.direction == StudyDirection.MINIMIZE,
            version=version,
            trial_number=basis[-1].number,
            top_quantile=self._top_quantile,
            warmup=self._warmup,
            seed=zlib.crc32(study.study_name.encode()),
        )
        return new_state

    def _region_of(self, state: dict[str, Any]) -> Region:
        version = int(state["version"])
        if version not in self._regions:
            self._regions[version] = Region(state["region"])
            self._regions = {v: r for v, r in self._regions.items() if v >= max(self._regions) - 1}
        return self._regions[version]

    def _context(self, study: Study, trial: FrozenTrial) -> tuple[Region, BaseSampler, Study]:
        state = self._trial_state.get(trial._trial_id, self._state)
        region = self._region_of(state)
        return region, self._inner_for(int(state["version"]), study), RegionStudy(study, region)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        region, inner, view = self._context(study, trial)
        space = inner.infer_relative_search_space(view, trial)  # narrowed distributions
        self._trial_space[trial._trial_id] = space
        # Report the original distributions: the trial checks them against what the objective asks.
        return {
            n: region.original(n) if n in region.entries and region.narrowed(n) == d else d
            for n, d in space.items()
        }

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        _, inner, view = self._context(study, trial)
        narrowed = self._trial_space.get(trial._trial_id, {})
        space = {n: narrowed[n] for n in search_space if n in narrowed}
        return inner.sample_relative(view, trial, space) if space else {}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        region, inner, view = self._context(study, trial)
        if region.applies(param_name, param_distribution):
            narrowed = region.narrowed(param_name)
            if narrowed is None:
                return region.frozen(param_name)
            return inner.sample_independent(view, trial, param_name, narrowed)
        return inner.sample_independent(view, trial, param_name, param_distribution)

    def after_trial(
        self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        _, inner, view = self._context(study, trial)
        inner.after_trial(view, trial, state, values)
        self._trial_state.pop(trial._trial_id, None)
        self._trial_space.pop(trial._trial_id, None)

    def reseed_rng(self) -> None:
        self._seed = None
        for inner in self._inners.values():
            inner.reseed_rng()


def _as_scored(trial: FrozenTrial) -> FrozenTrial | None:
    """A finished trial as the reshaping scores it: a complete one by its value, a pruned one by the
    last value it reported (a pruner stops trials that trail the others, so it ranks low, where it
    belongs; without it a study whose pruner stops most trials would reshape from a handful)."""
    if trial.state == TrialState.COMPLETE:
        return trial
    if trial.state != TrialState.PRUNED or not trial.intermediate_values:
        return None
    last = trial.intermediate_values[max(trial.intermediate_values)]
    scored = copy.copy(trial)
    scored.state, scored.value = TrialState.COMPLETE, float(last)
    return scored


def _settled(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The finished (complete or pruned) trials of the longest prefix, by number, in which every
    trial has ended (a failed one is skipped). A reshaping sees the first trials of this list: every
    worker that computes version v computes it from the same trials, whatever it has yet to see of
    trials that end late (ordering by completion time would race with writes still in flight), so two
    workers that race write the same state."""
    out = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            break
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            out.append(t)
    return out
