"""``[tune]``: a hyper-parameter study over the run the rest of the file describes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section

Scalar = bool | int | float | str


class ParamConfig(Section):
    """One searched config key: ``[tune.space."optim.lr"]``.

    ``when`` makes it conditional: it is suggested (and applied) only when each named parameter of
    the space took that value or one of a list, e.g. ``when = { "optim.name" = "sgd" }``.
    """

    type: Literal["float", "int", "categorical"] = Field(..., description="float, int or categorical.")
    low: float | None = Field(None, description="float/int: lower bound (inclusive).")
    high: float | None = Field(None, description="float/int: upper bound (inclusive).")
    log: bool = Field(False, description="float/int: sample on a log scale (low > 0).")
    step: int | None = Field(None, ge=1, description="int: spacing of the values (not with log).")
    choices: list[Scalar] = Field([], description="categorical: the values to choose from.")
    when: dict[str, Scalar | list[Scalar]] = Field(
        {}, description="Suggest only when these parameters of the space have this value (or one of these)."
    )

    @model_validator(mode="after")
    def _check(self) -> ParamConfig:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("categorical needs a non-empty choices list, e.g. choices = ['sgd', 'adam']")
            if self.low is not None or self.high is not None:
                raise ValueError("categorical takes choices, not low/high")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"{self.type} needs low and high, e.g. low = 0.0, high = 1.0")
        if self.choices:
            raise ValueError(f"{self.type} takes low/high, not choices (use type = 'categorical')")
        if self.type == "int" and not (float(self.low).is_integer() and float(self.high).is_integer()):
            raise ValueError(f"int needs whole-number bounds (got low = {self.low}, high = {self.high})")
        if self.low >= self.high:
            raise ValueError(f"empty range: low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0 (got low = {self.low})")
        if self.step is not None and (self.type != "int" or self.log):
            raise ValueError("step is for int parameters without log")
        return self


class TuneConfig(Section):
    """A study: which summary.json metric to optimise, how, where trials are recorded and run."""

    objective: str = Field(
        "val_accuracy", description="The summary.json metric a trial is scored by (e.g. val_accuracy)."
    )
    direction: Literal["maximize", "minimize"] = Field("maximize", description="Maximise or minimise it.")
    trials: int = Field(20, ge=1, description="Finished trials (complete, pruned or failed) to reach.")
    timeout_s: float = Field(0.0, ge=0.0, description="Stop asking for new trials after this; 0 = no limit.")
    sampler: Literal["random", "tpe", "gp", "adaptive"] = Field(
        "tpe", description="random, tpe (multivariate, constant liar), gp, or adaptive (ours, wrapping TPE)."
    )
    pruner: Literal["none", "median", "successive_halving", "hyperband"] = Field(
        "none", description="Stops hopeless trials at their eval steps (train.eval_every must be > 0)."
    )
    pruner_startup: int = Field(
        10, ge=0, description="median: trials that finish before any trial is pruned."
    )
    pruner_warmup: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="median: the share of a trial's evaluations it runs before it can be pruned (early "
        "values say little about the final one).",
    )
    workers: int = Field(1, ge=1, description="Trial worker processes on this machine (CLI --workers).")
    storage: str = Field(
        "",
        description="'' = the journal file runs/<study>/journal.log; or postgresql://user@host:port/db "
        "(many machines join one study; the password from PGPASSWORD or ~/.pgpass: one in the URL is "
        "kept out of every file and worker command line).",
    )
    study: str = Field("", description="Study name; '' = run.name. Its folder is <run.out_dir>/<study>.")
    trial_nproc: int = Field(1, ge=1, description="Processes per trial (2 = a 2-rank distributed run).")
    epochs: int = Field(
        0,
        ge=0,
        description="Train each trial for this many epochs of its training rows, whatever batch size it "
        "draws (train.steps from it, and an evaluation per epoch for pruning); 0 = train.steps as set.",
    )
    seed: int | None = Field(None, description="Sampler seed; None = run.seed.")
    space: dict[str, ParamConfig] = Field(
        {}, description='The searched keys: [tune.space."section.key"] tables (dotted config paths).'
    )

    def is_default(self) -> bool:
        """True when the config has no study in it (nothing to dump, nothing a run ignores)."""
        return self == TuneConfig()
