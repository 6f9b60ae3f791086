"""The ``meta`` section: few-shot adaptation (MAML, first-order MAML, ANIL, Reptile), read by
``vatra meta``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section
from vatra.errors import ConfigError
from vatra.registry import is_import_string


class MetaConfig(Section):
    """Meta-learning of an initialisation that adapts to a new task in a few gradient steps.

    Each optimizer step of ``vatra meta`` is one meta-step over ``tasks_per_step`` episodes, shared
    out across the ranks; ``optim.*`` is the outer optimizer and ``train.steps`` counts meta-steps.
    """

    enabled: bool = Field(False, description="Set by 'vatra meta': the run trains on episodes.")
    algorithm: Literal["maml", "fomaml", "anil", "reptile"] = Field(
        "maml",
        description="maml = second order through the inner steps; fomaml = first order; anil = MAML "
        "adapting only the head in the inner loop; reptile = the outer step moves towards the adapted "
        "weights (use optim.name = 'sgd').",
    )
    tasks: Literal["classes", "column", "sampler"] = Field(
        "classes",
        description="classes = N-way k-shot episodes from disjoint class splits of the data; column = one "
        "task per value of meta.task_column (a table column); sampler = meta.sampler's episodes.",
    )
    ways: int = Field(5, ge=2, description="classes: classes per episode (the model's first outputs).")
    shots: int = Field(5, ge=1, description="Labelled support examples per class and episode.")
    queries: int = Field(15, ge=1, description="Query examples per class and episode (the outer loss).")
    tasks_per_step: int = Field(
        8, ge=1, description="Episodes per meta-step over all ranks (a multiple of the world size)."
    )
    inner_steps: int = Field(1, ge=1, le=100, description="Gradient steps of the inner loop.")
    inner_lr: float = Field(0.4, gt=0, description="The inner loop's learning rate (Meta-SGD: its start).")
    learn_inner_lr: bool = Field(
        False, description="Meta-SGD: learn one inner LR per parameter tensor (maml and anil)."
    )
    head: str = Field(
        "auto",
        description="anil: the parameter name prefix of the head the inner loop adapts; auto = the last "
        "module with parameters.",
    )
    vmap: bool = Field(True, description="Vectorise a rank's tasks with torch.func.vmap (else a loop).")
    val_classes: int = Field(0, ge=0, description="classes: classes held out for meta-validation.")
    test_classes: int = Field(5, ge=1, description="classes: classes held out for meta-testing.")
    task_column: str = Field("", description="column: the table column whose values name the tasks.")
    val_tasks: int = Field(0, ge=0, description="column: tasks (column values) held out for meta-validation.")
    test_tasks: int = Field(1, ge=1, description="column: tasks held out for meta-testing.")
    sampler: str = Field(
        "",
        description="sampler: 'pkg.module:fn', fn(split, rng) -> (support_x, support_y, query_x, query_y).",
    )
    eval_tasks: int = Field(
        40,
        ge=1,
        description="Episodes per evaluation (meta-val every train.eval_every, meta-test at the end).",
    )

    def is_default(self) -> bool:
        """True when the config says nothing about meta-learning (the section is not dumped)."""
        return self == MetaConfig()

    def check_world(self, world: int) -> None:
        """Every rank computes the same number of episodes: refuse a meta-batch that does not split."""
        if self.tasks_per_step % world:
            raise ConfigError(
                f"meta.tasks_per_step = {self.tasks_per_step} is not a multiple of the world size {world}; "
                f"give a multiple of {world} (each rank computes the same number of episodes)"
            )

    def kept_columns(self) -> tuple[str, ...]:
        """Table columns the data source keeps aside for the tasks (not as features)."""
        return (self.task_column,) if self.enabled and self.tasks == "column" else ()

    @model_validator(mode="after")
    def _check(self) -> MetaConfig:
        if self.tasks == "column" and not self.task_column:
            raise ValueError(
                "meta.tasks = 'column' needs meta.task_column = the table column naming each task"
            )
        if self.tasks == "sampler" and not is_import_string(self.sampler):
            raise ValueError(
                f"meta.tasks = 'sampler' needs meta.sampler = 'pkg.module:fn' (got {self.sampler!r})"
            )
        if self.learn_inner_lr and self.algorithm not in ("maml", "anil"):
            raise ValueError(
                f"meta.learn_inner_lr: Meta-SGD learns the inner LR through the second-order "
                f"meta-gradient, which {self.algorithm} does not take; use meta.algorithm = 'maml' or 'anil'"
            )
        return self
