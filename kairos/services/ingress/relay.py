"""The relay of one request: submit it to the dispatchers, follow its events, answer the client.

One :class:`RequestRelay` per admitted completion request (:mod:`.completions` admits it). It
routes the request's out events to itself (:class:`~.flights.Flights`, or with
``out_wildcard=False`` a subscription per attempt) *before* publishing it (no token can be missed:
NATS processes one connection's SUB before its later PUB), publishes the
:class:`~kairos.contracts.wire.InferenceRequest` to the dispatchers with the W3C trace context in
its headers, then reads its queue: out events of its attempt (tokens, done, errors) and the
watchers' verdicts (:mod:`.liveness`: node lost, stream interrupted, bus down, client gone,
shutdown). Each goes to its :class:`~.lifecycle.RequestLifecycle` — the pure state machine that
decides — and the :data:`~.lifecycle.Action` it returns is carried out here, dispatched on its type:

* ``Relay`` — tokens: TTFT/TBT observed, handed to the client's :class:`~.answer.ClientAnswer`
  (an SSE stream opened at the first token, so an error before it still gets a proper 4xx/5xx
  status; one write per burst; or kept for the non-streaming answer);
* ``Ignore`` — dropped (counted by reason in ``kairos_ingress_dropped_events_total``);
* ``Resubmit`` — the old attempt cancelled on the nodes, its partial output forgotten, the request
  published again as ``<id>-r<n>``;
* ``Migrate`` — tokens had reached the client: the old attempt cancelled, the request continued on
  another node as ``<id>-m<n>`` after the tokens sent (``InferenceRequest.resume``), the stream kept
  open (issue 33);
* ``Fail`` — the nodes told to stop, the client an OpenAI error body with the code's status (or an
  SSE error event mid-stream); a client that left gets nothing (499 in the record);
* ``Complete`` — the final chunk / the full response with usage.

Everything it sends goes through :class:`~.ports.IngressBus` and its time comes from a
:class:`~kairos.runtime.clock.Clock`, so a unit test drives it with a fake bus.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, ClassVar

from aiohttp import web

from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent
from kairos.contracts.wire import Resume
from kairos.core.cluster.prefix_index import request_block_hashes
from kairos.runtime import telemetry
from kairos.runtime.clock import Clock
from kairos.runtime.resources import BackgroundTasks
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.answer import ClientAnswer, Outcome
from kairos.services.ingress.attempts import AttemptPublisher
from kairos.services.ingress.flights import BusDown, ClientGone, Flight, Flights, Interrupted, NodeLost, Shutdown
from kairos.services.ingress.http import clip, error_response
from kairos.services.ingress.lifecycle import (Action, Complete, Fail, Ignore, Migrate, Relay, RequestLifecycle,
                                               Resubmit)
from kairos.services.ingress.metrics import DROP_REASONS, IngressMetrics
from kairos.services.ingress.openai_api.params import ParsedRequest
from kairos.services.ingress.ports import EnqueueAbandoned, IngressBus, NoDispatcher
from kairos.services.ingress.records import PREDICTED, ingress_timing, store_ingress_record
from kairos.services.ingress.reorder import Reorder
from kairos.services.ingress.request_ids import RequestIds


@dataclass(frozen=True)
class RelayDeps:
    """What every relay of one ingress shares: its configuration, in-flight registry, bus, metrics,
    background tasks (tombstones), clocks and tracer."""

    cfg: IngressConfig
    flights: Flights
    bus: IngressBus
    metrics: IngressMetrics
    bg: BackgroundTasks
    clock: Clock
    tracer: Any = None  #: the ingress's tracer: one ``ingress.attempt`` span per attempt (None: none)


@dataclass
class Admitted:
    """One admitted request: the client's HTTP request, its validated body, its ids (``ids.internal``
    is ``rid``, the first attempt's bus id; ``ids.response`` the ``id`` the client sees), ``created``
    (unix s), its prompt tokens (``exact``: counted by a tokenizer), when it was received (unix ms),
    its timing dict (the ingress record, filled as it goes), its bound logger and trace id."""

    request: web.Request
    parsed: ParsedRequest
    ids: RequestIds
    created: int
    prompt_tokens: int
    exact: bool
    received: float
    timing: dict
    log: Any
    trace_id: str | None = None

    @property
    def rid(self) -> str:
        """Kairos' id of the request (unique; the first attempt's bus id, its records' key)."""
        return self.ids.internal

    def headers(self) -> dict[str, str]:
        """The response headers naming the request (:meth:`RequestIds.headers`, ``X-Trace-Id``)."""
        out = self.ids.headers()
        if self.trace_id:
            out["X-Trace-Id"] = self.trace_id
        return out


