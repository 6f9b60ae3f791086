"""Few-shot adaptation: MAML, first-order MAML, ANIL and Reptile on ``torch.func``, trained across
ranks by the engine (``vatra meta``), and adaptation of the learned initialisation to a new task."""

from vatra.meta.algorithms import InnerLoop, TaskLoss, adapt, evaluate_tasks, task_batch, task_meta_grad
from vatra.meta.plugin import MetaLearner, MetaSteps
from vatra.meta.tasks import ClassTasks, ColumnTasks, TaskSampler, UserTasks

__all__ = [
    "ClassTasks",
    "ColumnTasks",
    "InnerLoop",
    "MetaLearner",
    "MetaSteps",
    "TaskLoss",
    "TaskSampler",
    "UserTasks",
    "adapt",
    "evaluate_tasks",
    "task_batch",
    "task_meta_grad",
]
