"""Live exporters: a Prometheus ``/metrics`` endpoint on rank 0 and OpenTelemetry step spans."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra._extras import require
from vatra.config import MonitorConfig
from vatra.engine import Plugin
from vatra.errors import ConfigError
from vatra.monitor.aftercare import best_effort

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
    """Serves the latest metrics at ``http://<addr>:<port>/metrics`` on rank 0 while the run is live.

    A step only merges its metrics into one dict (about a microsecond); the gauges are built from
    it when Prometheus scrapes, in the HTTP server's daemon thread, so the loop pays nothing per
    metric. Sparse metrics (validation, system samples, per-rank times) keep their last value.
    The URL is logged as an event.
    """

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.server: Any = None
        self.thread: Any = None
        self.port: int | None = None
        self.latest: dict[str, Any] = {}
        self.extras: dict[str, Any] = {}  # the trainer's state.extras: healing counts live there

    def on_fit_start(self, trainer: Trainer) -> None:
        if not trainer.dist.is_main or self.cfg.prometheus_port is None:
            return
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        registry.register(self)  # a custom collector: `collect` runs on each scrape
        self.extras = trainer.state.extras
        try:
            self.server, self.thread = _serve(registry, self.cfg.prometheus_addr, self.cfg.prometheus_port)
        except OSError as exc:
            where = f"{self.cfg.prometheus_addr}:{self.cfg.prometheus_port}"
            raise ConfigError(
                f"monitor.prometheus_port: cannot serve on {where} ({exc}); pick a free port or 0 for any"
            ) from None
        self.port = self.server.server_port
        trainer.log_event("prometheus", url=f"http://{self.cfg.prometheus_addr}:{self.port}/metrics")

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.server is not None:
            self.latest.update(metrics)  # atomic under the GIL, as is the scrape's copy

    def collect(self) -> Iterator[Any]:
        """Called by prometheus_client on each scrape (server thread): gauges from the latest values."""
        from prometheus_client.core import GaugeMetricFamily

        latest = dict(self.latest)
        actions = dict(self.extras.get("heal", {}).get("actions", {}))
        for key, (name, help_text) in GAUGES.items():
            value = latest.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(name, help_text, value=value)
        phase = GaugeMetricFamily(
            "vatra_step_phase_seconds", "Seconds of the last step by phase", labels=["phase"]
        )
        for key, name in PHASES.items():
            if key in latest:
                phase.add_metric([name], latest[key])
        yield phase
        ranks = GaugeMetricFamily(
            "vatra_rank_step_seconds",
            "Mean step and compute seconds per rank over the last window",
            labels=["rank", "kind"],
        )
        for kind in ("step", "compute"):
            for rank, value in enumerate(latest.get(f"rank_{kind}_time_s", [])):
                ranks.add_metric([str(rank), kind], value)
        yield ranks
        heal = GaugeMetricFamily("vatra_heal_actions", "Healing actions taken so far", labels=["action"])
        for action, count in actions.items():
            heal.add_metric([action], count)
        yield heal

    def _stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()  # returns within the loop's 50 ms poll interval
            self.server.server_close()
            self.thread.join(timeout=5)
            self.server = None

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        best_effort("exporter", self._stop, trainer.log_event)  # never fails a finished run

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop()


def _serve(registry: Any, addr: str, port: int) -> tuple[Any, threading.Thread]:
    """prometheus_client's WSGI app on a threading server polled every 50 ms (its own helper polls
    every 0.5 s, which made every run end half a second late waiting for the server to stop)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
            return None

    server = make_server(addr, port, make_wsgi_app(registry), ThreadingWSGIServer, handler_class=QuietHandler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="vatra-prometheus", daemon=True
    )
    thread.start()
    return server, thread


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
        require("opentelemetry.sdk", "otel", "monitor.tracing")
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
            require("opentelemetry.exporter.otlp.proto.http", "otel", "monitor.tracing_exporter = 'otlp'")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

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
        best_effort("exporter", self._stop, trainer.log_event)  # never fails a finished run

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self._stop()
