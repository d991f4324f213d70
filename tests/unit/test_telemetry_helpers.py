"""kairos.runtime.telemetry: exporter choice from OTEL_* variables, the span file, W3C propagation through
header dicts, and log lines (JSON with request and trace ids; console on a TTY)."""

from __future__ import annotations

import io
import json

import orjson
import pytest
import structlog
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import set_span_in_context

from kairos.runtime import telemetry
from kairos.cli.trace import parse_span


def _exporters(provider) -> list[str]:
    procs = provider._active_span_processor._span_processors  # SDK internals, fine in a test
    return [type(p.span_exporter).__name__ if hasattr(p, "span_exporter") else type(p._batch_processor._exporter).__name__
            for p in procs if isinstance(p, BatchSpanProcessor)]


@pytest.mark.parametrize("env,trace_file,want", [
    ({}, None, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}, None, ["OTLPSpanExporter"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/v1/traces"}, None, ["OTLPSpanExporter"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318", "OTEL_TRACES_EXPORTER": "none"}, None, []),
    ({"OTEL_TRACES_EXPORTER": "console"}, "x.jsonl", ["ConsoleSpanExporter", "JsonLinesSpanExporter"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, None, ["OTLPSpanExporter", "ConsoleSpanExporter"]),
], ids=["nothing", "endpoint", "traces-endpoint", "none-wins", "console+file", "list"])
def test_exporters_follow_otel_variables(env, trace_file, want, tmp_path):
    p = telemetry.make_tracer_provider("dispatcher", str(tmp_path / trace_file) if trace_file else None, env=env,
                                       extra_resource={"service.instance.id": "dispatcher-3"})
    try:
        assert _exporters(p) == want
        assert p.resource.attributes["service.name"] == "kairos-dispatcher"
        assert p.resource.attributes["service.instance.id"] == "dispatcher-3"
    finally:
        p.shutdown()


def test_span_file_lines_parse_back_with_events_and_parent(tmp_path):
    path = tmp_path / "spans.jsonl"
    p = telemetry.make_tracer_provider("node_agent", str(path), env={})
    tracer = p.get_tracer("t")
    with tracer.start_as_current_span("parent", attributes={"kairos.request_id": "cmpl-1"}) as parent:
        child = tracer.start_span("child", context=set_span_in_context(parent))
        for i in range(200):  # more than the SDK's default 128 events per span
            child.add_event("chunk", {"chi": i})
        child.end()
    p.shutdown()  # flushes
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    spans = {s.name: s for s in map(parse_span, rows)}
    assert spans["child"].parent_id == spans["parent"].span_id and spans["child"].trace_id == spans["parent"].trace_id
    assert len(spans["child"].events) == 200
    assert spans["parent"].service == "kairos-node_agent" and spans["parent"].duration_ns > 0
    assert rows[0]["end_time_unix_nano"] >= rows[0]["start_time_unix_nano"]


