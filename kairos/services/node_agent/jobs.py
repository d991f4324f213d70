"""A node agent's jobs: a dispatcher's ``Job`` in (``kairos.jobs.<node>``, request-reply), one ``JobAck`` out.

In order (each step may answer and stop):

1. **Origin**: a job is a request (a dispatcher's or the profiler's; nobody else may publish here)
   on exactly this node's subject (kairos/contracts/origin.py).
2. **Already here / cancelled**: a job for a request this node holds is a redelivery (``duplicate``,
   accepted); one for a request cancelled meanwhile is refused ``cancelled``.
3. **Local checks** (:func:`kairos.core.cluster.routing.job_refusal`: node, role, draining or engine
   down, length, deadline, deflection slots; then the claim buckets' count must agree with the
   dispatcher's): refused with the reason. A deflect job takes its slot now, before the claim's
   await, so a concurrent deflect job sees it taken.
4. **The execution claim** (:mod:`.acceptance`, at most one node runs a bus request id), settled by
   :func:`claim_verdict`: ``run``, ``duplicate``, ``withdrawn`` (refused ``cancelled``), ``claimed``
   by another node or an earlier incarnation (refused ``claimed``; an earlier incarnation of this
   node died with it: the client is told ``node_lost``), ``failed`` (refused ``claim_failed``).
5. **The engine** gets it (``add_prefill`` / ``add_deflected``); a refusal gives the claim back.
6. **Accepted**: the :class:`~.request.NodeRequest` joins the node's table, a deflection publishes
   its slot's reservation, the answer carries it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import ErrorEvent
from kairos.contracts.wire import decode, encode, Job, JobAck, WireError
from kairos.core.cluster.recent import RecentIds
from kairos.core.cluster.routing import job_refusal
from kairos.core.vocabulary import DEFLECT, KEEP
from kairos.runtime import telemetry
from kairos.services.node_agent.acceptance import ClaimResult
from kairos.services.node_agent.context import CANCELLED_REMEMBERED, NodeContext
from kairos.services.node_agent.effects import Effects
from kairos.services.node_agent.request import NodeRequest
from kairos.services.node_agent.slots import DeflectionSlots
from kairos.services.node_agent.tracing import RequestSpans, job_span

#: longest wait for the execution claim's answer, s: below the dispatchers' job_ack_timeout_s (1 s), so
#: a requests bucket electing a leader (seconds, a NATS cluster member died) answers claim_failed in
#: time for the dispatcher's retry instead of blocking this node's jobs, handled one at a time
CLAIM_TIMEOUT_S = 0.75
#: longest wait (s) for the engine to answer a health probe when its state stream is late and a job
#: arrives (within the dispatcher's 1 s ack timeout)
ENGINE_PROBE_JOB_S = 0.5


def claim_verdict(claim: ClaimResult, running_here: bool, uncertain: bool) -> str:
    """What a claim's outcome means for the job: ``run``, ``duplicate``, ``withdrawn``, ``claimed`` or
    ``failed``. ``running_here``: the node holds the request now; ``uncertain``: an earlier try's claim
    failed here (its answer may have been lost, the claim stored all the same).

    A claim this incarnation holds is a duplicate — unless the node never started the request and
    its earlier try's answer was lost: then nobody runs it unless this node does now."""
    if claim.outcome == "mine" and not running_here and uncertain:
        return "run"
    if claim.outcome == "mine" or running_here:
        return "duplicate"
    return "run" if claim.outcome == "won" else claim.outcome