def not_sent(exc: Exception | None) -> str:
    """Why an attempt could not be sent, for its client: no dispatcher took it (the bus answered:
    :class:`~.ports.NoDispatcher`), or the message bus is unavailable (disconnected, a frozen server)."""
    return str(exc) if isinstance(exc, NoDispatcher) else "the message bus is unavailable"


class RequestRelay:
    """Serves one admitted request until it completes or ends with an explicit error (module docstring).
    ``answer``: what it answers through, made from its commit callback (a sub-request of a fanned-out
    request: :mod:`.fanout`); None: the client's :class:`~.answer.ClientAnswer`."""

    def __init__(self, deps: RelayDeps, req: Admitted, answer: Callable[[Callable[[], None]], Any] | None = None) -> None:
        self.d, self.req, self.cfg, self.clock = deps, req, deps.cfg, deps.clock
        self.lc = RequestLifecycle(rid=req.rid, max_resubmits=self.cfg.max_resubmits,
                                   max_migrations=self.cfg.max_migrations, max_tokens=req.parsed.max_tokens)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.flight = Flight(lc=self.lc, queue=self.queue, request=req.request)
        self.answer = (answer(self.lc.committed_to_client) if answer is not None else
                       ClientAnswer(req.request, req.parsed, req.ids.response, req.created, req.headers(),
                                    self.lc.committed_to_client))
        self.deadline = req.received + self.cfg.request_timeout_s * 1000.0  #: unix ms
        self.attempts = AttemptPublisher(deps, req, self.flight, self.deadline,
                                         request_block_hashes(req.parsed.prompt_token_ids, req.parsed.prompt_text,
                                                              self.cfg.prefix_block_tokens))
        self.reorder = Reorder(clock=self.clock.monotonic)  # events ahead of a gap wait a moment (reorder.py)
        self.last_token_ms = 0.0
        self.first = True  #: no token of the current attempt accepted before the event being handled
        self.time_left = True  #: the request's deadline is still ahead

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self) -> Outcome:
        """Submit, then carry out what the lifecycle says about every event until the request ends."""
        try:
            if (out := await self._submit_first()) is not None:
                return out
            while True:
                ev = await self._next_event()
                self.time_left = self.deadline > self.clock.now_ms()
                self.first = self.lc.total == 0  # the request's first token (not a migrated attempt's)
                action = self._on_timeout() if ev is None else self._EVENTS[type(ev)](self, ev)
                if action is None:
                    continue
                out = await self._ACTIONS[type(action)](self, action, ev)
                if out is not None:
                    return out
        finally:
            await self._leave()

    async def _sent(self, exc: Exception | None, attempt_id: str) -> bool:
        """Did attempt ``attempt_id``'s submission (``exc``: its error) leave nothing to answer here?
        Yes when it went out, or when it was abandoned — the client left or the ingress closes, and
        that event, queued, ends the request (the attempt is cancelled: it may still reach a
        dispatcher)."""
        if isinstance(exc, EnqueueAbandoned):
            await self.attempts.refused(attempt_id, ErrorCode.ENQUEUE_FAILED)
            return True
        return exc is None

    async def _submit_first(self) -> Outcome | None:
        exc = await self.attempts.submit(self.req.rid)
        if await self._sent(exc, self.req.rid):
            return None
        timing = self.req.timing
        timing["error"] = ErrorCode.ENQUEUE_FAILED
        timing["error_message"] = f"could not enqueue the request ({not_sent(exc)})"
        # a copy may still reach a dispatcher: its job goes nowhere (the attempt's arbiter), and the
        # client's retry is the only execution
        await self.attempts.refused(self.req.rid, ErrorCode.ENQUEUE_FAILED)
        return error_response(ErrorCode.ENQUEUE_FAILED, f"could not enqueue the request ({not_sent(exc)}); retry"), 503

    async def _next_event(self) -> Any:
        """The next event to handle: a held one whose gap was filled (or waited enough), one already
        queued, or the next to arrive; None when the idle or request timeout passed first."""
        while True:
            if (held := self.reorder.ready(self.lc.received)) is not None:
                return held
            if not self.queue.empty():  # already here (a burst of token events): no timer, no task
                return self.queue.get_nowait()
            left = min(self.cfg.idle_timeout_s, (self.deadline - self.clock.now_ms()) / 1000.0)
            if left <= 0:
                return None
            hold_left = self.reorder.time_left()
            try:  # not wait_for: no task and no extra loop turn per event
                async with asyncio.timeout(left if hold_left is None else min(left, hold_left + 0.001)):
                    return await self.queue.get()
            except TimeoutError:
                if hold_left is None or hold_left >= left:
                    return None
                # the gap's wait ran out: the next round hands the held events on

    async def _leave(self) -> None:
        """The request ended: nothing more reaches it; its prediction goes to its record."""
        if self.flight.predicted is not None:
            self.req.timing[PREDICTED] = self.flight.predicted
        self.d.flights.refuse_held(self.flight)
        self.d.flights.forget(self.flight)
        await self.attempts.leave(self.lc.attempt_record())

    # -- events: each to the lifecycle, which returns the action (None: nothing to do) -------------
    def _on_timeout(self) -> Action:
        action = self.lc.on_timeout(before_first_token=self.first)
        self.req.log.warning("request_timeout_before_first_token" if self.first else "request_timeout_mid_stream",
                             completion_tokens=self.lc.received)
        return action

    def _on_client_gone(self, _ev: ClientGone) -> Action:
        return self.lc.on_client_gone()

    def _on_shutdown(self, _ev: Shutdown) -> Action:
        action = self.lc.on_shutdown()
        self.req.log.warning("request_ended_by_shutdown", tokens_sent=self.answer.sent)
        return action

    def _on_bus_down(self, ev: BusDown) -> Action:
        action = self.lc.on_bus_unavailable(ev.outage_s)
        self.d.metrics.bus_down.inc()
        self.req.log.warning("request_ended_bus_unavailable", outage_s=round(ev.outage_s, 3), tokens_sent=self.answer.sent)
        return action

    def _on_node_lost(self, ev: NodeLost) -> Action | None:
        if ev.attempt_id != self.lc.attempt_id:
            return None
        action = self.lc.on_node_dead(ev.node, self.time_left)
        if isinstance(action, Ignore):
            self.flight.lost = False  # it moved on meanwhile (e.g. the handoff node took over)
        else:
            self.d.metrics.node_lost.labels("resubmitted" if isinstance(action, Resubmit) else
                                            "migrated" if isinstance(action, Migrate) else "failed").inc()
        return action

    def _on_interrupted(self, ev: Interrupted) -> Action | None:
        if ev.attempt_id != self.lc.attempt_id:
            return None
        return self.lc.interrupted(ev.detail, self.time_left)

    def _on_token(self, ev: TokenEvent) -> Action | None:
        if self.reorder.hold(ev, self.lc.attempt_id, self.lc.received):
            return None
        return self.lc.on_token(ev, self.time_left)

    def _on_done(self, ev: DoneEvent) -> Action | None:
        if self.reorder.hold(ev, self.lc.attempt_id, self.lc.received):
            return None
        return self.lc.on_done(ev, self.time_left)

    def _on_error(self, ev: ErrorEvent) -> Action:
        return self.lc.on_error(ev, self.time_left)

    _EVENTS: ClassVar[dict[type, Callable[..., Action | None]]] = {
        TokenEvent: _on_token, DoneEvent: _on_done, ErrorEvent: _on_error, NodeLost: _on_node_lost,
        Interrupted: _on_interrupted, BusDown: _on_bus_down, ClientGone: _on_client_gone, Shutdown: _on_shutdown}

    # -- actions: what the lifecycle decided, carried out (an Outcome ends the request) ------------
    async def _relay(self, action: Relay, _ev: Any) -> Outcome | None:
        tok, m, timing = action.event, self.d.metrics, self.req.timing
        t = self.clock.now_ms()
        gap_ms = t - (self.req.received if self.first else self.last_token_ms)  # a TTFT, else an inter-token gap
        if self.first:
            timing["first_token_unix_ms"] = t
            m.ttft.observe(telemetry.seconds(gap_ms))
        else:  # TBT per token: a k-token event spreads its gap over k tokens
            per_token = telemetry.seconds(gap_ms) / max(1, tok.count)
            for _ in range(max(1, tok.count)):
                m.tbt.observe(per_token)
        m.vllm.tokens(self.first, gap_ms, tok.count, self.req.prompt_tokens)
        self.last_token_ms = t
        if not await self.answer.tokens(tok, self.first, self.queue.empty):
            return await self._gone()
        return None

    async def _ignore(self, action: Ignore, ev: Any) -> None:
        if action.reason in DROP_REASONS:
            self.d.metrics.dropped.labels(action.reason).inc()
            if action.reason == "foreign_node":
                self.req.log.warning("foreign_node_event_dropped", node=getattr(ev, "node", None))
            elif action.reason == "routed_elsewhere":
                self.req.log.info("duplicate_routing_error_dropped", code=getattr(ev, "code", None),
                                  source=getattr(ev, "source", None))

    async def _resubmit(self, action: Resubmit, _ev: Any) -> Outcome | None:
        if action.why.startswith("stream_interrupted"):
            self.d.metrics.interrupted.labels("resubmitted").inc()
        await self.d.bus.cancel(action.old_attempt_id, "resubmitted")  # frees what other nodes hold for it
        self.req.log.warning("request_resubmitted", why=action.why, lost_attempt=action.old_attempt_id,
                             attempt_id=action.new_attempt_id, discarded_tokens=len(self.answer.text_parts))
        timing = self.req.timing
        timing.setdefault("resubmitted_as", []).append(action.new_attempt_id)
        timing["attempts"] = self._attempts()
        self.answer.discard()
        self.reorder.clear()
        timing.pop("first_token_unix_ms", None)
        exc = await self.attempts.submit(action.new_attempt_id, left=self.lc.attempts[-1])
        if await self._sent(exc, action.new_attempt_id):
            return None
        timing["error"] = ErrorCode.ENQUEUE_FAILED
        await self.attempts.refused(action.new_attempt_id, ErrorCode.ENQUEUE_FAILED)
        return error_response(ErrorCode.ENQUEUE_FAILED, f"request {self.req.rid} lost its node or stream "
                                                        f"({action.why}) and could not be re-submitted "
                                                        f"({not_sent(exc)}); retry"), 503

    async def _migrate(self, action: Migrate, _ev: Any) -> Outcome | None:
        """Continue the request on another node after the tokens the client has (issue 33): the old
        attempt cancelled, the new one published with where to resume; the client's stream stays open."""
        self.d.metrics.migrations[action.why.split(":", 1)[0]].inc()
        await self.d.bus.cancel(action.old_attempt_id, "migrated")
        self.req.log.warning("request_migrated", why=action.why, lost_attempt=action.old_attempt_id,
                             attempt_id=action.new_attempt_id, output_tokens=action.output_tokens,
                             migrations=self.lc.migrations)
        timing = self.req.timing
        timing.setdefault("resubmitted_as", []).append(action.new_attempt_id)
        timing["attempts"] = self._attempts()
        # GET /v1/requests/{id} shows the attempts while the stream goes on (one write per migration)
        self.d.bg.spawn(store_ingress_record(self.d.bus, self.req.rid, ingress_timing(timing), self.req.log),
                        "write_ingress_record")
        self.reorder.clear()
        resume = (Resume(output_tokens=action.output_tokens, output_text=action.output_text,
                         output_token_ids=action.output_token_ids) if action.output_tokens else None)
        exc = await self.attempts.submit(action.new_attempt_id, resume, left=self.lc.attempts[-1])
        if await self._sent(exc, action.new_attempt_id):
            return None
        timing["error"] = ErrorCode.ENQUEUE_FAILED
        await self.attempts.refused(action.new_attempt_id, ErrorCode.ENQUEUE_FAILED)
        return await self._error_answer(503, ErrorCode.ENQUEUE_FAILED,
                                        f"request {self.req.rid} lost its node ({action.why}) and could not be "
                                        f"moved ({not_sent(exc)})")

    async def _fail(self, action: Fail, ev: Any) -> Outcome:
        if action.code == ErrorCode.CLIENT_DISCONNECTED:
            return await self._client_gone()
        if action.code == ErrorCode.STREAM_INTERRUPTED:
            self.d.metrics.interrupted.labels("failed").inc()
        if action.cancel:
            await self.d.bus.cancel(action.attempt_id, action.code)
        log = self.req.log
        if action.code in (ErrorCode.NODE_LOST, ErrorCode.STREAM_INTERRUPTED):
            log.warning("request_lost", code=action.code, message=action.message, tokens_sent=self.answer.sent)
        elif isinstance(ev, ErrorEvent):
            log.warning("request_failed" if self.answer.resp is None else "request_failed_mid_stream", code=ev.code,
                        message=ev.message, source=ev.source)
        return await self._error_answer(action.status, action.code, action.message)

    async def _complete(self, action: Complete, _ev: Any) -> Outcome:
        timing = self.req.timing
        timing["finish_reason"], timing["cached_tokens"] = action.finish_reason, action.cached_tokens
        completion = action.completion_tokens
        if self.lc.attempts:
            timing["attempts"] = self._attempts(current=True)
        timing["finished_unix_ms"] = self.clock.now_ms()
        timing["completion_tokens"] = completion
        self.d.metrics.e2e.observe(telemetry.seconds(timing["finished_unix_ms"] - self.req.received))
        if not self.req.parsed.stream:
            self.lc.committed_to_client()
        return await self.answer.complete(action.finish_reason, self.req.prompt_tokens, completion,
                                          action.cached_tokens, action.stop_reason)

    _ACTIONS: ClassVar[dict[type, Callable[..., Awaitable[Outcome | None]]]] = {
        Relay: _relay, Ignore: _ignore, Resubmit: _resubmit, Migrate: _migrate, Fail: _fail, Complete: _complete}

    def _attempts(self, current: bool = False) -> list[dict]:
        """The attempts left so far (and, with ``current``, the one that ends the request), as the
        ingress record lists them (``IngressTiming.attempts``)."""
        listed = self.lc.attempts and self.lc.attempts[-1].attempt_id == self.lc.attempt_id  # it ended moved
        done = [*self.lc.attempts, self.lc.attempt_record()] if current and not listed else self.lc.attempts
        return [dataclasses.asdict(a) for a in done]

    # -- the client's answer when the request ends with an error ----------------------------------
    async def _gone(self) -> Outcome:
        """A write found the client gone."""
        self.lc.on_client_gone()
        return await self._client_gone()

    async def _client_gone(self) -> Outcome:
        """The client closed its connection: cancel on the nodes, record 499 and the tokens it got."""
        timing, parsed = self.req.timing, self.req.parsed
        timing["error"] = ErrorCode.CLIENT_DISCONNECTED
        timing["completion_tokens"] = self.answer.sent
        self.d.metrics.disconnects.labels(parsed.endpoint, str(parsed.stream).lower()).inc()
        self.req.log.info("client_disconnected", tokens_sent=self.answer.sent, stream=parsed.stream)
        await self.d.bus.cancel(self.flight.attempt_id, ErrorCode.CLIENT_DISCONNECTED)
        return self.answer.gone()

    async def _error_answer(self, status: int, code: ErrorCode, message: str) -> Outcome:
        """Record the error, then answer it (a JSON body before the first token, else an SSE event)."""
        timing = self.req.timing
        timing["error"], timing["error_message"] = code, clip(message)
        timing["completion_tokens"] = self.answer.delivered
        if self.lc.attempts:
            timing["attempts"] = self._attempts(current=True)
        return await self.answer.error(status, code, message)