def test_spans_are_recorded_only_once_something_exports_them(monkeypatch):
    """No exporter: spans are not built (their ids still exist for logs, headers and propagation);
    a span processor added later (a test's, an operator's) turns recording on, and the sampler
    from OTEL_TRACES_SAMPLER still decides then."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    p = telemetry.make_tracer_provider("ingress", env={})
    tracer = p.get_tracer("t")
    with tracer.start_as_current_span("nobody exports this", attributes={"k": 1}) as span:
        assert not span.is_recording()
        assert telemetry.trace_id_of(span) is not None and "traceparent" in telemetry.inject_headers()
    exported = InMemorySpanExporter()
    p.add_span_processor(SimpleSpanProcessor(exported))
    with tracer.start_as_current_span("exported") as span:
        assert span.is_recording()
    assert [s.name for s in exported.get_finished_spans()] == ["exported"]
    p.shutdown()

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    p = telemetry.make_tracer_provider("ingress", env={})
    p.add_span_processor(SimpleSpanProcessor(exported))
    with p.get_tracer("t").start_as_current_span("sampled out") as span:
        assert not span.is_recording()
    p.shutdown()


def test_w3c_context_round_trips_through_a_header_dict():
    p = telemetry.make_tracer_provider("ingress", env={})
    with p.get_tracer("t").start_as_current_span("s") as s:
        headers = telemetry.inject_headers(headers={"Nats-Msg-Id": "cmpl-1"})
    assert headers["Nats-Msg-Id"] == "cmpl-1" and headers["traceparent"].startswith("00-")
    ctx = telemetry.extract_context(headers)
    assert telemetry.trace_fields(ctx) == telemetry.trace_fields(s)
    assert telemetry.trace_fields(telemetry.extract_context({})) == {}
    p.shutdown()


@pytest.fixture()
def restore_logging():
    yield
    import sys
    telemetry.configure_logging("info", "json", stream=sys.stderr)


def test_json_log_lines_carry_request_and_trace_id(restore_logging):
    buf = io.StringIO()
    telemetry.configure_logging("info", "json", stream=buf)
    p = telemetry.make_tracer_provider("ingress", env={})
    log = telemetry.get_logger("ingress", instance="ingress-0")
    with p.get_tracer("t").start_as_current_span("s") as s:
        log.info("request_finished", request_id="cmpl-1", status=200, weird={1: object()})
    log.debug("hidden")
    import logging
    logging.getLogger("nats.aio.client").warning("library says %s", "hi")  # stdlib logging: same format
    lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert first["event"] == "request_finished" and first["request_id"] == "cmpl-1"
    assert first["trace_id"] == telemetry.trace_id_of(s) and first["service"] == "ingress"
    assert first["level"] == "info" and first["timestamp"].endswith("Z")
    assert lines[1]["event"] == "library says hi" and lines[1]["level"] == "warning"
    p.shutdown()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_format_on_a_tty(restore_logging):
    buf = _Tty()
    telemetry.configure_logging("info", "auto", stream=buf)
    structlog.get_logger().bind(service="dispatcher").info("request_routed", request_id="cmpl-9")
    out = buf.getvalue()
    assert "request_routed" in out and "cmpl-9" in out
    with pytest.raises(ValueError):
        json.loads(out.splitlines()[0])
    with pytest.raises(ValueError):
        telemetry.configure_logging("info", "xml")


def test_otlp_http_export_reaches_a_collector(monkeypatch):
    """OTEL_EXPORTER_OTLP_ENDPOINT alone is enough: spans arrive at <endpoint>/v1/traces (Jaeger's
    OTLP/HTTP receiver speaks the same protocol), with the service resource."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server API)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        p = telemetry.make_tracer_provider("dispatcher", extra_resource={"service.instance.id": "dispatcher-0"})
        with p.get_tracer("t").start_as_current_span("dispatcher.decide", attributes={"kairos.decision": "keep"}):
            pass
        p.shutdown()  # flushes the batch
    finally:
        server.shutdown()
    assert [path for path, _ in got] == ["/v1/traces"]
    req = ExportTraceServiceRequest.FromString(got[0][1])
    rs = req.resource_spans[0]
    res = {a.key: a.value.string_value for a in rs.resource.attributes}
    assert res["service.name"] == "kairos-dispatcher" and res["service.instance.id"] == "dispatcher-0"
    span = rs.scope_spans[0].spans[0]
    assert span.name == "dispatcher.decide"
    assert {a.key: a.value.string_value for a in span.attributes} == {"kairos.decision": "keep"}


def test_start_span_builds_attributes_only_for_a_recorded_span():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    calls = []

    def attrs() -> dict:
        calls.append(1)
        return {"kairos.node": "decode-0"}

    provider = telemetry.make_tracer_provider("t", env={})  # no exporter: nothing is recorded
    span = telemetry.start_span(provider.get_tracer("t"), "node.decode", attrs)
    span.end()
    assert not span.is_recording() and calls == []
    exported = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    telemetry.start_span(provider.get_tracer("t"), "node.decode", attrs).end()
    assert calls == [1]
    assert [dict(s.attributes) for s in exported.get_finished_spans()] == [{"kairos.node": "decode-0"}]