class Jobs:
    """A node's job handling (module docstring).

    Attributes:
        received: request ids of every job received, in order (tests, debugging).
        uncertain: request ids whose claim failed here (a lost answer may hide a stored claim) and that
            did not start here since: a later try finding the claim this node's runs it (bounded: the
            dispatcher's retries of one request come within seconds).
    """

    def __init__(self, ctx: NodeContext, slots: DeflectionSlots, effects: Effects) -> None:
        self.ctx, self.slots, self.effects = ctx, slots, effects
        self.received: list[str] = []
        self.uncertain = RecentIds(CANCELLED_REMEMBERED)

    async def on_job(self, msg: Any) -> None:
        """The ``kairos.jobs.<node>`` subscription: check the origin, decode, :meth:`handle`, answer."""
        ctx = self.ctx
        mine = msg.reply and msg.subject == S.jobs_subject(ctx.node)  # a JetStream answer sent here has no reply
        if not ctx.origin.check(msg, "job", ctx.node if mine else None, None):
            return
        try:
            job = decode(msg.data, Job)
        except WireError as exc:
            ctx.log.error("bad_job", error=str(exc))
            await msg.respond(encode(JobAck(accepted=False, node=ctx.node, reason="bad_message")))
            return
        ack, lost = await self.handle(job, msg.headers)
        await msg.respond(encode(ack))
        if lost is not None:  # after the answer: the ingress re-submits it under a new bus id
            await self.effects.emit(job.request.request_id, lost)

    async def handle(self, job: Job, headers: Mapping[str, str] | None = None) -> tuple[JobAck, ErrorEvent | None]:
        """The answer to ``job`` (steps 2-6 of the module docstring), and the ``node_lost`` error to
        send the client when an earlier incarnation of this node held the request."""
        ctx, rid = self.ctx, job.request.request_id
        self.received.append(rid)
        if rid in ctx.reqs:  # a redelivered request re-sent to the node that already has it
            return self._duplicate(job, ctx.reqs[rid].received_ms), None
        if rid in ctx.cancelled:  # the request ended before its job got here
            ctx.metrics.jobs.labels(ctx.node, job.kind, "cancelled").inc()
            return JobAck(accepted=False, node=ctx.node, reason="cancelled"), None
        reason = await self._local_refusal(job)
        if reason is not None:
            await self._give_up_uncertain(rid)
            if reason == "deflection_in_flight":
                self.slots.overlaps += 1
                ctx.metrics.overlap.labels(ctx.node).inc()
            return self._refuse(job, reason, headers), None
        took_slot = job.kind == DEFLECT and rid not in self.slots.held
        if took_slot:  # before the claim's await: a concurrent deflect job sees the slot taken
            self.slots.take(rid)
        try:
            return await self._claim_and_start(job, headers)
        finally:
            if took_slot and rid not in ctx.reqs:
                self.slots.give_back(rid)

    async def _local_refusal(self, job: Job) -> str | None:
        """Why this node refuses ``job`` on its own (step 3), or None."""
        ctx, req = self.ctx, job.request
        engine_ok = ctx.backend.available or await ctx.backend.confirm_available(ENGINE_PROBE_JOB_S)
        reason = job_refusal(job.kind, job.node, ctx.node, ctx.cfg.role, ctx.accepting and engine_ok, len(self.slots),
                             req.prompt_tokens, req.max_tokens, ctx.model.engine.max_model_len, req.deadline_unix_ms,
                             ctx.clock.now_ms(), ctx.cfg.max_deflections)
        claims = ctx.claims
        if reason is None and job.claim_buckets and claims is not None and job.claim_buckets != len(claims.quorum.buckets):
            # two processes counting different claim buckets could both hold a majority: never run it
            mine = len(claims.quorum.buckets)
            reason = (f"lane_mismatch: the dispatcher has {job.claim_buckets} claim buckets, this node {mine} "
                      f"(KAIROS_NATS_LANES / KAIROS_NATS_REPLICAS / KAIROS_NATS_URL must agree)")
            ctx.log.error("lane_mismatch", request_id=req.request_id, dispatcher=job.dispatcher_id,
                          dispatcher_buckets=job.claim_buckets, node_buckets=mine)
        return reason

    async def _give_up_uncertain(self, rid: str) -> None:
        """An earlier try's claim may be stored here (its answer was lost) and this node will not run
        the request now: give it up, or it would stay claimed by a node that never runs it (one read
        and one delete per bucket at once, within the dispatcher's wait for the answer)."""
        if rid in self.uncertain and rid not in self.ctx.reqs and self.ctx.claims is not None:
            await self.ctx.claims.release_mine(rid)
            self.uncertain.discard(rid)

    async def _claim(self, job: Job) -> ClaimResult:
        """Claim the request cluster-wide, bounded (jobs are handled one at a time, and the dispatcher
        waits ``job_ack_timeout_s``)."""
        assert self.ctx.claims is not None
        try:
            return await asyncio.wait_for(self.ctx.claims.claim(job), CLAIM_TIMEOUT_S)
        except TimeoutError:
            return ClaimResult("failed", error=f"no answer from the requests bucket in {CLAIM_TIMEOUT_S} s")

    async def _claim_and_start(self, job: Job, headers: Mapping[str, str] | None) -> tuple[JobAck, ErrorEvent | None]:
        """Steps 4-6: claim, settle, start the engine, accept."""
        ctx, rid = self.ctx, job.request.request_id
        if ctx.claims is None:  # the requests bucket is not open yet
            return self._refuse(job, "claim_failed", headers), None
        claim = await self._claim(job)
        if claim.outcome == "failed":  # it may be stored all the same (the answer was lost)
            self.uncertain.add(rid)
        verdict = claim_verdict(claim, rid in ctx.reqs, rid in self.uncertain)
        if verdict == "duplicate":
            return self._duplicate(job, ctx.reqs[rid].received_ms if rid in ctx.reqs else ctx.clock.now_ms()), None
        if verdict == "withdrawn":  # the ingress refused this attempt (its tombstone): never run it
            ctx.cancelled.add(rid)
            ctx.metrics.jobs.labels(ctx.node, job.kind, "cancelled").inc()
            ctx.rlog(rid).info("job_refused", reason="withdrawn", withdrawn=claim.claim.withdrawn if claim.claim else None)
            return JobAck(accepted=False, node=ctx.node, reason="cancelled"), None
        if verdict == "claimed":
            return self._claimed_elsewhere(job, claim)
        if verdict == "failed":
            ctx.rlog(rid).warning("claim_failed", error=claim.error)
            return self._refuse(job, "claim_failed", headers), None
        refused = self._start_engine(job)
        if refused is not None:
            if claim.revisions is not None:
                await ctx.claims.release(rid, claim.revisions)  # another node may take it
            return self._refuse(job, refused, headers), None
        return await self._accept(job, headers), None

    def _start_engine(self, job: Job) -> str | None:
        """Give the engine the job (step 5); the refusal reason, or None."""
        backend, req = self.ctx.backend, job.request
        try:
            backend.note_block_hashes(req.request_id, req.block_hashes, req.block_hash_tokens)
            if job.kind == KEEP:
                backend.add_prefill(req)
            else:
                backend.add_deflected(req, list(job.chunk_schedule), job.decision_batch_size)
        except ValueError as exc:  # the engine refuses it (the EngineBackend contract: kairos/engines/base.py)
            return f"engine_refused: {exc}"
        return None

    async def _accept(self, job: Job, headers: Mapping[str, str] | None) -> JobAck:
        """Step 6: the request is this node's."""
        ctx, rid = self.ctx, job.request.request_id
        r = NodeRequest.for_job(job, ctx.node, ctx.clock.now_ms())
        r.spans = RequestSpans(main=job_span(ctx.tracer, job, ctx.node, ctx.cfg.role, headers))
        ctx.reqs[rid] = r
        self.uncertain.discard(rid)
        resv = await self.slots.reserve(rid, job) if job.kind == DEFLECT else (None, None, None)
        ctx.metrics.jobs.labels(ctx.node, job.kind, "accepted").inc()
        ctx.rlog(rid, r.spans.main).debug("job_accepted", kind=job.kind, attempt=job.attempt, dispatcher=job.dispatcher_id)
        return JobAck(accepted=True, node=ctx.node, accepted_unix_ms=ctx.clock.now_ms(), epoch_unix_ms=ctx.epoch_unix_ms,
                      reservation=resv[0],
                      reservation_key=resv[1], reservation_revision=resv[2])

    def _duplicate(self, job: Job, accepted_ms: float) -> JobAck:
        """Executed (or being executed) here already: accepted, nothing runs again."""
        rid = job.request.request_id
        self.ctx.metrics.jobs.labels(self.ctx.node, job.kind, "duplicate").inc()
        self.ctx.rlog(rid).info("job_duplicate", attempt=job.attempt, dispatcher=job.dispatcher_id)
        return JobAck(accepted=True, node=self.ctx.node, reason="duplicate", accepted_unix_ms=accepted_ms,
                      epoch_unix_ms=self.ctx.epoch_unix_ms)

    def _claimed_elsewhere(self, job: Job, claim: ClaimResult) -> tuple[JobAck, ErrorEvent | None]:
        """Another node (or an earlier incarnation of this one) holds the claim: refused ``claimed``.
        If it was this node before a restart, the request died with it: ``node_lost`` for the client."""
        ctx, rid = self.ctx, job.request.request_id
        ctx.metrics.jobs.labels(ctx.node, job.kind, "claimed_elsewhere").inc()
        ctx.rlog(rid).info("job_claimed_elsewhere", claimed_by=claim.claim.node if claim.claim else None)
        ack = JobAck(accepted=False, node=ctx.node, reason="claimed", claim=claim.claim)
        if claim.claim is None or claim.claim.node != ctx.node:
            return ack, None
        code = ErrorCode.NODE_LOST
        return ack, ErrorEvent(request_id=rid, status=code.status, code=code, source=f"node_agent:{ctx.node}",
                               message=f"node {ctx.node} restarted and lost request {rid}", sent_unix_ms=ctx.clock.now_ms())

    def _refuse(self, job: Job, reason: str, headers: Mapping[str, str] | None) -> JobAck:
        rid = job.request.request_id
        self.ctx.metrics.jobs.labels(self.ctx.node, job.kind, "refused").inc()
        self.ctx.rlog(rid, telemetry.extract_context(headers)).info("job_refused", reason=reason)
        return JobAck(accepted=False, node=self.ctx.node, reason=reason)
