"""The serving app: ``/predict``, ``/outcome``, ``/metrics``, ``/healthz`` on FastAPI.

Each request is checked and routed before it joins a batch: the split picks a variant from the
request key, the rows are checked against that variant's columns, then the variant's micro-batcher
scores them with the others that came at the same time. Every refusal is a 4xx with one line,
``{"error": "..."}``; a failing model is a 500 with one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra._extras import require
from vatra.errors import ConfigError
from vatra.serve.batcher import ModelError, RowsRefused
from vatra.serve.metrics import ServeMetrics
from vatra.serve.servelog import OutcomeError, ServeLog
from vatra.serve.source import ModelSource, Slot
from vatra.serve.split import Split
from vatra.serve.variants import Variant

if TYPE_CHECKING:
    from fastapi import FastAPI


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How one model is served."""

    split: Split
    """Aliases and traffic shares (``--ab``); one alias without an A/B test."""
    log_dir: Path
    """Where predictions.jsonl and outcomes.jsonl go (``vatra model ab-report`` reads them)."""
    max_batch: int = 64
    """Most rows in one model call; a larger request is scored alone."""
    max_wait_ms: float = 5.0
    """Latency budget: the longest a request waits for others to share its model call."""
    poll_s: float = 1.0
    """How often each alias is checked for a new version to hot-swap in."""
    max_body_bytes: int = 16 << 20
    """Larger request bodies are refused with 413."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"--max-batch must be at least 1, not {self.max_batch}")
        if not 0 <= self.max_wait_ms <= 10_000:
            raise ConfigError(f"--max-wait-ms must be between 0 and 10000, not {self.max_wait_ms}")
        if self.poll_s <= 0:
            raise ConfigError(f"the alias poll interval must be positive, not {self.poll_s}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"the body limit must be at least 1 KiB, not {self.max_body_bytes}")


def load_slots(source: ModelSource, split: Split) -> dict[str, Slot]:
    """Each alias's current version, loaded (before the server accepts a request)."""
    slots = {}
    for alias in split.aliases:
        version = source.version(alias)
        slots[alias] = Slot(version, source.load(alias, version))
    return slots


def _stderr(line: str) -> None:
    print(f"vatra serve: {line}", file=sys.stderr, flush=True)


def create_app(
    source: ModelSource,
    cfg: ServeConfig,
    slots: dict[str, Slot],
    *,
    log: Callable[[str], None] = _stderr,
) -> FastAPI:
    """The ASGI app serving ``slots`` (from :func:`load_slots`) and hot-swapping from ``source``."""
    fastapi = require("fastapi", "serve", "vatra model serve")
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    from vatra.serve import _requests as rq

    metrics = ServeMetrics()
    servelog = ServeLog(cfg.log_dir)
    variants = {
        alias: Variant(
            alias,
            slots[alias],
            max_batch=cfg.max_batch,
            max_wait_s=cfg.max_wait_ms / 1000,
            observe=metrics.observer(alias),
        )
        for alias in cfg.split.aliases
    }
    for alias, slot in slots.items():
        metrics.version.labels(alias, slot.version).set(1)

    def on_swap(alias: str, old: str, new: str) -> None:
        metrics.swapped(alias, old, new)
        log(f"{alias}: swapped {old} -> {new}")

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(v.batcher.run()) for v in variants.values()]
        tasks += [asyncio.create_task(v.watch(source, cfg.poll_s, on_swap, log)) for v in variants.values()]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            servelog.close()

    app = fastapi.FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(message: str, status: int) -> Response:
        return JSONResponse({"error": message}, status_code=status)

    def respond(payload: dict[str, Any]) -> Response:
        body = json.dumps(payload, default=rq.jsonable, separators=(",", ":"))
        return Response(body, media_type="application/json")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:  # 404, 405 from routing
        return error(
            f"{exc.detail}: the server has POST /predict, POST /outcome, GET /metrics, GET /healthz",
            exc.status_code,
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> Response:
        return error(
            f"internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 500
        )

    async def predict(request: Request) -> Response:
        started = time.perf_counter()
        content_type = request.headers.get("content-type", "").split(";")[0].strip()
        try:
            body = await rq.read_body(request, cfg.max_body_bytes)
            if content_type == rq.ARROW:
                rows = rq.arrow_rows(body, 8 * cfg.max_body_bytes)
                key = rq.request_key(request.headers.get("x-request-key") or request.query_params.get("key"))
            else:
                rows, key = rq.json_rows(body)
        except rq.BadRequest as err:
            metrics.rejected.labels(str(err.status)).inc()
            return error(str(err), err.status)
        variant = variants[cfg.split.choose(key)]
        alias, slot = variant.alias, variant.slot
        ids = servelog.new_ids(len(rows))
        try:
            rq.check_rows(rows, slot.model.columns)
            answer = await variant.batcher.predict(rows)
        except (rq.BadRequest, RowsRefused, ModelError) as err:
            status = getattr(err, "status", 422 if isinstance(err, RowsRefused) else 500)
            kind = "model" if status >= 500 else "input"
            metrics.errors.labels(alias, kind).inc()
            ms = (time.perf_counter() - started) * 1000
            servelog.predictions(ids, variant=alias, version=slot.version, key=key, latency_ms=ms, error=True)
            return error(str(err), status)
        seconds = time.perf_counter() - started
        servelog.predictions(
            ids, variant=alias, version=answer.version, key=key, latency_ms=seconds * 1000, error=False
        )
        metrics.requests.labels(alias).inc()
        metrics.rows.labels(alias).inc(len(rows))
        metrics.latency.labels(alias).observe(seconds)
        if content_type == rq.ARROW or rq.ARROW in request.headers.get("accept", ""):
            headers = {"x-variant": alias, "x-model-version": answer.version}
            return Response(rq.arrow_stream(ids, answer.outputs), media_type=rq.ARROW, headers=headers)
        return respond(
            {"predictions": answer.outputs, "ids": ids, "variant": alias, "version": answer.version}
        )

    async def outcome(request: Request) -> Response:
        try:
            id_, value = rq.outcome(await rq.read_body(request, cfg.max_body_bytes))
            servelog.outcome(id_, value)
        except (rq.BadRequest, OutcomeError) as err:
            metrics.rejected.labels(str(err.status)).inc()
            return error(str(err), err.status)
        metrics.outcomes.inc()
        return respond({"id": id_, "logged": True})

    async def prometheus(_: Request) -> Response:
        body, media_type = metrics.render()
        return Response(body, media_type=media_type)

    async def healthz(_: Request) -> Response:
        weights = dict(zip(cfg.split.aliases, cfg.split.weights, strict=True))
        served = {a: {"version": v.slot.version, "weight": weights[a]} for a, v in variants.items()}
        return respond({"status": "ok", "variants": served})

    # Plain Starlette routes: the handlers read the request themselves (no FastAPI validation,
    # whose 422s are lists, not one line), and skip the dependency machinery on the hot path.
    app.add_route("/predict", predict, methods=["POST"])
    app.add_route("/outcome", outcome, methods=["POST"])
    app.add_route("/metrics", prometheus, methods=["GET"])
    app.add_route("/healthz", healthz, methods=["GET"])
    return app
