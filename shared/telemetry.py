"""Tracing, logging and metrics setup shared by every service (issue #5 groundwork).

* **Traces**: one :class:`TracerProvider` per service (not the global one, so several services
  can run in one process in tests), configured from the standard ``OTEL_*`` variables (resource
  attributes, sampler). An OTLP/HTTP exporter is added only when ``OTEL_EXPORTER_OTLP_ENDPOINT``
  (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set; ``--trace-file`` / ``KAIROS_TRACE_FILE``
  adds a JSON-lines file exporter (one span per line, appended, several processes may share it).
* **Propagation**: W3C trace context in NATS message headers through the OpenTelemetry propagator
  API with a dict carrier (:func:`inject_headers`, :func:`extract_context`).
* **Logs**: structlog, JSON lines on stderr, contextvars merged (bind ``request_id``).
* **Metrics**: one prometheus ``CollectorRegistry`` per service; services without HTTP serve it
  with :func:`start_metrics_server` (aiohttp, ``GET /metrics``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import structlog
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line to ``path``."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json()), separators=(",", ":")) + "\n" for s in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write(lines)  # one write per batch: O_APPEND keeps processes' batches whole
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:  # nothing held open
        pass


def _otlp_configured(env: Mapping[str, str]) -> bool:
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def make_tracer_provider(service: str, trace_file: str | None = None,
                         env: Mapping[str, str] | None = None, extra_resource: Mapping[str, str] | None = None
                         ) -> TracerProvider:
    """A tracer provider for ``service`` (see module docstring for exporters)."""
    env = os.environ if env is None else env
    attrs = {"service.name": service, **(extra_resource or {})}
    provider = TracerProvider(resource=Resource.create(attrs))
    if _otlp_configured(env):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file), schedule_delay_millis=500))
    return provider


def inject_headers(context: Context | None = None, headers: dict[str, str] | None = None) -> dict[str, str]:
    """NATS headers carrying the W3C trace context of ``context`` (default: the current one)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by NATS message headers (empty context if none)."""
    return propagate.extract(dict(headers or {}))


_logging_configured = False


def setup_logging(level: str = "info") -> None:
    """structlog → JSON lines on stderr with ISO timestamps, level and contextvars (idempotent)."""
    global _logging_configured
    if _logging_configured:
        return
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _logging_configured = True


def get_logger(service: str, **bound) -> structlog.stdlib.BoundLogger:
    """A structlog logger with ``service`` (and anything in ``bound``) on every line."""
    return structlog.get_logger().bind(service=service, **bound)


@dataclass
class Telemetry:
    """What one service instance uses: its tracer, its metrics registry, its logger."""

    service: str
    provider: TracerProvider
    tracer: Tracer
    registry: CollectorRegistry
    log: structlog.stdlib.BoundLogger

    def shutdown(self) -> None:
        """Flush and stop span exporters."""
        self.provider.shutdown()


def setup(service: str, instance: str | None = None, trace_file: str | None = None,
          log_level: str = "info") -> Telemetry:
    """Telemetry for one service instance (``instance``: replica or node id)."""
    setup_logging(log_level)
    extra = {"service.instance.id": instance} if instance else {}
    provider = make_tracer_provider(service, trace_file, extra_resource=extra)
    log = get_logger(service, **({"instance": instance} if instance else {}))
    return Telemetry(service=service, provider=provider, tracer=provider.get_tracer(f"kairos.{service}"),
                     registry=CollectorRegistry(auto_describe=True), log=log)


def metrics_body(registry: CollectorRegistry) -> tuple[bytes, str]:
    """Prometheus exposition body and content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


async def start_metrics_server(registry: CollectorRegistry, host: str, port: int, health=None):
    """Serve ``GET /metrics`` (and ``GET /health``) with aiohttp; returns (runner, bound port).

    ``health``: optional zero-argument callable returning True when healthy.
    """
    from aiohttp import web

    async def metrics(_req: web.Request) -> web.Response:
        body, ctype = metrics_body(registry)
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def healthz(_req: web.Request) -> web.Response:
        ok = True if health is None else bool(health())
        return web.json_response({"status": "ok" if ok else "unhealthy"}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound
