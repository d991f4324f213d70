"""Tracing, logging and metrics helpers shared by every service (issue #5; docs/observability.md).

Where data goes:

* **Traces**: one :class:`TracerProvider` per service instance (not the global one, so several
  services can run in one process in tests), configured from the standard ``OTEL_*`` variables:
  resource attributes (``OTEL_RESOURCE_ATTRIBUTES``), sampler (``OTEL_TRACES_SAMPLER``), exporter
  choice (``OTEL_TRACES_EXPORTER``: ``otlp``, ``console``, ``none``; default ``otlp`` when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, else none),
  OTLP endpoint/headers/timeout (read by the OTLP/HTTP exporter itself). ``--trace-file`` /
  ``KAIROS_TRACE_FILE`` adds a JSON-lines file exporter (one span per line, appended; several
  processes may share the file) that :mod:`kairos.cli.trace` reads back. A provider with no
  exporter (no span processor) records no spans (:class:`ExportingTracerProvider`): building them
  for nobody cost ~0.3 ms of every request's time to first token (issue 12); their trace ids still
  reach the logs, the ``X-Trace-Id`` header and the propagated context.
* **Propagation**: W3C trace context in NATS message headers through the OpenTelemetry propagator
  API with a dict carrier (:func:`inject_headers`, :func:`extract_context`).
* **Logs**: structlog; JSON lines (orjson) on stderr, or a human-readable console format when
  stderr is a TTY. Every line carries ``service``/``instance``; lines about a request carry
  ``request_id`` and ``trace_id`` (:func:`add_trace_context` takes it from the current span,
  :func:`trace_fields` from a given one). Standard-library logging (nats, aiohttp, OTel exporters)
  goes through the same renderer.
* **Metrics**: one prometheus ``CollectorRegistry`` per service instance (plus process metrics);
  services without an HTTP server serve it with :func:`start_metrics_server` (``GET /metrics``).
  Durations are exported in seconds (:func:`seconds`), bucket sets are defined here.

No network I/O here beyond exporter setup and the small metrics server.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping, Sequence

import orjson
import structlog
from opentelemetry import propagate
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SpanExporter,
                                            SpanExportResult)
from opentelemetry.trace import Span, Tracer
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector,
                               ProcessCollector, generate_latest)

# --- attribute names (OTel semantic conventions where one exists, else the kairos. namespace) ---------

#: GenAI semantic conventions (opentelemetry-semantic-conventions ``gen_ai_attributes``)
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"  #: seconds
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
#: Messaging semantic conventions (NATS hops)
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_OPERATION_TYPE = "messaging.operation.type"
MESSAGING_DELIVERY_COUNT = "messaging.nats.delivery_count"  # no semconv attribute; nats-specific
#: Kairos' own
REQUEST_ID = "kairos.request_id"

# --- metric buckets (seconds unless noted) ----------------------------------------------------------
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6)
TBT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)  # τ=70 ms is an edge
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DECIDE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
ROUTING_BUCKETS = (5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)
STATE_AGE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
KV_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: signed relative error (measured − predicted) / predicted. Histograms with negative buckets
#: expose no ``_sum`` (OpenMetrics); the mean bias comes from the predicted/measured ``_sum`` pairs.
ERROR_RATIO_BUCKETS = (-0.5, -0.25, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
#: signed error in seconds (measured − predicted)
ERROR_SECONDS_BUCKETS = (-2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, 0.0, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                         2.0, 5.0)


def seconds(ms: float) -> float:
    """Milliseconds (the wire unit) → seconds (the Prometheus unit)."""
    return ms / 1000.0


# --- traces -------------------------------------------------------------------------------------------

def span_json(span: ReadableSpan) -> bytes:
    """One span as a JSON line: the OTel SDK's ``ReadableSpan.to_json`` fields (``name``,
    ``context.trace_id``/``span_id`` as ``0x…`` hex, ``kind``, ``parent_id``, ISO ``start_time``/
    ``end_time``, ``status``, ``attributes``, ``events``, ``links``, ``resource``) plus exact
    ``start_time_unix_nano``/``end_time_unix_nano``."""
    d = orjson.loads(span.to_json(indent=None))
    d["start_time_unix_nano"] = span.start_time
    d["end_time_unix_nano"] = span.end_time
    return orjson.dumps(d) + b"\n"


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line (:func:`span_json`) to ``path``."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = b"".join(span_json(s) for s in spans)
        try:
            with self._lock:
                fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    # one write(2) per batch with O_APPEND: concurrent processes' batches stay whole
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                finally:
                    os.close(fd)
        except OSError as exc:
            logging.getLogger("kairos.telemetry").warning("trace file %s not writable: %s", self._path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:  # nothing held open
        pass


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    """``OTEL_TRACES_EXPORTER`` (comma list), defaulting to ``otlp`` only if an endpoint is set."""
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if raw:
        return [x.strip() for x in raw.split(",") if x.strip() and x.strip() != "none"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return ["otlp"]
    return []


class _RecordWhenExported(Sampler):
    """``inner``'s decision (``OTEL_TRACES_SAMPLER``) once ``provider`` has a span processor;
    before that every span is dropped (not recorded; its context, ids included, still exists)."""

    def __init__(self, provider: "ExportingTracerProvider", inner: Sampler) -> None:
        self.provider, self.inner = provider, inner

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if not self.provider.exporting:
            return SamplingResult(Decision.DROP)
        return self.inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RecordWhenExported{{{self.inner.get_description()}}}"


class ExportingTracerProvider(TracerProvider):
    """The SDK's provider whose spans are recorded only once a span processor (an exporter, a
    test's in-memory one) has been added: a span nobody exports is not built (its attributes,
    events and end are the bulk of tracing's cost on the request path). A service configured
    with no exporter while the services before it export records nothing, and the trace shows
    the gap — give every service the same exporter settings (``kairos up`` and compose do)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exporting = False
        self.sampler = _RecordWhenExported(self, self.sampler)

    def add_span_processor(self, span_processor) -> None:
        super().add_span_processor(span_processor)
        self.exporting = True


