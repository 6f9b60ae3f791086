"""Training faults on purpose (the ``chaos`` section): NaN loss, gradient and LR spikes, slow or
out-of-memory ranks. The plugin counts data steps; each fault is its own hook (:mod:`._hooks`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vatra.config import ChaosConfig
from vatra.engine import Plugin
from vatra.errors import ConfigError
from vatra.resilience.chaos._hooks import HOOKS, FaultHook

if TYPE_CHECKING:
    from vatra.data import Batch
    from vatra.engine import Trainer


class TrainingFaults(Plugin):
    """Injects the training faults of ``chaos``; placed first so every other plugin sees them.

    The step-keyed faults are faults of the data: a fault "at step s" is in the batches an
    undisturbed run trains on at step s (its data step), as a real bad batch is. Real loss spikes
    come from particular batches meeting a particular model state (PaLM, §5.1), and a fault keyed
    to the step number would meet every replay of that number again, which no rollback can heal
    (it stands for a broken schedule, not for bad data). So after a rollback, whose sampler keeps
    its position, the replayed step numbers train on new data and do not meet the fault again,
    while a resume from a checkpoint, which replays the data, does. The plugin counts the batches
    the trainer draws (it wraps ``trainer.next_batch``; healing draws through it to skip data): a
    step's data step is 1 + the batches drawn before it // ``train.grad_accum``. A resumed process
    starts counting at the restored step. Faults act through hooks, so the engine is untouched:
    one :class:`~vatra.resilience.chaos._hooks.FaultHook` per fault that ``chaos`` asks for
    (``inject_nan_at``, ``slow_rank``, ``speed_factors``, ``gpu_memory_gb``, ``oom_batch``,
    ``grad_spike_at``, ``lr_spike_at``), each documented with its hook.

    Each ``chaos`` event carries ``at_step`` (the step that met the fault) and ``data_step``.
    """

    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.faults: list[FaultHook] = [hook(cfg) for hook in HOOKS if hook.wanted(cfg)]
        self.drawn: int | None = None  # batches drawn by the trainer (set at the first step)
        self.handles: list[Any] = []
        self.trainer: Trainer | None = None  # whose next_batch is wrapped
        self.step_drawn = 0  # batches drawn before this step (a redone step draws them again)

    @classmethod
    def wanted(cls, cfg: ChaosConfig) -> bool:
        return any(hook.wanted(cfg) for hook in HOOKS)

    def on_fit_start(self, trainer: Trainer) -> None:
        try:  # the per-rank lists name every rank
            self.cfg.check_world_size(trainer.dist.world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for fault in self.faults:
            self.handles += fault.install(trainer)
        draw = trainer.next_batch

        def counted() -> Batch:
            self.drawn = (self.drawn or 0) + 1
            return draw()

        trainer.next_batch = counted  # type: ignore[method-assign]  # an instance attribute, removed at the end
        self.trainer = trainer

    def on_step_start(self, trainer: Trainer) -> None:
        accum = trainer.cfg.train.grad_accum
        if self.drawn is None:  # the first step of this process: at the restored step if resumed
            self.drawn = trainer.state.step * accum
        self.step_drawn = self.drawn
        data_step = self.drawn // accum + 1
        where = {"at_step": trainer.state.step + 1, "data_step": data_step}
        for fault in self.faults:
            fault.begin(trainer, data_step, where)

    def after_backward(self, trainer: Trainer) -> None:
        for fault in self.faults:
            fault.end()  # evaluation's forward passes stay clean

    def on_oom(self, trainer: Trainer, ranks: list[int]) -> None:
        self.drawn = self.step_drawn  # the redone step is the same data step

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.trainer is not None:
            del self.trainer.next_batch  # the class's method again
            self.trainer = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._remove()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._remove()
