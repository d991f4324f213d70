"""The replica's intake of requests to route, and the handling of each (issue 34: no JetStream on the path).

Every replica subscribes to ``kairos.req.route`` in the queue group ``dispatchers``
(:data:`kairos.contracts.subjects.ROUTE_SUBJECT`): nats-server hands each request to one replica. The
replica answers :data:`~kairos.contracts.subjects.TAKEN` at once and routes the request in a task of
its own (:meth:`RequestIntake.handle`): decoded, checked against its deadline and the cancels, routed
(:class:`~kairos.services.dispatcher.route.Router`). While a routing waits (for a node, for room
here, before a retry) it sends ``alive`` to the attempt's notice subject (the ``Kairos-Notices``
header; its jobs go to the same subject, kairos/services/dispatcher/jobs.py) at least every
:data:`ALIVE_EVERY_S`: the ingress sends the request again — same bus id, so the attempt's arbiter
keeps it to one run — when no replica takes it or the one that took it goes silent before a node
accepted its job (kairos/services/ingress/liveness.py). A replica that dies mid-routing thus costs the
request that silence, as a redelivery after the ack wait did.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import nats.errors
from nats.aio.client import Client
from opentelemetry.trace import SpanKind

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import InferenceRequest, WireError, decode
from kairos.runtime import telemetry
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.resources import BackgroundTasks
from kairos.services.dispatcher import faults
from kairos.services.dispatcher.metrics import DispatcherMetrics
from kairos.services.dispatcher.outcome import Outcomes
from kairos.services.dispatcher.route import Router

#: a routing that waits tells the ingress it goes on at least this often (s)
ALIVE_EVERY_S = 0.5
#: a request that arrives this long after the ingress sent it (its ``Kairos-Sent-Unix-Ms``, ms) is
#: dropped unanswered: the ingress waited 0.5 s for a ``taken`` and sent another copy long ago (this
#: replica was frozen or cut off). The rest is the tolerated skew of the two wall clocks (NTP keeps
#: them within milliseconds; a larger skew would drop every request here: the heartbeat guard
#: assumes the same)
STALE_COPY_MS = 5000.0


class RouteMessage:
    """One request to route as the router sees it: its body, headers and delivery count, and
    :meth:`in_progress` (an ``alive`` notice to the ingress)."""

    def __init__(self, msg: Any, nc: Callable[[], Client], log: Any) -> None:
        self.data, self.headers, self.subject = msg.data, msg.headers or {}, msg.subject
        self._nc, self.log = nc, log
        self.notices = self.headers.get(S.NOTICES_HEADER)
        try:
            self.delivery = max(1, int(self.headers.get(S.DELIVERY_HEADER, "1")))
        except ValueError:
            self.delivery = 1

    async def in_progress(self) -> None:
        """Tell the request's ingress the routing goes on (never raises: a notice lost costs at most
        a second copy of the request, whose jobs meet the attempt's arbiter)."""
        if not self.notices:
            return
        try:
            await self._nc().publish(self.notices, S.ALIVE)
        except nats.errors.Error as exc:  # disconnected: the ingress may send the request again
            self.log.debug("alive_notice_failed", error=repr(exc))


