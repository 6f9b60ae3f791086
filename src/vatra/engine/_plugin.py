"""The event protocol features attach to, and the list that dispatches events in order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vatra.engine.steps import MicroSteps
    from vatra.engine.trainer import Trainer


class Plugin:
    """Base class of everything that acts during training.

    Call order: ``micro_steps`` once, while the trainer is built; then for one run ``on_fit_start``
    once; per optimizer step ``on_step_start`` → (micro-steps) → ``after_backward`` (gradients are
    synchronised across ranks; setting ``trainer.state.skip_update`` drops this update) →
    ``after_update`` (the optimizer has stepped and ``state.step`` counts the step; before any
    evaluation: where ``dist.mode`` syncs parameters) → ``on_step_end`` (with the step's metrics
    dict, which a plugin may extend); ``on_eval_end`` after each evaluation; ``on_fit_end`` with the
    summary dict (extendable) on success, or ``on_failure`` with the exception; ``on_event`` with
    each event the trainer records (:meth:`Trainer.log_event`: a resume, a healing action), as it
    happens; ``explain`` with the exception, before ``on_failure``. Under a micro-steps
    strategy that redoes a step (``balance.adaptive``'s), a step in which some rank ran out of
    memory calls ``on_oom`` with those ranks on every rank, and its micro-steps are then redone.
    Plugins run in list order on every rank; each checks ``trainer.dist.rank`` itself when only rank
    0 should act. Plugins never import each other; they share data through ``trainer.state``.
    """

    def micro_steps(self, trainer: Trainer) -> MicroSteps | None:
        """A strategy for the trainer's micro-steps (:mod:`vatra.engine.steps`), offered once while
        the trainer is built (its data and sampler are set); None (the default): the plain one."""
        return None

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_step_start(self, trainer: Trainer) -> None: ...

    def after_backward(self, trainer: Trainer) -> None: ...

    def after_update(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_oom(self, trainer: Trainer, ranks: list[int]) -> None: ...

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...

    def on_event(self, trainer: Trainer, kind: str, fields: dict[str, Any]) -> None: ...

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None: ...

    def explain(self, trainer: Trainer, exc: BaseException) -> dict[str, Any] | None:
        """The failure's cause (``{"kind", "confidence", "evidence", "action"}``) for the trainer's
        ``failure`` event, before ``on_failure``; None (the default): this plugin cannot tell."""
        return None


HOOKS = (
    "on_fit_start",
    "on_step_start",
    "after_backward",
    "after_update",
    "on_step_end",
    "on_oom",
    "on_eval_end",
    "on_fit_end",
    "on_event",
    "on_failure",
    "explain",
)


class PluginList:
    """Dispatches each event to every plugin in order.

    Per hook, only the plugins that override it are called (looked up once, here): the per-step
    hooks run thousands of times a second on a small model, and a call into ``Plugin``'s empty
    default for every plugin and every hook is a measurable share of such a step.
    """

    def __init__(self, plugins: Iterable[Plugin] = ()) -> None:
        self.plugins = list(plugins)
        self.by_hook = {
            hook: [getattr(p, hook) for p in self.plugins if overrides(p, Plugin, hook)] for hook in HOOKS
        }

    def __iter__(self) -> Iterator[Plugin]:
        return iter(self.plugins)

    def on_fit_start(self, trainer: Trainer) -> None:
        for hook in self.by_hook["on_fit_start"]:
            hook(trainer)

    def on_step_start(self, trainer: Trainer) -> None:
        for hook in self.by_hook["on_step_start"]:
            hook(trainer)

    def after_backward(self, trainer: Trainer) -> None:
        for hook in self.by_hook["after_backward"]:
            hook(trainer)

    def after_update(self, trainer: Trainer) -> None:
        for hook in self.by_hook["after_update"]:
            hook(trainer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        for hook in self.by_hook["on_step_end"]:
            hook(trainer, metrics)

    def on_oom(self, trainer: Trainer, ranks: list[int]) -> None:
        for hook in self.by_hook["on_oom"]:
            hook(trainer, ranks)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        for hook in self.by_hook["on_eval_end"]:
            hook(trainer, metrics)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for hook in self.by_hook["on_fit_end"]:
            hook(trainer, summary)

    def on_event(self, trainer: Trainer, kind: str, fields: dict[str, Any]) -> None:
        for hook in self.by_hook["on_event"]:
            hook(trainer, kind, fields)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        # Every plugin gets its chance even if an earlier one fails: failure paths must not hide failures.
        for hook in self.by_hook["on_failure"]:
            try:
                hook(trainer, exc)
            except Exception:
                continue

    def explain(self, trainer: Trainer, exc: BaseException) -> dict[str, Any] | None:
        """The first cause a plugin gives (a plugin that fails to explain is passed over)."""
        for hook in self.by_hook["explain"]:
            try:
                cause = hook(trainer, exc)
            except Exception:
                continue
            if cause is not None:
                return dict(cause)
        return None


def overrides(obj: object, base: type, hook: str) -> bool:
    """True when ``obj`` (its class or the instance itself) defines ``hook`` beyond ``base``'s default:
    how per-step dispatchers (plugins here, healing policies) skip calls that would do nothing."""
    return hook in vars(obj) or getattr(type(obj), hook) is not getattr(base, hook)
