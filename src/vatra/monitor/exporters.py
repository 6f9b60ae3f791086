"""Live exporters: a Prometheus ``/metrics`` endpoint on rank 0 and OpenTelemetry step spans."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.config import MonitorConfig
from vatra.engine import Plugin
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.engine import Trainer

# metric key -> (Prometheus name, help)
GAUGES = {
    "step": ("vatra_step", "Optimizer steps completed"),
    "loss": ("vatra_loss", "Training loss of the last step (rank 0's shard)"),
    "lr": ("vatra_learning_rate", "Planned learning rate of the last step"),
    "grad_norm": ("vatra_grad_norm", "Global gradient norm before clipping"),
    "samples_per_s": ("vatra_samples_per_second", "Global samples per second of the last step"),
    "val_loss": ("vatra_val_loss", "Validation loss of the last evaluation"),
    "val_accuracy": ("vatra_val_accuracy", "Validation accuracy of the last evaluation"),
    "straggler_ratio": ("vatra_straggler_ratio", "Slowest rank's compute time over the other ranks' median"),
    "anomalies": ("vatra_anomalies", "Anomalies the detectors have reported so far"),
    "comm_bytes": ("vatra_comm_bytes", "Gradient bytes this rank sent in the last step (comm plugin)"),
    "cpu_percent": ("vatra_process_cpu_percent", "Rank 0 process CPU use"),
    "rss_mb": ("vatra_process_rss_megabytes", "Rank 0 process resident memory"),
    "gpu_util_percent": ("vatra_gpu_utilization_percent", "Rank 0 GPU utilisation (NVML)"),
    "gpu_mem_mb": ("vatra_gpu_memory_megabytes", "Rank 0 GPU memory used (NVML)"),
    "gpu_temp_c": ("vatra_gpu_temperature_celsius", "Rank 0 GPU temperature (NVML)"),
}
PHASES = {"data_time_s": "data", "fwd_bwd_time_s": "forward_backward", "optim_time_s": "optimizer"}


class PrometheusExporter(Plugin):
    """Serves the latest step's metrics at ``http://<addr>:<port>/metrics`` on rank 0 while the run is live.

    Each step only sets a few gauges (a lock and a float store each); the HTTP server runs in a
    daemon thread from ``prometheus_client`` and renders on scrape. The URL is logged as an event.
    """

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.server: Any = None
        self.gauges: dict[str, Any] = {}
        self.port: int | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.dist.is_main or self.cfg.prometheus_port is None:
            return
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = CollectorRegistry()
        self.gauges = {k: Gauge(n, h, registry=registry) for k, (n, h) in GAUGES.items()}
        self.phase = Gauge(
            "vatra_step_phase_seconds", "Seconds of the last step by phase", ["phase"], registry=registry
        )
        self.rank_time = Gauge(
            "vatra_rank_step_seconds",
            "Mean step and compute seconds per rank over the last window",
            ["rank", "kind"],
            registry=registry,
        )
        self.actions = Gauge(
            "vatra_heal_actions", "Healing actions taken so far", ["action"], registry=registry
        )
        try:
            self.server, _ = start_http_server(self.cfg.prometheus_port, self.cfg.prometheus_addr, registry)
        except OSError as exc:
            where = f"{self.cfg.prometheus_addr}:{self.cfg.prometheus_port}"
            raise ConfigError(
                f"monitor.prometheus_port: cannot serve on {where} ({exc}); pick a free port or 0 for any"
            ) from None
        self.port = self.server.server_port
        trainer.log_event("prometheus", url=f"http://{self.cfg.prometheus_addr}:{self.port}/metrics")

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.server is None:
            return
        for key, gauge in self.gauges.items():
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                gauge.set(value)
        for key, phase in PHASES.items():
            self.phase.labels(phase).set(metrics[key])
        for kind in ("step", "compute"):
            for rank, value in enumerate(metrics.get(f"rank_{kind}_time_s", [])):
                self.rank_time.labels(str(rank), kind).set(value)
        for action, count in trainer.state.extras.get("heal", {}).get("actions", {}).items():
            self.actions.labels(action).set(count)

    def _stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._stop()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop()


class StepTracer(Plugin):
    """One OpenTelemetry span per step with child spans for data wait, forward-backward and optimizer.

    The phase times come from the step's metrics, so tracing adds no timers to the loop; spans are
    laid out in phase order from the step's start (data and compute interleave per micro-batch,
    which one span each cannot show). A batch processor exports off the step's path, to
    ``<run>/traces/rank<r>.jsonl`` (console exporter) or an OTLP/HTTP collector.
    """

    def __init__(self, cfg: MonitorConfig, run_dir: Path | None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.provider: Any = None
        self.tracer: Any = None
        self.t0_ns = 0
        self.out: Any = None

    def on_fit_start(self, trainer: Trainer) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

        rank = trainer.dist.rank
        resource = Resource.create(
            {"service.name": "vatra", "vatra.rank": rank, "vatra.run": trainer.cfg.run.name}
        )
        self.provider = TracerProvider(resource=resource)
        exporter: SpanExporter
        if self.cfg.tracing_exporter == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ConfigError(
                    "monitor.tracing_exporter = 'otlp' needs opentelemetry-exporter-otlp-proto-http installed"
                ) from None
            exporter = OTLPSpanExporter(endpoint=self.cfg.otlp_endpoint)
        else:
            folder = (self.run_dir or Path(".")) / "traces"
            folder.mkdir(parents=True, exist_ok=True)
            self.out = (folder / f"rank{rank}.jsonl").open("a", encoding="utf-8")
            exporter = ConsoleSpanExporter(
                out=self.out, formatter=lambda span: span.to_json(indent=None) + "\n"
            )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("vatra.engine")

    def on_step_start(self, trainer: Trainer) -> None:
        self.t0_ns = time.time_ns()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        from opentelemetry import trace

        t = self.t0_ns
        step = self.tracer.start_span(
            "train_step",
            start_time=t,
            attributes={
                "vatra.step": metrics["step"],
                "vatra.loss": metrics["loss"],
                "vatra.skipped": metrics["skipped"],
            },
        )
        ctx = trace.set_span_in_context(step)
        for key, name in (
            ("data_time_s", "data_wait"),
            ("fwd_bwd_time_s", "forward_backward"),
            ("optim_time_s", "optimizer"),
        ):
            end = t + int(metrics[key] * 1e9)
            self.tracer.start_span(name, context=ctx, start_time=t).end(end_time=end)
            t = end
        step.end(end_time=self.t0_ns + int(metrics["step_time_s"] * 1e9))

    def _stop(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # flushes the batch processor
            self.provider = None
        if self.out is not None:
            self.out.close()
            self.out = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._stop()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop()