class RequestIntake:
    """Takes requests from the queue group and routes each (see the module docstring).

    Args:
        nc: the replica's connection (a callable: opened after this is built).
        router: routes one request.
        outcomes: ends a request with an error when its routing fails.
        metrics: the replica's metrics.
        tracer: the replica's OpenTelemetry tracer (span ``dispatcher.decide`` per request).
        max_concurrency: requests routed at once; more wait here (sending ``alive``).
        log: the replica's logger.
        clock: wall clock (deadlines) and monotonic clock.
    """

    def __init__(self, nc: Callable[[], Client], router: Router, outcomes: Outcomes, metrics: DispatcherMetrics,
                 tracer: Any, *, max_concurrency: int, log: Any, clock: Clock = SYSTEM_CLOCK) -> None:
        self._nc, self.router, self.outcomes, self.m, self.tracer = nc, router, outcomes, metrics, tracer
        self.log, self.clock = log, clock
        self._sem = asyncio.Semaphore(max_concurrency)
        self.in_flight = BackgroundTasks(log)  #: one task per request being routed
        self.stopped = False

    async def on_request(self, msg: Any) -> None:
        """The ``kairos.req.route`` subscription: answer ``taken``, route in a task of its own."""
        if self.stopped:
            return  # not answered: the ingress sends it to another replica
        if self._stale(msg):
            self.m.stale_copies.inc()
            return
        try:
            await msg.respond(S.TAKEN)
        except nats.errors.Error as exc:  # no reply subject, or disconnected: the ingress sends it again
            self.log.debug("taken_answer_failed", error=repr(exc))
        if msg.headers and S.PING_HEADER in msg.headers:  # the ingress's /health: answered, nothing to route
            return
        self.in_flight.spawn(self.handle(RouteMessage(msg, self._nc, self.log)), "request routing")

    def _stale(self, msg: Any) -> bool:
        """Did ``msg`` arrive more than :data:`STALE_COPY_MS` after it was sent (its ingress sent
        another copy long ago)? A copy without a valid send time is not stale."""
        try:
            sent = float((msg.headers or {})[S.SENT_HEADER])
        except (KeyError, ValueError):
            return False
        return self.clock.now_ms() - sent > STALE_COPY_MS

    async def drain(self, timeout_s: float) -> None:
        """Take nothing more; let the requests being routed finish for up to ``timeout_s``, then
        cancel the rest (their ingress sends them again)."""
        self.stopped = True
        await self.in_flight.drain(timeout_s)

    async def _room(self, msg: RouteMessage) -> None:
        """A routing slot; the request's ingress hears ``alive`` while it waits for one."""
        while True:
            try:
                await asyncio.wait_for(self._sem.acquire(), ALIVE_EVERY_S)
                return
            except (asyncio.TimeoutError, TimeoutError):
                await msg.in_progress()

    async def handle(self, msg: RouteMessage) -> None:
        """Route the request in ``msg`` (see the module docstring)."""
        try:
            req = decode(msg.data, InferenceRequest)
        except WireError as exc:
            self.log.error("bad_request_message", error=str(exc))
            return
        await self._room(msg)
        try:
            await self._route(req, msg)
        finally:
            self._sem.release()

    async def _route(self, req: InferenceRequest, msg: RouteMessage) -> None:
        T, router, delivery = telemetry, self.router, msg.delivery
        if delivery > 1:
            self.m.redeliveries.inc()
        self.m.inflight.inc()
        with self.tracer.start_as_current_span("dispatcher.decide", context=T.extract_context(msg.headers),
                                               kind=SpanKind.CONSUMER) as span:
            if span.is_recording():  # attributes only for a span that is exported (issue 34)
                span.set_attributes({
                    T.REQUEST_ID: req.request_id, "kairos.replica_id": router.cfg.replica_id,
                    "kairos.policy": router.policy.spec, "kairos.model_version": router.model.artifact_version,
                    "kairos.prompt_tokens": req.prompt_tokens, "kairos.max_tokens": req.max_tokens,
                    T.GEN_AI_REQUEST_MODEL: req.model, T.GEN_AI_USAGE_INPUT_TOKENS: req.prompt_tokens,
                    T.GEN_AI_REQUEST_MAX_TOKENS: req.max_tokens, T.MESSAGING_SYSTEM: "nats",
                    T.MESSAGING_DESTINATION: msg.subject, T.MESSAGING_OPERATION_TYPE: "process",
                    T.MESSAGING_DELIVERY_COUNT: delivery, "kairos.delivery": delivery})
            log = self.log.bind(request_id=req.request_id, **T.trace_fields(span))
            try:
                if req.deadline_unix_ms <= self.clock.now_ms() or req.request_id in router.state.cancelled:
                    span.set_attribute("kairos.outcome", "expired")
                    self.m.expired.inc()
                    log.info("request_expired")  # the ingress has already answered (504 / client gone)
                    return
                faults.die("before_decide")
                try:
                    await router.route(req, msg, span, log)
                except Exception as exc:  # a bug or NATS gone for good: the client gets a 500, the log the error
                    log.error("routing_failed", error=repr(exc))
                    span.record_exception(exc)
                    await self.outcomes.error(req, ErrorCode.ROUTING_FAILED, f"dispatcher {router.cfg.replica_id} "
                                              "could not route the request (internal error)", span)
                faults.die("before_ack")
            finally:
                self.m.inflight.dec()
