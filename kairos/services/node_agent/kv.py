"""The keep path's KV handoff, both sides (docs/architecture.md).

* **Prefill node** (:class:`KvSender`): prefill done → offer the KV to the job's decode candidates in
  order (``KvHandoff`` request-reply on ``kairos.kv.<decode node>.agent-<this node>``) until one
  accepts → the client is told which node's tokens to take (``HandoffEvent``) → the blocks stay held
  until that node's ``KvDone`` (``kairos.kvdone.<this node>.agent-<decode node>``), or until
  ``kv_hold_timeout_s`` if it never comes (it died after accepting). Right after a NATS reconnect the
  decode agents may not have re-subscribed yet: a handoff nobody took is retried for
  :data:`HANDOFF_SETTLE_S` before the request fails ``kv_handoff_failed``.
* **Decode node** (:class:`KvReceiver`): a handoff is accepted only from the prefill node it names
  (the NATS user in its subject proves the sender) → ``add_remote_decode``
  → blocks allocated → ``pull_kv`` (the engine's transfer, one per link at a time) → ``kv_arrived``
  → decode; ``KvDone`` tells the prefill node either way.

What each step does to the request is its :class:`~.request.NodeRequest`'s transition; the actions
are carried out by :class:`~.effects.Effects`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import nats.errors
from opentelemetry import trace

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import AGENT_PREFIX, PROFILER, agent_user
from kairos.contracts.wire import KvAck, KvDone, KvHandoff, WireError, decode, encode
from kairos.core.vocabulary import RequestPhase
from kairos.runtime import telemetry
from kairos.runtime.messaging import publish, request_typed
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.effects import Effects
from kairos.services.node_agent.request import NodeRequest, Span
from kairos.services.node_agent.tracing import RequestSpans, handoff_span, kv_transfer_span, spans_of

#: after a NATS reconnect, a KV handoff nobody took is retried for this long (decode agents
#: reconnect at their own pace) before it fails with kv_handoff_failed
HANDOFF_SETTLE_S = 3.0
#: pause (s) between two passes over the decode candidates while the connection settles
HANDOFF_RETRY_S = 0.2
#: longest wait (s) for the engine to answer a health probe when its state stream is late and a KV
#: handoff arrives (within kv_handoff_timeout_s / 2)
ENGINE_PROBE_KV_S = 3.0


def _agent_of(user: str | None) -> str | None:
    """The node an agent's NATS user names (``agent-<node>``), None for any other user."""
    return user[len(AGENT_PREFIX):] if user and user.startswith(AGENT_PREFIX) else None


