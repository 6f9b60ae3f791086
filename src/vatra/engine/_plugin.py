"""The event protocol features attach to, and the list that dispatches events in order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vatra.engine.trainer import Trainer


class Plugin:
    """Base class of everything that acts during training.

    Call order for one run: ``on_fit_start`` once; per optimizer step ``on_step_start`` →
    (micro-steps) → ``after_backward`` (gradients are synchronised across ranks; setting
    ``trainer.state.skip_update`` drops this update) → ``on_step_end`` (with the step's metrics
    dict, which a plugin may extend); ``on_eval_end`` after each evaluation; ``on_fit_end`` with
    the summary dict (extendable) on success, or ``on_failure`` with the exception. Plugins run
    in list order on every rank; each checks ``trainer.dist.rank`` itself when only rank 0
    should act. Plugins never import each other; they share data through ``trainer.state``.
    """

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_step_start(self, trainer: Trainer) -> None: ...

    def after_backward(self, trainer: Trainer) -> None: ...

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None: ...


class PluginList:
    """Dispatches each event to every plugin in order."""

    def __init__(self, plugins: Iterable[Plugin] = ()) -> None:
        self.plugins = list(plugins)

    def __iter__(self) -> Iterator[Plugin]:
        return iter(self.plugins)

    def on_fit_start(self, trainer: Trainer) -> None:
        for p in self.plugins:
            p.on_fit_start(trainer)

    def on_step_start(self, trainer: Trainer) -> None:
        for p in self.plugins:
            p.on_step_start(trainer)

    def after_backward(self, trainer: Trainer) -> None:
        for p in self.plugins:
            p.after_backward(trainer)

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        for p in self.plugins:
            p.on_step_end(trainer, metrics)

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        for p in self.plugins:
            p.on_eval_end(trainer, metrics)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for p in self.plugins:
            p.on_fit_end(trainer, summary)

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        # Every plugin gets its chance even if an earlier one fails: failure paths must not hide failures.
        for p in self.plugins:
            try:
                p.on_failure(trainer, exc)
            except Exception:
                continue
