"""The ingress sends every job of its requests: a dispatcher decides, the ingress's arbiter lets it go.

Issue 34's request path (docs/bus.md, "The request path"). A dispatcher that routes an attempt does
not send the job to the node: it sends it, as a request, to the attempt's conversation subject in
this ingress's inbox (``<notices>.<attempt id>``, the ``Kairos-Notices`` header of the request it
took; the same subject carries its ``alive`` notices). For each such **plan** (:meth:`JobRelay.on_notice`):

1. the attempt's :class:`~kairos.core.cluster.arbiter.Arbiter` (one per attempt, on its
   :class:`~.flights.Flight`) decides, at once and in arrival order: ``send``, or ``cancelled`` — the
   attempt is unknown here (it ended, moved, or belongs to no request of this ingress), a node
   accepted it already, a job of it is out now, or a node that stayed silent may run it;
2. ``send``: the job's bytes, as the dispatcher encoded them (nothing decoded here but
   :class:`~kairos.contracts.wire.JobHead`) with the attempt's request spliced in — the bytes this
   ingress sent to the dispatchers, which left it out (:func:`~kairos.contracts.wire.job_with_request`:
   the prompt is encoded once) — go to ``kairos.jobs.<node>`` (request-reply, the ingress's
   ``job_ack_timeout_s``) in a task of their own — a slow node holds up no other plan;
3. the node's answer is recorded in the arbiter and relayed to the dispatcher unchanged. An
   **accepted** job makes the node the attempt's sender at once (:meth:`~.flights.Flights.routed`:
   its tokens are relayed; no routing event is waited for). **No responders** (the job reached no
   agent) is answered ``no_responders``: the dispatcher retries or routes elsewhere. A **silent**
   node (no answer in time: it may run the job) is answered ``timeout`` and the attempt **moves**:
   cancelled, and sent again under a new attempt id (:class:`~.flights.Interrupted`, which the
   request's lifecycle turns into a re-submission or a migration, issue 33).

So at most one node runs an attempt without any claim written anywhere: only this ingress sends its
jobs, one at a time, none after an acceptance or a silence (the arbiter's property test,
tests/unit/test_arbiter.py). The bus is the :class:`~.ports.IngressBus` port (a fake in unit tests).
"""

from __future__ import annotations

from typing import Any

from kairos.contracts import subjects as S
from kairos.contracts.wire import (JOB_CANCELLED, JOB_NO_RESPONDERS, JOB_UNANSWERED, JobAck, JobHead, WireError,
                                   decode, encode, job_with_request)
from kairos.core.cluster.arbiter import Answer, Arbiter
from kairos.runtime.resources import BackgroundTasks
from kairos.services.ingress.flights import Flight, Flights, Interrupted
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.ports import IngressBus, NoAgent, NodeSilent


class JobRelay:
    """The plans of the dispatchers that route this ingress's attempts (module docstring).

    Args:
        flights: the in-flight requests (their arbiters; routed nodes are told to them).
        bus: sends jobs and answers dispatchers.
        metrics: ``kairos_ingress_jobs_total{answer}``.
        bg: where each job's send runs.
        log: the service's logger.
    """

    def __init__(self, flights: Flights, bus: IngressBus, metrics: IngressMetrics, bg: BackgroundTasks,
                 log: Any) -> None:
        self.flights, self.bus, self.m, self.bg, self.log = flights, bus, metrics, bg, log

    async def on_notice(self, msg: Any) -> None:
        """A message on an attempt's conversation subject: ``alive`` (:meth:`Flights.on_notice`) or
        a dispatcher's job (it has a reply subject)."""
        if not msg.reply or msg.data == S.ALIVE:
            await self.flights.on_notice(msg)
            return
        attempt_id = msg.subject.rpartition(".")[2]
        try:
            head = decode(msg.data, JobHead)
        except WireError as exc:
            self.log.warning("bad_job_plan", request_id=attempt_id, error=str(exc))
            await self.bus.respond(msg.reply, encode(JobAck(accepted=False, node="", reason=f"bad_job: {exc}")))
            return
        f = self.flights.get(attempt_id)
        verdict = "cancelled"
        if f is not None and f.attempt_id == attempt_id and not f.lc.ended and f.sent is not None:
            f.enqueued_at = self.flights.clock.monotonic()  # a sign of its routing (liveness.check_routes)
            verdict = f.arbiter.plan(head.node)
        if verdict != "send":  # "move" cannot come: a silence moved the attempt at once (_send)
            self.m.jobs.labels("not_sent").inc()
            await self.bus.respond(msg.reply, encode(JobAck(accepted=False, node=head.node, reason=JOB_CANCELLED)))
            return
        assert f is not None and f.sent is not None
        self.bg.spawn(self._send(f, f.arbiter, f.sent[0], attempt_id, head, msg), "send_job")

    async def _send(self, f: Flight, arbiter: Arbiter, request: bytes, attempt_id: str, head: JobHead,
                    msg: Any) -> None:
        """Send the job the arbiter let go (``request``: the attempt's encoded request, spliced in),
        record and relay the node's answer (module docstring)."""
        node, answer = head.node, "silent"
        try:
            job = job_with_request(msg.data, request)
        except WireError as exc:  # not a plan: nothing was sent, the next plan may go
            arbiter.answer(node, "refused")
            await self.bus.respond(msg.reply, encode(JobAck(accepted=False, node=node, reason=f"bad_job: {exc}")))
            return
        try:
            data = await self.bus.send_job(node, job, dict(msg.headers) if msg.headers else None)
            ack = decode(data, JobAck)
            answer = "accepted" if ack.accepted else "refused"
        except NoAgent:
            answer, data = "no_responders", encode(JobAck(accepted=False, node=node, reason=JOB_NO_RESPONDERS))
        except (NodeSilent, WireError) as exc:  # it may run the job (an answer that does not decode: the same)
            self.log.warning("job_unanswered", request_id=attempt_id, node=node, error=repr(exc))
            data = encode(JobAck(accepted=False, node=node, reason=JOB_UNANSWERED))
        self._record(f, arbiter, attempt_id, head, node, answer, ack if answer == "accepted" else None)
        await self.bus.respond(msg.reply, data)

    def _record(self, f: Flight, arbiter: Arbiter, attempt_id: str, head: JobHead, node: str, answer: Answer,
                ack: JobAck | None) -> None:
        arbiter.answer(node, answer)
        self.m.jobs.labels(answer).inc()
        current = f.attempt_id == attempt_id and not f.lc.ended
        if ack is not None and current:
            self.flights.routed(f, attempt_id, head.kind, node, head.predicted_ttft_ms, ack.epoch_unix_ms)
        elif ack is not None:  # the attempt ended or moved while its job was out: its cancel may have come first
            self.bg.spawn(self.bus.cancel(attempt_id, "superseded"), "cancel_late_job")
        elif answer == "silent" and current and f.watched:
            arbiter.end()
            f.lost = True
            f.queue.put_nowait(Interrupted(attempt_id, f"node {node} did not answer its job in time; it may run it"))