class KvSender:
    """The prefill node's side of the handoff (module docstring)."""

    def __init__(self, ctx: NodeContext, effects: Effects) -> None:
        self.ctx, self.effects = ctx, effects

    def start(self, r: NodeRequest) -> None:
        """Hand ``r``'s KV off in the background (the ``HandOff`` action)."""
        self.ctx.tasks.spawn(self.hand_off(r), "kv_handoff")

    async def hand_off(self, r: NodeRequest) -> None:
        """Offer ``r``'s KV until a decode candidate takes it, else fail it ``kv_handoff_failed``."""
        ctx = self.ctx
        if r.job is None or r.done:  # cancelled before this task ran
            return
        spans = spans_of(r)
        spans.handoff = handoff_span(ctx.tracer, r, spans.main, ctx.backend.kv_transfer_ms(r.req.prompt_tokens))
        headers = telemetry.inject_headers(trace.set_span_in_context(spans.handoff))
        now = ctx.clock.now_ms()
        r.handoff_started(now)
        msg = KvHandoff(request=r.req, src_node=ctx.node, kv_tokens=r.req.prompt_tokens,
                        prefill_done_unix_ms=r.prefill_done_ms or now, cached_tokens=r.cached_tokens,
                        kv_transfer_params=ctx.backend.handoff_params(r.rid))
        tried: dict[str, str] = {}
        settle_until = ctx.clock.monotonic() + HANDOFF_SETTLE_S
        while True:
            if await self._offer(r, msg, headers, tried) is not None:
                await self._revoke(msg, tried)
                return
            # right after a NATS reconnect the decode agents may not have re-subscribed yet
            if not (ctx.bus is not None and ctx.bus.settling(HANDOFF_SETTLE_S)
                    and ctx.clock.monotonic() < settle_until and r.rid in ctx.reqs):
                break
            await ctx.clock.sleep(HANDOFF_RETRY_S)
            tried.clear()
        ctx.rlog(r.rid, spans.main).warning("kv_handoff_failed", tried=tried)
        await self._revoke(msg, tried)
        await self.effects.fail(r, ErrorCode.KV_HANDOFF_FAILED, f"no decode node took the KV cache: {tried}")

    async def _revoke(self, msg: KvHandoff, tried: dict[str, str]) -> None:
        """Fencing (issue 33): each candidate whose answer never came (paused, partitioned) may still
        read the offer and take the KV; tell it the offer is void. Published after the offer on the
        same connection, so it reaches that node after it, in order."""
        void = msgspec.structs.replace(msg, revoke=True, kv_transfer_params=None)
        for cand, why in tried.items():
            if why == "timeout":
                try:
                    await publish(self.ctx.nc, S.kv_subject(cand, agent_user(self.ctx.node)), void)
                except Exception as exc:  # disconnected: that node's own liveness ends it
                    self.ctx.rlog(msg.request.request_id).warning("kv_revoke_failed", node=cand, error=repr(exc))

    async def _offer(self, r: NodeRequest, msg: KvHandoff, headers: dict[str, str], tried: dict[str, str]) -> bool | None:
        """One pass over the decode candidates: True = handed off, False = cancelled meanwhile,
        None = nobody took it (``tried`` says why, per candidate)."""
        ctx = self.ctx
        assert r.job is not None
        for cand in r.job.decode_candidates:
            try:
                ack = await request_typed(ctx.nc, S.kv_subject(cand, agent_user(ctx.node)), msg, KvAck,
                                          ctx.cfg.kv_handoff_timeout_s, headers)
            except nats.errors.NoRespondersError:
                tried[cand] = "no_responders"
                continue
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                tried[cand] = "timeout"
                continue
            if not ack.accepted:
                tried[cand] = ack.reason or "refused"
                continue
            if r.rid in ctx.cancelled:  # cancelled meanwhile: the decode node gets a cancel too
                return False
            spans = spans_of(r)
            if spans.is_open(Span.HANDOFF):
                spans.handoff.set_attribute("kairos.decode_node", cand)
                if tried:
                    spans.handoff.set_attribute("kairos.rerouted_from", [f"{k}:{v}" for k, v in tried.items()])
            # the ingress accepts the tokens of the node this names (it holds any that overtake this); the
            # decode node's KvDone (another subscription, so another task) may have been handled already
            await self.effects.run(r, r.handed_off(cand, ctx.clock.now_ms(), ctx.backend.kv_transfer_ms(r.req.prompt_tokens),
                                                   ack.epoch_unix_ms))
            return True
        return None

    async def on_kvdone(self, msg: Any) -> None:
        """A decode node pulled (or gave up on) a KV cache this node holds: release it. Only from a
        decode node the request's job named (the NATS user in the subject,
        ``kairos.kvdone.<this node>.agent-<decode node>``; not only the one whose acceptance this
        node has already seen: its notice may overtake its answer), else refused as forged."""
        ctx = self.ctx
        try:
            d = decode(msg.data, KvDone)
        except WireError:
            return
        proven = _agent_of(S.subject_node(msg.subject, lambda u: S.kvdone_subject(ctx.node, u)))
        if not ctx.origin.check(msg, "kv_done", proven, d.decode_node, request_id=d.request_id):
            return
        r = ctx.reqs.get(d.request_id)
        if r is None:  # gone here (cancelled, expired): the engine may still hold the blocks
            self.effects.free_engine(d.request_id, held_only=True)
            return
        if r.job is None or proven not in r.job.decode_candidates:
            ctx.origin.refuse(msg.subject, "kv_done", "not_the_holder", proven, d.decode_node,
                              request_id=d.request_id, handed_to=r.handoff_node)
            return
        if r.handoff_node is not None and proven != r.handoff_node:  # a revoked candidate's notice: not
            ctx.rlog(d.request_id).info("kv_done_of_a_revoked_offer", node=proven)  # the holder's
            return
        await self.effects.run(r, r.kv_pulled(d.transfer_ms))

    async def expire_held(self) -> None:
        """Free the blocks of handed-off KV caches whose decode node never said it pulled them (it
        died after accepting the handoff); the client gets its answer from the ingress timeout,
        the cluster gets its memory back."""
        limit = self.ctx.clock.now_ms() - self.ctx.cfg.kv_hold_timeout_s * 1000.0
        for r in [r for r in self.ctx.reqs.values() if r.hold_expired(limit)]:
            self.ctx.rlog(r.rid, spans_of(r).main).warning("kv_hold_expired", decode_node=r.handoff_node)
            await self.effects.run(r, r.expire_hold())