def make_tracer_provider(service: str, trace_file: str | None = None,
                         env: Mapping[str, str] | None = None, extra_resource: Mapping[str, str] | None = None
                         ) -> TracerProvider:
    """A tracer provider for ``service`` (see the module docstring for the exporters)."""
    env = os.environ if env is None else env
    attrs = {"service.name": f"kairos-{service}", "service.namespace": "kairos", **(extra_resource or {})}
    # a long deflected prefill is hundreds of χ=128 chunks, one span event each (the SDK default keeps 128)
    limits = SpanLimits(max_events=int(env.get("OTEL_SPAN_EVENT_COUNT_LIMIT", "4096")))
    provider = ExportingTracerProvider(resource=Resource.create(attrs), span_limits=limits)
    log = logging.getLogger("kairos.telemetry")
    for name in _exporter_names(env):
        if name == "otlp":
            proto = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                     or "http/protobuf")
            if proto != "http/protobuf":
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported, exporting OTLP/HTTP protobuf "
                            "(point the endpoint at the collector's HTTP port, usually 4318)", proto)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
    if trace_file:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file), schedule_delay_millis=100))
    return provider


def inject_headers(context: Context | None = None, headers: dict[str, str] | None = None) -> dict[str, str]:
    """NATS headers carrying the W3C trace context of ``context`` (default: the current one)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The trace context carried by NATS (or HTTP) headers (empty context if none)."""
    return propagate.extract(dict(headers or {}))


def trace_id_of(span: Span | None) -> str | None:
    """The 32-hex-digit trace id of ``span`` (None if its context is invalid; an unsampled span
    still has one, so logs and headers stay consistent under sampling)."""
    if span is None:
        return None
    ctx = span.get_span_context()
    return trace_api.format_trace_id(ctx.trace_id) if ctx.is_valid else None


