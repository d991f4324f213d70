"""Carrying out a request's lifecycle: the engine's request events in, the state machine's actions done.

:class:`Effects` is the node agent's side of the engine's per-request events (``on_prefill_done``,
``on_tokens``, ``on_finished``, ``on_failed``: kairos/engines/base.py ``EngineEvents``) and of a
cancel or a failure: it looks the request up, asks its :class:`~.request.NodeRequest` for the
transition, and performs each action it returns — out events on ``kairos.out.<rid>.agent-<node>``
(kept in the :class:`~.outbox.Outbox` for a resend after a reconnect), timing records in
``kairos_requests`` (one unacknowledged message each), the deflection slot, the engine's blocks,
the KV handoff or pull (started by the :mod:`.kv` parts), the spans. A request whose phase is
GONE leaves the node's table before its actions run, so an event racing with them finds it gone.
"""

from __future__ import annotations

from typing import Any, Callable

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import ErrorEvent
from kairos.contracts.wire import encode
from kairos.core.vocabulary import RequestPhase
from kairos.runtime.messaging import kv_put_nowait
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.outbox import Outbox
from kairos.services.node_agent.request import (Action, EndSpan, FreeEngine, HandOff, Ignored, NodeRequest, Publish,
                                                PullKv, ReleaseSlot, Span, StartDecode, WriteRecord)
from kairos.services.node_agent.slots import DeflectionSlots
from kairos.services.node_agent.tracing import decode_span, decode_summary, spans_of


