"""The node agent's spans of one request (OpenTelemetry), kept beside its :class:`~.request.NodeRequest`.

A request on a node has up to three spans (:class:`~.request.Span`): the *main* one from acceptance
to its first stage's end (``node.prefill``, ``node.deflected_prefill`` or ``node.kv_transfer``, a
child of the dispatcher's or the prefill node's span through the message headers), the prefill
node's ``node.kv_handoff`` and the decode side's ``node.decode``. The state machine says when one
ends or starts (``EndSpan``/``StartDecode`` actions); this module holds the handles and builds them.
Attribute names: docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span as OtelSpan
from opentelemetry.trace import SpanKind

from kairos.contracts import subjects as S
from kairos.contracts.wire import Job, KvHandoff
from kairos.core.vocabulary import DEFLECT
from kairos.runtime import telemetry
from kairos.services.node_agent.request import NodeRequest, Span


@dataclass
class RequestSpans:
    """The spans of one request; the handles stay after a span ended (the main span is the parent
    of the others, and the trace every log line of the request names)."""

    main: OtelSpan | None = None
    handoff: OtelSpan | None = None
    decode: OtelSpan | None = None
    ended: set[Span] = field(default_factory=set)

    def get(self, which: Span) -> OtelSpan | None:
        return getattr(self, which.value)

    def is_open(self, which: Span) -> bool:
        return self.get(which) is not None and which not in self.ended

    def end(self, which: Span, status: str | None = None, attrs: Mapping[str, Any] | None = None) -> None:
        """End ``which`` if it is open (``attrs`` set first; ``status``: an error)."""
        span = self.get(which)
        if span is None or which in self.ended:
            return
        if attrs and span.is_recording():
            span.set_attributes(dict(attrs))
        telemetry.end_span(span, status)
        self.ended.add(which)

    @property
    def chunk_span(self) -> OtelSpan | None:
        """Where a deflected chunk's event goes: the prefill span, or — a real engine's last chunk
        record can arrive after the first token (separate channels) — the decode span once it runs."""
        return self.main if self.is_open(Span.MAIN) or self.decode is None else self.decode


def spans_of(r: NodeRequest | None) -> RequestSpans:
    """``r``'s spans (an empty holder for None or a request built without any)."""
    spans = r.spans if r is not None else None
    return spans if isinstance(spans, RequestSpans) else RequestSpans()


def job_span(tracer: Any, job: Job, node: str, role: str, headers: Mapping[str, str] | None) -> OtelSpan:
    """``node.prefill`` / ``node.deflected_prefill`` of a job this node accepted (consumer side of
    the dispatcher's job request)."""
    def attributes() -> dict[str, Any]:
        attrs = {telemetry.REQUEST_ID: job.request.request_id, "kairos.node": node, "kairos.role": role,
                 "kairos.prompt_tokens": job.request.prompt_tokens, "kairos.max_tokens": job.request.max_tokens,
                 "kairos.attempt": job.attempt, "kairos.dispatcher_id": job.dispatcher_id,
                 telemetry.MESSAGING_SYSTEM: "nats", telemetry.MESSAGING_DESTINATION: S.jobs_subject(node),
                 telemetry.MESSAGING_OPERATION_TYPE: "process"}
        if job.kind == DEFLECT:
            attrs["kairos.chunk_schedule"] = list(job.chunk_schedule)
            attrs["kairos.predicted_step_ms"] = list(job.predicted_step_ms)
        else:
            attrs["kairos.decode_candidates"] = list(job.decode_candidates)
        return attrs

    name = "node.deflected_prefill" if job.kind == DEFLECT else "node.prefill"
    return telemetry.start_span(tracer, name, attributes, context=telemetry.extract_context(headers),
                                kind=SpanKind.CONSUMER)


def kv_transfer_span(tracer: Any, h: KvHandoff, node: str, headers: Mapping[str, str] | None) -> OtelSpan:
    """``node.kv_transfer`` of a handoff this decode node accepted (consumer side of the prefill node's offer)."""
    return telemetry.start_span(tracer, "node.kv_transfer", lambda: {
        telemetry.REQUEST_ID: h.request.request_id, "kairos.src_node": h.src_node, "kairos.kv_tokens": h.kv_tokens,
        "kairos.node": node}, context=telemetry.extract_context(headers), kind=SpanKind.CONSUMER)


def handoff_span(tracer: Any, r: NodeRequest, parent: OtelSpan | None, transfer_est_ms: float) -> OtelSpan:
    """``node.kv_handoff`` (producer): the prefill node offering ``r``'s KV to its decode candidates."""
    return telemetry.start_span(tracer, "node.kv_handoff", lambda: {
        telemetry.REQUEST_ID: r.rid, "kairos.node": r.node, "kairos.kv_tokens": r.req.prompt_tokens,
        "kairos.decode_candidates": list(r.job.decode_candidates if r.job else []),
        "kairos.kv_transfer_est_ms": transfer_est_ms},
        context=trace.set_span_in_context(parent or trace.INVALID_SPAN), kind=SpanKind.PRODUCER)


def decode_span(tracer: Any, r: NodeRequest, parent: OtelSpan | None) -> OtelSpan:
    """``node.decode``: from the first token (deflect) or the KV's arrival (keep) to the last token."""
    return telemetry.start_span(tracer, "node.decode", lambda: {
        telemetry.REQUEST_ID: r.rid, "kairos.node": r.node, "kairos.path": r.role.path},
        context=trace.set_span_in_context(parent or trace.INVALID_SPAN))


def decode_summary(r: NodeRequest) -> dict[str, Any]:
    """Output tokens and TBT seen on this node (first token → last token): the decode span's end."""
    out: dict[str, Any] = {telemetry.GEN_AI_USAGE_OUTPUT_TOKENS: r.tokens, "kairos.completion_tokens": r.tokens,
                           "kairos.tbt_max_ms": round(r.tbt_max_ms, 3)}
    if r.tokens > 1 and r.first_token_ms is not None and r.last_token_ms is not None:
        out["kairos.tbt_mean_ms"] = round((r.last_token_ms - r.first_token_ms) / (r.tokens - 1), 3)
    return out
