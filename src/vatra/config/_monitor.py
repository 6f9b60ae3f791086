"""The ``monitor`` and ``heal`` sections: metrics, exporters, anomaly detectors, self-healing."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from vatra.config._sections import Section
from vatra.registry import DETECTORS, POLICIES


class MonitorConfig(Section):
    enabled: bool = Field(True, description="Collect system metrics, gather ranks and run the detectors.")
    gather_every: int = Field(
        10,
        ge=1,
        description="Steps between gathers of every rank's buffered rows (one small collective).",
    )
    system_every: int = Field(10, ge=1, description="Steps between psutil/NVML samples (CPU, memory, GPU).")
    module_grad_norms: bool = Field(
        False, description="Also log the gradient norm of each top-level module (one extra pass per step)."
    )
    detectors: list[Annotated[str, AfterValidator(DETECTORS.check)]] = Field(
        ["zscore", "iforest", "autoencoder"],
        description="Detectors the ensemble runs on rank 0: zscore, iforest, autoencoder, or import "
        "strings 'package.module:Class' naming vatra.monitor.Detector subclasses (called as "
        "Class(monitor section, n_features); named by their 'name' attribute, else by the string).",
    )
    vote: int = Field(
        2, ge=1, description="Detectors (of the fitted ones) that must agree before the ensemble alarms."
    )
    warmup_steps: int = Field(
        50,
        ge=10,
        description="Steps the detectors learn from before they may alarm (and the skip and divergence "
        "rules of healing may act on anything but NaN/Inf).",
    )
    refit_every: int = Field(
        2000,
        ge=0,
        description="Clean steps between refits of the learned detectors (background thread); 0 = never.",
    )
    fit_in: Literal["process", "thread"] = Field(
        "process",
        description="Where iforest/autoencoder fit: a niced helper process (no GIL contention with "
        "the training loop) or a thread of rank 0's training process.",
    )
    zscore_threshold: float = Field(
        10.0,
        gt=0.0,
        description="zscore: robust z (over EWMA and spread) above which a value is a spike; an alarm is "
        "blamed on the streams above it (healing: loss streams roll back, the gradient stream skips).",
    )
    ewma_alpha: float = Field(0.05, gt=0.0, lt=1.0, description="zscore: weight of the newest value.")
    score_quantile: float = Field(
        0.995, gt=0.5, lt=1.0, description="iforest/autoencoder: quantile q of the training scores."
    )
    score_margin: float = Field(
        4.0, ge=0.0, description="iforest: alarm above q + margin × (q − median) of those scores."
    )
    autoencoder_margin: float = Field(
        10.0,
        ge=0.0,
        description="autoencoder: the same margin for reconstruction errors (their tail is longer).",
    )
    prometheus_port: int | None = Field(
        None, ge=0, le=65535, description="Serve Prometheus /metrics on rank 0 at this port (0 = any free)."
    )
    prometheus_addr: str = Field("127.0.0.1", description="Address the Prometheus endpoint binds to.")
    tracing: bool = Field(False, description="OpenTelemetry spans for each step's phases.")
    tracing_exporter: Literal["console", "otlp"] = Field(
        "console",
        description="console = one JSON span per line in <run>/traces/rank<r>.jsonl (one file per rank); "
        "otlp = OTLP/HTTP to otlp_endpoint.",
    )
    otlp_endpoint: str = Field(
        "http://127.0.0.1:4318/v1/traces", description="OTLP/HTTP endpoint (tracing_exporter = otlp)."
    )
    mlflow_uri: str = Field(
        "",
        description="MLflow tracking URI (sqlite:///mlflow.db, http://host:5000): rank 0 logs the config as "
        "params, metrics as it trains and the exported model at the end; an MLflow failure is one "
        "warning line, never a failed run. '' = off.",
    )
    mlflow_experiment: str = Field("vatra", description="MLflow experiment the run is logged under.")
    mlflow_every_s: float = Field(
        10.0, ge=0.0, description="Seconds between batches of metrics sent to MLflow (0 = every step)."
    )
    report: bool = Field(True, description="Write report.html into the run folder at the end of a run.")
    profile_steps: str = Field(
        "",
        description="torch.profiler window 'A:B': steps A to B (from 1, inclusive) traced on every rank "
        "into <run>/trace-rank<r>.json, as `vatra profile` does (docs/profiling.md); '' = off.",
    )

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value: str) -> str:
        if value:
            profile_window(value)
        return value


def profile_window(text: str) -> tuple[int, int]:
    """Steps ``(A, B)`` of a window written ``A:B`` (1 ≤ A ≤ B), else ValueError saying how to fix it."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or a < 1 or b < a:
        raise ValueError(f"steps {text!r}: expected A:B with 1 ≤ A ≤ B, e.g. 5:8 (steps 5 to 8)")
    return a, b


class HealConfig(Section):
    enabled: bool = Field(True, description="Act on anomalies (monitor.enabled must be true too).")
    policies: list[Annotated[str, AfterValidator(POLICIES.check)]] = Field(
        ["skip_spike", "rollback", "straggler", "prefetch"],
        description="Policies that may act: skip_spike, rollback, straggler, prefetch, or import strings "
        "'package.module:Class' naming vatra.resilience.heal.Policy subclasses (called as Class(config); "
        "named by their 'name' attribute, else by the string).",
    )
    divergence_windows: int = Field(
        2,
        ge=1,
        description="rollback: consecutive monitor windows (monitor.gather_every steps each) with alarms "
        "on the loss streams that roll back; a rollback also skips the data of at least this many "
        "windows from the first alarmed step.",
    )
    lr_backoff: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="rollback: LR multiplier for a rollback that comes before the loss got back on its "
        "baseline after the previous one (cumulative); the LR returns to its schedule once it is back.",
    )
    snapshot_every: int = Field(
        25, ge=1, description="rollback: steps between in-memory last-good snapshots (no checkpoint plugin)."
    )
    straggler_ratio: float = Field(
        2.0,
        gt=1.0,
        description="straggler: a rank's compute time above ratio × the other ranks' median names it.",
    )
    data_wait_share: float = Field(
        0.5, gt=0.0, lt=1.0, description="prefetch: data wait above this share of step time raises prefetch."
    )
    max_prefetch: int = Field(8, ge=1, description="prefetch: the most batches prefetched ahead.")
    escalate_after_skips: int = Field(
        2,
        ge=1,
        description="rollback: this many consecutive skipped updates roll back (skipping is not helping).",
    )
    max_actions: int = Field(10, ge=1, description="Cap on actions (skip, rollback) per window.")
    window_steps: int = Field(100, ge=1, description="Window of the action cap, in steps.")