def trace_fields(span: Span | Context | None) -> dict[str, str]:
    """``{"trace_id", "span_id"}`` of a span (or of the span in a context) for a log line."""
    if span is None:
        return {}
    if not isinstance(span, Span):
        span = trace_api.get_current_span(span)
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": trace_api.format_trace_id(ctx.trace_id), "span_id": trace_api.format_span_id(ctx.span_id)}


def start_span(tracer: Any, name: str, attributes: Callable[[], Mapping[str, Any]], **kwargs: Any) -> Span:
    """``tracer.start_span(name, **kwargs)`` whose attributes — ``attributes()``, a dict — are built
    only when the span is recorded (an exporter is configured and the sampler keeps it): a request's
    attributes (a chunk schedule, a map per decode node) are work an unexported span would throw
    away (issue 34). Samplers see no attributes (``OTEL_TRACES_SAMPLER``'s ratio and parent-based
    samplers read none)."""
    span = tracer.start_span(name, **kwargs)
    if span.is_recording():
        span.set_attributes(attributes())
    return span


def end_span(span: Span | None, error: str | None = None) -> None:
    """End ``span`` if it is still recording (optionally as an error)."""
    if span is not None and span.is_recording():
        if error is not None:
            span.set_status(trace_api.Status(trace_api.StatusCode.ERROR, error))
        span.end()


# --- logs ---------------------------------------------------------------------------------------------

def add_trace_context(_logger: Any, _method: str, event_dict: dict) -> dict:
    """structlog processor: ``trace_id``/``span_id`` of the current span unless already bound."""
    if "trace_id" not in event_dict:
        event_dict.update(trace_fields(trace_api.get_current_span()))
    return event_dict


def _orjson_bytes(obj: Any, **_kw: Any) -> bytes:
    """orjson, and never an exception from a log call (odd keys/values become their repr)."""
    try:
        return orjson.dumps(obj, default=repr, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        import json

        return json.dumps(obj, default=repr, skipkeys=True, separators=(",", ":")).encode()


def _orjson_str(obj: Any, **_kw: Any) -> str:
    return _orjson_bytes(obj).decode()


_logging_configured = False


def configure_logging(level: str = "info", fmt: str = "auto", stream: IO | None = None) -> None:
    """Configure structlog (and route standard-library logging through it).

    ``fmt``: ``json`` (one orjson object per line), ``console`` (human-readable) or ``auto``
    (console when ``stream`` is a TTY). ``stream``: default ``sys.stderr``.
    """
    global _logging_configured
    stream = stream or sys.stderr
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format must be auto, json or console, got {fmt!r}")
    console = fmt == "console" or (fmt == "auto" and hasattr(stream, "isatty") and stream.isatty())
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True), add_trace_context]
    if console:
        renderer = structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
        structlog.configure(processors=[*shared, structlog.processors.StackInfoRenderer(), renderer],
                            wrapper_class=structlog.make_filtering_bound_logger(lvl),
                            logger_factory=structlog.PrintLoggerFactory(file=stream),
                            cache_logger_on_first_use=True)
        std_renderer: Any = renderer
    else:
        buf = getattr(stream, "buffer", None)
        if buf is not None:  # fast path: orjson bytes straight to the binary stream
            factory: Any = structlog.BytesLoggerFactory(file=buf)
            json_renderer = structlog.processors.JSONRenderer(serializer=_orjson_bytes)
        else:
            factory = structlog.PrintLoggerFactory(file=stream)
            json_renderer = structlog.processors.JSONRenderer(serializer=_orjson_str)
        structlog.configure(processors=[*shared, structlog.processors.format_exc_info, json_renderer],
                            wrapper_class=structlog.make_filtering_bound_logger(lvl),
                            logger_factory=factory, cache_logger_on_first_use=True)
        std_renderer = structlog.processors.JSONRenderer(serializer=_orjson_str)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, std_renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder(),
                           structlog.processors.format_exc_info]))
    handler._kairos = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in [h for h in root.handlers if getattr(h, "_kairos", False)]:
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))  # libraries (nats, aiohttp, otel): warnings and up
    _logging_configured = True


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    """:func:`configure_logging` once per process (several in-process services share it)."""
    if not _logging_configured:
        configure_logging(level, fmt)


