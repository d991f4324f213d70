"""The replica's pull loops over the request lanes, and the handling of each pulled message.

Every replica pulls every request lane (``kairos_req_<i>``, :mod:`kairos.runtime.lanes`) through the
shared durable consumer, one message per pull, while it has room (``max_concurrency`` requests
routed at once, shared by all lanes). Each message is routed in a task of its own
(:meth:`LanePuller.handle`): decoded, checked against its deadline and the cancels, routed
(:class:`~kairos.services.dispatcher.route.Router`), then acknowledged — after the routing event and
the decision record left. A replica that dies before the ack leaves the message unacknowledged and
another replica gets it after ``ack_wait_s``; a routing that waits tells the server it is still in
progress. A lane that cannot be pulled (its member down, its consumer never declared) is declared
again every :data:`LANE_REDECLARE_S` until it answers; the other lanes go on meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import nats.errors
from nats.aio.client import Client
from opentelemetry.trace import SpanKind

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import InferenceRequest, WireError, decode
from kairos.runtime import telemetry
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.lanes import lane_of
from kairos.runtime.resources import BackgroundTasks
from kairos.services.dispatcher import faults
from kairos.services.dispatcher.metrics import DispatcherMetrics
from kairos.services.dispatcher.outcome import Outcomes
from kairos.services.dispatcher.route import Router

#: a request lane that cannot be pulled is declared again this often (s): its member came back
#: with an empty store, or was down when this replica started
LANE_REDECLARE_S = 2.0
#: how long one pull waits for a message (s)
FETCH_TIMEOUT_S = 1.0
#: pause after a failed pull (s)
FETCH_RETRY_S = 0.2


class LanePuller:
    """Pulls the request lanes and routes each message (see the module docstring).

    Args:
        nc: the replica's connection (a callable: opened after this is built).
        lanes: request lanes of the deployment.
        declare_lane: declares lane ``i`` again (its stream and the dispatchers' consumer).
        router: routes one request.
        outcomes: ends a request with an error when its routing fails.
        metrics: the replica's metrics.
        tracer: the replica's OpenTelemetry tracer (span ``dispatcher.decide`` per message).
        max_concurrency: requests routed at once.
        ack_wait_s: the consumer's ack wait (a message waiting for room is kept in progress at half of it).
        log: the replica's logger.
        clock: wall clock (deadlines) and monotonic clock.
        stop: set when the replica stops pulling.
    """

    def __init__(self, nc: Callable[[], Client], lanes: int, declare_lane: Callable[[int], Awaitable[None]],
                 router: Router, outcomes: Outcomes, metrics: DispatcherMetrics, tracer: Any, *,
                 max_concurrency: int, ack_wait_s: float, log: Any, clock: Clock = SYSTEM_CLOCK,
                 stop: asyncio.Event | None = None) -> None:
        self._nc, self.lanes, self._declare_lane = nc, lanes, declare_lane
        self.router, self.outcomes, self.m, self.tracer = router, outcomes, metrics, tracer
        self.ack_wait_s, self.log, self.clock = ack_wait_s, log, clock
        self.stop = stop or asyncio.Event()
        self._sem = asyncio.Semaphore(max_concurrency)
        self.in_flight = BackgroundTasks(log)  #: one task per request being routed

    async def pull(self, lane: int) -> None:
        """Pull request lane ``lane`` until :attr:`stop` is set (see the module docstring)."""
        sub, failing_since, declared_at = None, None, float("-inf")
        while not self.stop.is_set():
            await self._sem.acquire()
            self._sem.release()
            nc = self._nc()
            try:
                if sub is None:
                    sub = await nc.jetstream().pull_subscribe_bind(durable=S.DISPATCHER_CONSUMER,
                                                                   stream=S.request_stream(lane))
                # one message per pull: a lingering pull the server answers with the next request (a
                # batch pull costs an extra "no more messages" status per fetch, and requests arrive
                # one by one; under a backlog each pull still returns at once)
                msgs = await sub.fetch(batch=1, timeout=FETCH_TIMEOUT_S)
                failing_since = None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:  # disconnected (nats-py reconnects), or the lane's member is down
                if failing_since is None:
                    failing_since = self.clock.monotonic()
                    self.log.warning("fetch_failed", lane=lane, error=repr(exc))
                await self.clock.sleep(FETCH_RETRY_S)
                if self.clock.monotonic() - declared_at > LANE_REDECLARE_S and nc.is_connected:
                    declared_at = self.clock.monotonic()
                    await self._redeclare(lane)
                continue
            for m in msgs:
                await self._room_for(m)
                task = self.in_flight.spawn(self.handle(m), "request routing")
                task.add_done_callback(lambda _t: self._sem.release())

    async def _redeclare(self, lane: int) -> None:
        try:
            await asyncio.wait_for(self._declare_lane(lane), LANE_REDECLARE_S)
        except Exception as exc:  # its member is still down: the pull loop tries again in LANE_REDECLARE_S
            self.log.debug("lane_redeclare_failed", lane=lane, error=repr(exc))

    async def _room_for(self, msg: Any) -> None:
        """Wait for a free routing slot; every lane pulls, so a message may wait here: it must not
        pass its ack wait meanwhile."""
        while True:
            try:
                await asyncio.wait_for(self._sem.acquire(), self.ack_wait_s / 2)
                return
            except (asyncio.TimeoutError, TimeoutError):
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:  # disconnected: it is redelivered, and its claim keeps it to one run
                    self.log.debug("in_progress_failed", error=repr(exc))

    async def drain(self, timeout_s: float) -> None:
        """Let the requests being routed finish for up to ``timeout_s``, then cancel the rest (their
        messages are redelivered to another replica)."""
        await self.in_flight.drain(timeout_s)

    async def handle(self, msg: Any) -> None:
        """Route the request in ``msg`` and acknowledge the message (see the module docstring)."""
        try:
            req = decode(msg.data, InferenceRequest)
        except WireError as exc:
            self.log.error("bad_request_message", error=str(exc))
            await msg.term()
            return
        T = telemetry
        router = self.router
        lane = lane_of(msg.metadata.stream, self.lanes)
        delivery = msg.metadata.num_delivered
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
                    await msg.ack()
                    return
                faults.die("before_decide")
                try:
                    await router.route(req, msg, span, log, lane)
                except Exception as exc:  # a bug or NATS gone for good: the client gets a 500, the log the error
                    log.error("routing_failed", error=repr(exc))
                    span.record_exception(exc)
                    # the client sees no exception name; the log line above has it, with the request id
                    await self.outcomes.error(req, ErrorCode.ROUTING_FAILED, f"dispatcher {router.cfg.replica_id} "
                                              "could not route the request (internal error)", span)
                faults.die("before_ack")
                await msg.ack()
            finally:
                self.m.inflight.dec()