class Effects:
    """Performs :class:`~.request.NodeRequest` actions for one node (module docstring).

    Args:
        ctx: the node's shared state.
        slots: its deflection slots (``ReleaseSlot``).
        hand_off: starts the KV handoff of a request whose prefill is done (``HandOff``; the prefill side of :mod:`.kv`).
        pull: starts the KV pull of a remote decode whose blocks were allocated (``PullKv``; the decode side).
    """

    def __init__(self, ctx: NodeContext, slots: DeflectionSlots, hand_off: Callable[[NodeRequest], None],
                 pull: Callable[[NodeRequest], None]) -> None:
        self.ctx, self.slots = ctx, slots
        self.hand_off, self.pull = hand_off, pull
        self.outbox = Outbox()  #: out events published lately (resent after a reconnect)

    # -- the engine's request events ----------------------------------------------------------------
    async def on_prefill_done(self, rid: str) -> None:
        """Keep path, prefill node: the prompt is computed; hand the KV to a decode node."""
        if (r := self.ctx.reqs.get(rid)) is not None:
            await self.run(r, r.prefill_done(self.ctx.clock.now_ms()))

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str,
                        finish_reason: str | None = None, logprobs: list | None = None,
                        stop_reason: str | int | None = None, token_ids: list[int] | None = None) -> None:
        """Stream tokens to the client (``finish_reason``: they are the last, as the engine knew, and
        ``stop_reason`` the stop string / token id that ended it; ``logprobs``: theirs, when asked
        for); the first one ends a deflection's prefill (slot released)."""
        if (r := self.ctx.reqs.get(rid)) is not None:
            await self.run(r, r.tokens_out(first_index, count, text, self.ctx.clock.now_ms(), finish_reason,
                                           logprobs, stop_reason, token_ids))
            self.ctx.metrics.tokens.labels(self.ctx.node).inc(count)

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int,
                          stop_reason: str | int | None = None) -> None:
        """Last token emitted: close the spans, tell the client (with the ``stop_reason``), write the
        decode record."""
        if (r := self.ctx.reqs.get(rid)) is not None:
            await self.run(r, r.finished(finish_reason, cached_tokens, self.ctx.clock.now_ms(), stop_reason))

    async def on_failed(self, rid: str, status: int, code: ErrorCode, message: str) -> None:
        """The engine could not serve ``rid``: explicit error to the client (the engine's ``status``)."""
        if (r := self.ctx.reqs.get(rid)) is not None:
            self.ctx.rlog(rid).warning("engine_failed_request", code=code, message=message)
            await self.run(r, r.failed(code, message, self.ctx.clock.now_ms(), status=status))

    # -- endings decided here -----------------------------------------------------------------------
    async def fail(self, r: NodeRequest, code: ErrorCode, message: str) -> None:
        """Give up on ``r`` here: free everything and tell the client (``code.status``)."""
        await self.run(r, r.failed(code, message, self.ctx.clock.now_ms()))

    async def cancel(self, rid: str, reason: str) -> None:
        """The request ended elsewhere (``Cancel``): a job or handoff for it arriving late is refused;
        what this node holds of it is freed."""
        self.ctx.cancelled.add(rid)
        if (r := self.ctx.reqs.get(rid)) is None:
            return
        self.ctx.rlog(rid).info("request_cancelled", reason=reason)
        await self.run(r, r.cancelled(reason))

    # -- actions ------------------------------------------------------------------------------------
    async def run(self, r: NodeRequest, actions: list[Action]) -> None:
        """Perform ``actions`` of ``r`` in order (a GONE request leaves the table first)."""
        if r.done and self.ctx.reqs.get(r.rid) is r:
            del self.ctx.reqs[r.rid]
        spans = spans_of(r)
        for a in actions:
            if isinstance(a, Publish):
                await self.publish(r, a)
            elif isinstance(a, WriteRecord):
                self.put_record(r.rid, a.part, a.record, spans.main)
            elif isinstance(a, EndSpan):
                attrs = decode_summary(r) if a.span is Span.DECODE and a.status is None else a.attrs
                spans.end(a.span, a.status, attrs)
            elif isinstance(a, StartDecode):
                spans.decode = decode_span(self.ctx.tracer, r, spans.main)
            elif isinstance(a, ReleaseSlot):
                self.slots.release(r.rid)
            elif isinstance(a, FreeEngine):
                self.free_engine(r.rid, a.held_only)
            elif isinstance(a, HandOff):
                self.hand_off(r)
            elif isinstance(a, PullKv):
                self.pull(r)
            elif isinstance(a, Ignored):
                self.ctx.rlog(r.rid, spans.main).info("node_request_event_ignored", reason=a.reason)

    async def publish(self, r: NodeRequest, a: Publish) -> None:
        """Publish ``a.event`` on ``r``'s out subject; a failure is logged (never raised into the
        engine's driver: the ingress resolves the request by its own liveness and timeout)."""
        try:
            await self.emit(r.rid, a.event)
        except Exception as exc:  # disconnected: nats-py raises while it has no connection
            what = "error_publish_failed" if isinstance(a.event, ErrorEvent) else "out_event_publish_failed"
            self.ctx.rlog(r.rid, spans_of(r).main).warning(what, error=repr(exc), event=type(a.event).__name__)

    async def emit(self, rid: str, ev: Any) -> None:
        """Publish out event ``ev`` of ``rid`` (core NATS) and keep it for a resend after a reconnect
        (:mod:`kairos.services.node_agent.outbox`)."""
        subject, payload = self.ctx.out_subject(rid), encode(ev)
        await self.ctx.nc.publish(subject, payload)
        self.outbox.sent(subject, payload)

    def free_engine(self, rid: str, held_only: bool) -> None:
        """Free ``rid`` on the engine: a held prompt's KV is released; with ``held_only`` False,
        anything else of it is aborted."""
        phase = self.ctx.backend.phase(rid)
        if phase == RequestPhase.HELD:
            self.ctx.backend.release(rid)
        elif phase is not None and not held_only:
            self.ctx.backend.abort(rid)

    def put_record(self, rid: str, part: str, rec: Any, span: Any = None) -> None:
        """Write ``rid``'s ``part`` record in the background (one unacknowledged message:
        kairos.runtime.messaging.kv_put_nowait; a failure is logged)."""
        if self.ctx.nc is None:
            return
        log, nc = self.ctx.rlog(rid, span), self.ctx.nc

        async def put() -> None:
            try:
                await kv_put_nowait(nc, S.REQUESTS_BUCKET, S.record_key(rid, part, self.ctx.node), encode(rec))
            except Exception as exc:  # disconnected: the record is lost, the request is not
                log.warning("record_write_failed", part=part, error=repr(exc))
        self.ctx.tasks.spawn(put(), "record_write")