def get_logger(service: str, **bound) -> structlog.stdlib.BoundLogger:
    """A structlog logger with ``service`` (and anything in ``bound``) on every line."""
    return structlog.get_logger().bind(service=service, **bound)


# --- metrics ------------------------------------------------------------------------------------------

def make_registry(process_metrics: bool = True) -> CollectorRegistry:
    """A registry for one service instance, with the standard process/platform/GC collectors."""
    reg = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
    return reg


def metric_names(registry: CollectorRegistry, prefix: str = "kairos_") -> dict[str, tuple[str, frozenset[str]]]:
    """Every sample name ``registry`` can expose starting with ``prefix`` → (family type, label names).

    Histograms give ``_bucket`` (with ``le``), ``_sum``, ``_count``; counters ``_total``. Works
    before any labelled child exists (for checking dashboards and docs against the code).
    """
    out: dict[str, tuple[str, frozenset[str]]] = {}
    collectors = list(getattr(registry, "_collector_to_names", {}))
    for c in collectors:
        for fam in (c.describe() if hasattr(c, "describe") else c.collect()):
            if not fam.name.startswith(prefix):
                continue
            labels = frozenset(getattr(c, "_labelnames", ()))
            if fam.type == "histogram":
                out[fam.name + "_bucket"] = (fam.type, labels | {"le"})
                out[fam.name + "_count"] = (fam.type, labels)
                if min(getattr(c, "_upper_bounds", [0.0])) >= 0:  # signed histograms expose no _sum
                    out[fam.name + "_sum"] = (fam.type, labels)
            elif fam.type == "counter":
                out[fam.name + "_total"] = (fam.type, labels)
            else:
                out[fam.name] = (fam.type, labels)
    return out


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


#: seconds :meth:`Telemetry.shutdown` waits for the span exporters (a service's whole stop stays within 5 s)
SHUTDOWN_TIMEOUT_S = 3.0


# --- one service instance -----------------------------------------------------------------------------

@dataclass
class Telemetry:
    """What one service instance uses: its tracer, its metrics registry, its logger."""

    service: str
    provider: TracerProvider
    tracer: Tracer
    registry: CollectorRegistry
    log: structlog.stdlib.BoundLogger

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Flush and stop span exporters, waiting at most ``timeout_s`` seconds.

        The OTLP exporter retries an unreachable collector with backoff for up to its own timeout
        (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s) per batch, and the SDK waits for it: a service
        stopping with its collector down took 17.8 s. The flush runs in a daemon thread instead;
        past ``timeout_s`` the spans still queued are abandoned (logged ``span_export_abandoned``)
        and the process may exit. Returns whether the flush finished in time.
        """
        done = threading.Event()

        def run() -> None:
            try:
                self.provider.shutdown()
            finally:
                done.set()

        threading.Thread(target=run, name=f"otel-shutdown-{self.service}", daemon=True).start()
        if done.wait(timeout_s):
            return True
        self.log.warning("span_export_abandoned", timeout_s=timeout_s,
                         message="the trace exporter did not finish in time (collector unreachable?)")
        return False


def setup(service: str, instance: str | None = None, trace_file: str | None = None,
          log_level: str = "info", log_format: str = "auto") -> Telemetry:
    """Telemetry for one service instance (``instance``: replica or node id)."""
    setup_logging(log_level, log_format)
    extra = {"service.instance.id": instance} if instance else {}
    provider = make_tracer_provider(service, trace_file, extra_resource=extra)
    log = get_logger(service, **({"instance": instance} if instance else {}))
    return Telemetry(service=service, provider=provider, tracer=provider.get_tracer(f"kairos.{service}"),
                     registry=make_registry(), log=log)
