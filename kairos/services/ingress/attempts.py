"""Publishing a request's attempts: the first, a re-submission, a migration's continuation.

One :class:`AttemptPublisher` per relay (:mod:`.relay`). Each attempt is a bus request id of its own
(``<id>``, ``<id>-r<n>`` after a re-submission, ``<id>-m<n>`` after a migration): its out events are
routed to the request's flight *before* it is published (:meth:`AttemptPublisher.submit`), and an
attempt answered with an error before any node took it is cancelled, and its arbiter sends no job
of it any more (:meth:`AttemptPublisher.refused`). :func:`bus_request` builds the message, with where a migrated
attempt resumes (issue 33).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import InferenceRequest, Resume, encode
from kairos.runtime import telemetry
from kairos.services.ingress.flights import Flight
from kairos.services.ingress.openai_api.params import ParsedRequest
from kairos.services.ingress.ports import EnqueueAbandoned, OutSubscription

if TYPE_CHECKING:  # the relay imports this module
    from kairos.services.ingress.relay import Admitted, RelayDeps


def bus_request(parsed: ParsedRequest, request_id: str, prompt_tokens: int, exact: bool, created_unix_ms: float,
                deadline_unix_ms: float, block_hashes: list[int] | None = None,
                block_tokens: int = 0, resume: Resume | None = None) -> InferenceRequest:
    """The :class:`InferenceRequest` the ingress publishes for one attempt of ``parsed``, with the
    prompt's prefix-cache ``block_hashes`` of ``block_tokens`` tokens each (kairos/core/cluster/prefix_index.py).
    With ``resume`` (a migration, issue 33) the engine continues after ``resume.output_tokens``: they
    count in the prompt the new node computes, and ``max_tokens`` is what is left of the original."""
    done = resume.output_tokens if resume is not None else 0
    return InferenceRequest(request_id=request_id, model=parsed.model, prompt_tokens=prompt_tokens + done,
                            max_tokens=parsed.max_tokens - done, prompt_tokens_exact=exact,
                            prompt_text=parsed.prompt_text, prompt_token_ids=parsed.prompt_token_ids,
                            created_unix_ms=created_unix_ms, deadline_unix_ms=deadline_unix_ms,
                            sampling=parsed.sampling, max_tokens_explicit=parsed.max_tokens_explicit,
                            block_hashes=block_hashes or [], block_hash_tokens=block_tokens if block_hashes else 0,
                            resume=resume)


class AttemptPublisher:
    """The attempts of one request (module docstring).

    Args:
        deps: what every relay of the ingress shares (bus, flights, config, clock, background tasks).
        req: the admitted request; ``flight`` its in-flight entry.
        deadline: the request's deadline (unix ms); ``hashes``: its prompt's prefix-cache block hashes.
    """

    def __init__(self, deps: "RelayDeps", req: "Admitted", flight: Flight, deadline: float,
                 hashes: list[int] | None) -> None:
        self.d, self.req, self.flight, self.deadline, self.hashes = deps, req, flight, deadline, hashes
        self.sub: OutSubscription | None = None
        self.resume: Resume | None = None  #: where the current attempt resumes (a migration), None: the start
        self.span: Any = None  #: the current attempt's ``ingress.attempt`` span (the nodes' spans are its children)
        self.count = 0  #: attempts submitted

    def _start_span(self, attempt_id: str, resume: Resume | None, left: Any) -> dict[str, str]:
        """End the previous attempt's span (``left``: the lifecycle's record of it, with why it moved)
        and start this one's, a child of the request's server span; the headers carry its context."""
        self._end_span(left)
        self.count += 1
        tracer = self.d.tracer
        if tracer is None:
            return telemetry.inject_headers()
        self.span = tracer.start_span("ingress.attempt", kind=SpanKind.PRODUCER, attributes={
            telemetry.REQUEST_ID: attempt_id, "kairos.attempt": self.count,
            "kairos.resume_output_tokens": resume.output_tokens if resume is not None else 0})
        return telemetry.inject_headers(trace.set_span_in_context(self.span))

    def _end_span(self, record: Any) -> None:
        """End the current attempt's span with what it did (``record``: a lifecycle ``Attempt``)."""
        if self.span is None:
            return
        if record is not None:
            self.span.set_attributes({"kairos.node": record.node or "", "kairos.output_tokens": record.output_tokens})
            if record.moved:
                self.span.set_attribute("kairos.moved", record.moved)
                self.span.set_status(Status(StatusCode.ERROR, f"moved: {record.moved}"))
        self.span.end()
        self.span = None

    async def submit(self, attempt_id: str, resume: Resume | None = None, left: Any = None) -> Exception | None:
        """Route ``attempt_id``'s events to this flight (the wildcard subscription, or a per-request
        one), then send it to the dispatchers (until one takes it). No flush in between: NATS processes one
        connection's SUB before its later PUB, so no token can be missed. ``left``: the lifecycle's
        record of the attempt this one replaces (its span ends with it). The error if it failed."""
        d, f, req = self.d, self.flight, self.req
        self.resume = resume
        d.flights.bind(f, attempt_id)
        old = self.sub
        try:
            if not d.cfg.out_wildcard:
                self.sub = await d.bus.subscribe_out(attempt_id, d.flights.on_out)
                if old is not None:
                    await old.unsubscribe()
            ireq = bus_request(req.parsed, attempt_id, req.prompt_tokens, req.exact, req.received, self.deadline,
                               self.hashes, d.cfg.prefix_block_tokens, resume)
            headers = self._start_span(attempt_id, resume, left)
            headers[S.NOTICES_HEADER] = d.bus.notice_subject(attempt_id)
            body = encode(ireq)
            if f.attempt_id == attempt_id:  # before it is sent: a dispatcher's job may come back before `taken`
                f.sent = (body, headers)
            sent = await d.bus.enqueue(body, headers, give_up=f.abandoned)
            if f.attempt_id == attempt_id:
                f.enqueued_at, f.deliveries = d.clock.monotonic(), sent
        except Exception as exc:  # logged; the caller answers 503 enqueue_failed (or the client is gone)
            if not isinstance(exc, EnqueueAbandoned):
                req.log.error("enqueue_failed", error=repr(exc), attempt_id=attempt_id)
            return exc
        return None

    async def refused(self, attempt_id: str, code: ErrorCode) -> None:
        """Attempt ``attempt_id`` was answered with error ``code`` before any node took it (a copy may
        still reach a dispatcher): its arbiter lets no job of it go from now on — every job goes
        through this ingress (kairos/services/ingress/jobrelay.py) — and the nodes are told to cancel it."""
        if self.flight.attempt_id == attempt_id:
            self.flight.arbiter.end()
        await self.d.bus.cancel(attempt_id, code)

    async def leave(self, last: Any = None) -> None:
        """The request ended (``last``: the lifecycle's record of its last attempt): that attempt's
        span ends; its per-request out subscription (``out_wildcard`` off) goes."""
        self._end_span(last)
        if self.sub is not None:
            await self.sub.unsubscribe()