class KvReceiver:
    """The decode node's side of the handoff (module docstring)."""

    def __init__(self, ctx: NodeContext, effects: Effects) -> None:
        self.ctx, self.effects = ctx, effects

    async def on_kv(self, msg: Any) -> None:
        """The ``kairos.kv.<node>.*`` subscription: answer the handoff, then start the pulls of what
        the engine allocated."""
        ctx = self.ctx
        try:
            h = decode(msg.data, KvHandoff)
        except WireError:
            await msg.respond(encode(KvAck(accepted=False, node=ctx.node, reason="bad_message")))
            return
        if h.revoke:
            await self.revoked(msg, h)
            return
        ack = await self.accept(msg, h)
        await msg.respond(encode(ack))
        if ack.accepted and not ack.reason:
            await self.on_allocated(ctx.backend.take_allocated())

    async def accept(self, msg: Any, h: KvHandoff) -> KvAck:
        """Take the handoff ``h`` (arrived as ``msg``) or say why not."""
        ctx, rid = self.ctx, h.request.request_id
        forged = await self._forged(msg, h)
        if forged is not None:
            return KvAck(accepted=False, node=ctx.node, reason=forged)
        if rid in ctx.reqs:
            return KvAck(accepted=True, node=ctx.node, reason="duplicate", epoch_unix_ms=ctx.epoch_unix_ms)
        reason = None if ctx.accepting else "draining"
        if rid in ctx.cancelled:
            reason = "cancelled"
        if reason is None and not (ctx.backend.available or await ctx.backend.confirm_available(
                min(ENGINE_PROBE_KV_S, ctx.cfg.kv_handoff_timeout_s / 2))):
            reason = "engine_unavailable"
        if reason is None:
            try:
                ctx.backend.note_block_hashes(rid, h.request.block_hashes, h.request.block_hash_tokens)
                ctx.backend.add_remote_decode(h.request, h.kv_transfer_params)
            except ValueError as exc:  # the engine refuses it (the EngineBackend contract)
                reason = f"engine_refused: {exc}"
        if reason is not None:
            return KvAck(accepted=False, node=ctx.node, reason=reason)
        r = NodeRequest.for_handoff(h, ctx.node, ctx.clock.now_ms())
        r.spans = RequestSpans(main=kv_transfer_span(ctx.tracer, h, ctx.node, msg.headers))
        ctx.reqs[rid] = r
        return KvAck(accepted=True, node=ctx.node, epoch_unix_ms=ctx.epoch_unix_ms)

    async def revoked(self, msg: Any, h: KvHandoff) -> None:
        """The prefill node gave up on its offer of ``h`` to this node (it timed out: this node was
        paused or cut off) and handed the KV elsewhere: what this node took of it goes, unstarted;
        a later copy of the offer is refused (``cancelled``). Only the node it names may revoke it."""
        ctx, rid = self.ctx, h.request.request_id
        sender = _agent_of(S.subject_node(msg.subject, lambda u: S.kv_subject(ctx.node, u)))
        if not ctx.origin.check(msg, "kv_handoff", sender, h.src_node, request_id=rid):
            return
        r = ctx.reqs.get(rid)
        if r is not None and r.src_node != h.src_node:
            return  # taken from another prefill node (a re-submission's): not this offer
        ctx.rlog(rid).info("kv_offer_revoked", src_node=h.src_node, held=r is not None)
        await self.effects.cancel(rid, "kv_offer_revoked")

    async def _forged(self, msg: Any, h: KvHandoff) -> str | None:
        """Why a handoff is refused, or None: it must come from the node it names (the NATS user in
        its subject, ``kairos.kv.<this node>.<user>``) — or from ``kairos profile``, which drives this
        node. Whether that node ran the request is the ingress's to judge: it relays this node's
        tokens only when the prefill node its job went to named this node (its ``HandoffEvent``,
        kairos/services/ingress/senders.py), so a prefill agent handing over a request it does not
        hold costs this node the work, never a client a wrong stream."""
        ctx = self.ctx
        sender = S.subject_node(msg.subject, lambda u: S.kv_subject(ctx.node, u))
        if sender == PROFILER:
            return None
        proven, rid = _agent_of(sender), h.request.request_id
        if not ctx.origin.check(msg, "kv_handoff", proven, h.src_node, request_id=rid):
            return "forged"
        return None

    async def on_allocated(self, rids: list[str]) -> None:
        """Remote decodes whose blocks the engine allocated: start their pulls."""
        for rid in rids:
            if (r := self.ctx.reqs.get(rid)) is not None:
                await self.effects.run(r, r.allocated(self.ctx.clock.now_ms()))

    def start_pull(self, r: NodeRequest) -> None:
        """Pull ``r``'s KV in the background (the ``PullKv`` action)."""
        self.ctx.tasks.spawn(self.pull(r), "kv_pull")

    async def pull(self, r: NodeRequest) -> None:
        """Wait for the engine's transfer of ``r``'s KV; decoding starts if the request is still
        waiting for it. The prefill node hears either way (``KvDone``: it frees its blocks)."""
        ctx, rid, src = self.ctx, r.rid, r.src_node or ""
        ms = await ctx.backend.pull_kv(src, rid, r.req.prompt_tokens)
        ok = (ctx.backend.phase(rid) == RequestPhase.AWAITING_KV and ctx.reqs.get(rid) is r
              and r.phase is RequestPhase.AWAITING_KV)
        if ok:
            ctx.backend.kv_arrived(rid)
            ctx.metrics.kv_transfers.labels(ctx.node).inc()
            ctx.metrics.kv.labels(ctx.node).observe(telemetry.seconds(ms))
            await self.effects.run(r, r.kv_arrived(ctx.clock.now_ms(), ms))
        await publish(ctx.nc, S.kvdone_subject(src, agent_user(ctx.node)),
                      KvDone(request_id=rid, decode_node=ctx.node, ok=ok, transfer_ms=ms))
