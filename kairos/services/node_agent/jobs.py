"""A node agent's jobs: a ``Job`` in (``kairos.jobs.<node>``, request-reply), one ``JobAck`` out.

Jobs come from the request's ingress, the one sender of an attempt's jobs (issue 34: a dispatcher
decides, the ingress's arbiter lets the job go, kairos/services/ingress/jobrelay.py), or from
``kairos profile``. In order (each step may answer and stop):

1. **Origin**: a job is a request (the ingress's or the profiler's; nobody else may publish here)
   on exactly this node's subject (kairos/contracts/origin.py).
2. **Already here / cancelled**: a job for a request this node holds is answered ``duplicate``
   (accepted, nothing runs again); one for a request cancelled meanwhile is refused ``cancelled``.
3. **Local checks** (:func:`kairos.core.cluster.routing.job_refusal`: node, role, draining or engine
   down, length, deadline, deflection slots): refused with the reason.
4. **The engine** gets it (``add_prefill`` / ``add_deflected``); its refusal is the job's.
5. **Accepted**: the :class:`~.request.NodeRequest` joins the node's table, a deflection publishes
   its slot's reservation (taken before that await: a concurrent deflect job sees it taken), the
   answer carries it.

No claim is made anywhere: the ingress sends no other job of the attempt while this one may run.
"""

from __future__ import annotations

from typing import Any, Mapping

from kairos.contracts import subjects as S
from kairos.contracts.wire import decode, encode, Job, JobAck, WireError
from kairos.core.cluster.routing import job_refusal
from kairos.core.vocabulary import DEFLECT, KEEP
from kairos.runtime import telemetry
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.effects import Effects
from kairos.services.node_agent.request import NodeRequest
from kairos.services.node_agent.slots import DeflectionSlots
from kairos.services.node_agent.tracing import RequestSpans, job_span

#: longest wait (s) for the engine to answer a health probe when its state stream is late and a job
#: arrives (within the ingress's 1 s job timeout, ``KAIROS_JOB_ACK_TIMEOUT_S``)
ENGINE_PROBE_JOB_S = 0.5


class Jobs:
    """A node's job handling (module docstring).

    Attributes:
        received: request ids of every job received, in order (tests, debugging).
    """

    def __init__(self, ctx: NodeContext, slots: DeflectionSlots, effects: Effects) -> None:
        self.ctx, self.slots, self.effects = ctx, slots, effects
        self.received: list[str] = []

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
        await msg.respond(encode(await self.handle(job, msg.headers)))

    async def handle(self, job: Job, headers: Mapping[str, str] | None = None) -> JobAck:
        """The answer to ``job`` (steps 2-5 of the module docstring)."""
        ctx, rid = self.ctx, job.request.request_id
        self.received.append(rid)
        if rid in ctx.reqs:  # sent again to the node that already has it
            return self._duplicate(job, ctx.reqs[rid].received_ms)
        # the request ended before its job got here, or while the engine probe was awaited
        reason = "cancelled" if rid in ctx.cancelled else await self._local_refusal(job)
        if reason == "cancelled" or (reason is None and rid in ctx.cancelled):
            ctx.metrics.jobs.labels(ctx.node, job.kind, "cancelled").inc()
            return JobAck(accepted=False, node=ctx.node, reason="cancelled")
        if reason is None:
            reason = self._start_engine(job)
        if reason is not None:
            if reason == "deflection_in_flight":
                self.slots.overlaps += 1
                ctx.metrics.overlap.labels(ctx.node).inc()
            return self._refuse(job, reason, headers)
        took_slot = job.kind == DEFLECT and rid not in self.slots.held
        if took_slot:  # before the reservation's await: a concurrent deflect job sees the slot taken
            self.slots.take(rid)
        try:
            return await self._accept(job, headers)
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
        return reason

    def _start_engine(self, job: Job) -> str | None:
        """Give the engine the job (step 4); the refusal reason, or None."""
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
        """Step 5: the request is this node's."""
        ctx, rid = self.ctx, job.request.request_id
        r = NodeRequest.for_job(job, ctx.node, ctx.clock.now_ms())
        r.spans = RequestSpans(main=job_span(ctx.tracer, job, ctx.node, ctx.cfg.role, headers))
        ctx.reqs[rid] = r
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

    def _refuse(self, job: Job, reason: str, headers: Mapping[str, str] | None) -> JobAck:
        rid = job.request.request_id
        self.ctx.metrics.jobs.labels(self.ctx.node, job.kind, "refused").inc()
        self.ctx.rlog(rid, telemetry.extract_context(headers)).info("job_refused", reason=reason)
        return JobAck(accepted=False, node=self.ctx.node, reason=reason)
