"""The routing of one request: decide, send the job, and re-route until a node accepts it.

Per try (the rules are in :mod:`kairos.core.cluster.routing`, the decision in :mod:`kairos.core.policy`):

1. snapshot from the replica's :class:`~kairos.services.dispatcher.state.RoutingState` (view, routed
   events, reservations and this replica's pending deflections) minus the nodes excluded so far
   (:meth:`~kairos.services.dispatcher.state.RoutingState.snapshot`: the per-view work is done once
   per view, not per try);
2. the policy decides; a deflection onto a decode node whose slots are all held becomes a keep
   (rule 3, :func:`kairos.core.cluster.routing.decide_within_slots`);
3. the job goes to the node through the request's ingress, which sends it and relays the node's
   answer (:class:`~kairos.services.dispatcher.jobs.JobLink`; the ingress's arbiter lets one job of
   an attempt out at a time and none after a node accepted it). A refusal excludes the node and
   routing starts over — a re-route, never a drop. A decode node refusing a deflection beyond its
   slots (``deflection_in_flight``) is shown full instead. No responder is the bus's fault while the
   node is live in the view: routing starts over after a short backoff without excluding it, for at
   most ``bus_retry_s`` (:mod:`kairos.services.dispatcher.busretry`). ``cancelled``: the ingress ended
   the attempt, moved it (its node did not answer in time: it may run it) or another copy's job runs;
   the ingress gone (:class:`~kairos.services.dispatcher.jobs.IngressGone`): nobody waits for it;
4. accepted: :meth:`Outcomes.accepted` (routing event, span attributes, decision record).

Nothing routable for ``no_node_wait_s`` (or every node refused) → :data:`ErrorCode.NO_AVAILABLE_NODE`.

The loop's state across tries is one :class:`RouteAttempt` value. The router takes its bus
(``link``), its outcomes and its clock as arguments: tests/unit/test_dispatcher_route.py runs it
with fakes; the nats-server tests (tests/integration/test_dispatcher*.py, …) run it for real.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import JOB_CANCELLED, JOB_UNANSWERED, InferenceRequest, Job, JobAck
from kairos.core.cluster.routing import decide_within_slots, make_job, reservation_ttl_s
from kairos.core.cluster.snapshot import ClusterSnapshot
from kairos.core.model.latency import LatencyModel
from kairos.core.policy import Decision, Policy
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.services.dispatcher import faults
from kairos.services.dispatcher.busretry import BusRetry
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.jobs import IngressGone, JobLink
from kairos.services.dispatcher.metrics import DispatcherMetrics
from kairos.services.dispatcher.outcome import Outcomes
from kairos.services.dispatcher.state import RoutingState

#: after a reconnect, "no responders" for this long does not exclude a node (agents reconnect
#: at their own pace, up to reconnect_time_wait + jitter later)
RECONNECT_SETTLE_S = 3.0
#: backoff (s) of a job that found no agent while NATS just came back here (its agent may not have
#: re-subscribed yet)
SETTLING_RETRY_S = 0.2
#: how often (s) a routing waiting for its own NATS connection looks again
RECONNECT_POLL_S = 0.05
#: answers after which a routing stops (the span's outcome): the ingress sent no job (the attempt
#: ended, runs elsewhere or moved), the node did not answer the ingress in time (it may run the job:
#: the ingress moves the attempt under a new id), the ingress is gone (nobody waits for the request)
ROUTING_OVER = {JOB_CANCELLED: "cancelled", JOB_UNANSWERED: "moved", "ingress_gone": "ingress_gone"}


def no_live_nodes(view: Any) -> str:
    """Why nothing is routable, for the 503's message: the roles without a live (fresh, accepting)
    node in ``view`` (a :class:`~kairos.contracts.wire.ClusterView`; None: no view yet)."""
    if view is None:
        return "no cluster view yet (is the state aggregator running?)"
    live = {n.role for n in view.nodes if not n.stale and n.accepting}
    missing = [role for role in ("prefill", "decode") if role not in live]
    return f"no live {' and '.join(missing)} node" if missing else "no routable node"


@dataclass
class RouteAttempt:
    """One request's routing across its tries (the loop state of :meth:`Router.route`).

    Attributes:
        req: the request.
        max_attempts: tries (bus retries not counted) before giving up: 2 × nodes in the view + 4.
        hits: node → prompt tokens its prefix cache holds (prefix-aware policies).
        bus_retry: the bus-fault retries and their budget.
        excluded: node → why it is left out (it refused, or did not answer past the retries).
        conflicts: decode nodes that refused a deflection for want of a slot, in order.
        full: decode nodes this routing found without a free slot (shown full to the policy).
        attempts: jobs sent so far.
        decide_ms: policy time summed over the tries, ms.
        waited_since: monotonic s since when no node was routable (None: routable).
        started: ``time.perf_counter()`` at the first try (the routing time's start).
    """

    req: InferenceRequest
    max_attempts: int
    hits: dict[str, int]
    bus_retry: BusRetry
    excluded: dict[str, str] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    full: set[str] = field(default_factory=set)
    attempts: int = 0
    decide_ms: float = 0.0
    waited_since: float | None = None
    started: float = field(default_factory=time.perf_counter)

    def refused(self, node: str, why: str) -> None:
        """``node`` refused the job (``deflection_in_flight``: its slots are taken — shown full)."""
        if why == "deflection_in_flight":
            self.full.add(node)
            self.conflicts.append(node)
        else:
            self.excluded[node] = why

    def spent(self) -> bool:
        """Every try was used (bus retries are bounded by their own budget)."""
        return self.attempts - self.bus_retry.retries >= self.max_attempts

    def routing_ms(self) -> float:
        """Dequeue to now, ms."""
        return (time.perf_counter() - self.started) * 1000.0


class Router:
    """Routes requests one at a time per task (see the module docstring); one per replica.

    Args:
        cfg: the replica's configuration (slots, TTLs, timeouts, waits).
        state: what the replica knows of the cluster.
        link: sends jobs to nodes (a fake in unit tests).
        outcomes: tells how each routing ended.
        metrics: the replica's metrics.
        policy: the routing policy.
        model: the latency model (:meth:`use_model` replaces it on a hot reload).
        clock: wall and monotonic clocks, sleeps.
        stop: set when the replica stops (a routing waiting for NATS gives up).
    """

    def __init__(self, cfg: DispatcherConfig, state: RoutingState, link: JobLink, outcomes: Outcomes,
                 metrics: DispatcherMetrics, policy: Policy, model: LatencyModel, *,
                 clock: Clock = SYSTEM_CLOCK, stop: asyncio.Event | None = None) -> None:
        self.cfg, self.state, self.link, self.outcomes, self.m = cfg, state, link, outcomes, metrics
        self.policy, self.clock = policy, clock
        self.stop = stop or asyncio.Event()
        self.use_model(model)

    def use_model(self, model: LatencyModel) -> None:
        """Decide with ``model`` from the next try on (its engine's chunk budget sets the params)."""
        self.model = model
        self.params = self.cfg.params(model.engine.max_num_batched_tokens)

    def attempt(self, req: InferenceRequest) -> RouteAttempt:
        """A fresh :class:`RouteAttempt` for ``req``."""
        nodes = self.state.node_count()
        return RouteAttempt(req=req, max_attempts=2 * (nodes if nodes is not None else 4) + 4,
                            hits=self.state.prefix_hits(req),
                            bus_retry=BusRetry(self.cfg.bus_retry_s, self.clock.monotonic))

    async def route(self, req: InferenceRequest, msg: Any, span: Any, log: Any) -> None:
        """Route ``req`` until a node accepts it, it is cancelled (or its ingress is gone), or it
        fails (an error event to its client). ``msg`` (:class:`~kairos.services.dispatcher.intake.RouteMessage`)
        names the ingress's conversation subject (``notices``: jobs go there) and is told
        ``in_progress()`` while the routing waits.

        Raises:
            ConnectionError: this replica's NATS stayed down until the request's deadline.
        """
        at = self.attempt(req)
        while not await self._try(at, msg, span, log):
            pass

    async def _try(self, at: RouteAttempt, msg: Any, span: Any, log: Any) -> bool:
        """One try; True when the routing is over."""
        req, rid = at.req, at.req.request_id
        if rid in self.state.cancelled:  # its cancel came in while it was being routed: send no job
            span.set_attribute("kairos.outcome", "cancelled")
            log.info("request_cancelled_while_routing", attempts=at.attempts)
            return True
        now = self.clock.now_ms()
        snap, held = self.state.snapshot(req, at.excluded, at.full, at.hits, self.cfg.max_deflections_per_node, now)
        if snap is None:
            return await self._no_node(at, msg, span)
        t0 = time.perf_counter()
        decision = decide_within_slots(self.policy, snap, self.model, self.params, held, at.full,
                                       self.cfg.max_deflections_per_node)
        at.decide_ms += (time.perf_counter() - t0) * 1000.0
        resv_ttl = 0
        if decision.deflected:  # its slot is held here until the node answers
            resv_ttl = reservation_ttl_s(decision, self.cfg.reservation_ttl_s)
            self.state.hold_deflection(req, decision.node, self.cfg.replica_id, now)
        faults.die("after_decide")
        at.attempts += 1
        job = make_job(decision, req, snap, self.cfg.replica_id, at.attempts - 1, resv_ttl)
        if not decision.deflected:  # count it in the view at once; the node's ack replaces it
            self.state.provisional(req, decision.node, decision.decode_node)
        ack, why = await self._send(decision.node, job, msg.notices)
        self._settle_slot(rid, decision, ack, why)
        if why in ROUTING_OVER:  # the ingress ended or moved this attempt, or is gone: route it nowhere
            self.state.forget_routed(rid)
            self.state.cancelled.add(rid)
            span.set_attribute("kairos.outcome", ROUTING_OVER[why])
            log.info("routing_ended_by_ingress", why=why, node=decision.node, attempts=at.attempts)
            return True
        if why is not None:
            if await self._bus_fault(at, decision.node, why, msg, log):
                return False
            return await self._refused(at, decision, why, span, log)
        faults.die("after_accept")
        await self._accept(at, decision, ack, snap, span)
        return True

    async def _send(self, node: str, job: Job, via: str | None) -> tuple[JobAck | None, str | None]:
        """Hand ``job`` for ``node`` to the ingress at ``via``: (the answer, None) when the node
        accepted, else (the answer or None, why: the node's reason, the ingress's ``no_responders``
        / ``timeout`` / ``cancelled``, or ``ingress_gone``)."""
        if via is None:  # a request without a conversation subject cannot be relayed (an older ingress)
            return None, "ingress_gone"
        if faults.armed("after_publish"):  # the job reaches the ingress; this replica dies before the answer
            await self.link.send_unanswered(node, job, via)
            faults.die("after_publish")
        try:
            ack = await self.link.request(node, job, via)
        except IngressGone:
            return None, "ingress_gone"
        return ack, None if ack.accepted else (ack.reason or "refused")

    def _settle_slot(self, rid: str, decision: Decision, ack: JobAck | None, why: str | None) -> None:
        """Answered or failed, the job no longer holds a slot here: accepted, the node's own
        reservation (stored before its answer, which carries it) takes over."""
        if why is None and ack.reservation_key and ack.reservation is not None and ack.reservation_revision:
            self.state.apply_reservation(ack.reservation_key, ack.reservation, ack.reservation_revision)
        unconfirmed = (why is None and decision.deflected and ack.reason != "duplicate"
                       and ack.reservation_revision is None)  # held here until it expires
        if not unconfirmed:
            self.state.release_deflection(rid)

    async def _no_node(self, at: RouteAttempt, msg: Any, span: Any) -> bool:
        """Nothing routable: wait for a newer view up to ``no_node_wait_s`` (a migrated request's
        continuation: ``migration_node_wait_s``, within its deadline), then 503."""
        if at.waited_since is None:
            span.add_event("waiting_for_nodes", {"excluded": [f"{k}:{v}" for k, v in at.excluded.items()]})
            at.waited_since = self.clock.monotonic()
        wait_s = self.cfg.no_node_wait_s
        if at.req.resume is not None:
            wait_s = min(max(wait_s, self.cfg.migration_node_wait_s),
                         (at.req.deadline_unix_ms - self.clock.now_ms()) / 1000.0)
        left = wait_s - (self.clock.monotonic() - at.waited_since)
        if left <= 0 or at.excluded:
            why = "every node refused or did not answer" if at.excluded else no_live_nodes(self.state.view)
            excluded = f" (excluded: {at.excluded})" if at.excluded else ""
            await self.outcomes.error(at.req, ErrorCode.NO_AVAILABLE_NODE, why + excluded, span)
            return True
        self.state.view_changed.clear()
        await self.clock.wait_event(self.state.view_changed, min(left, 1.0))
        await msg.in_progress()
        return False

    async def _bus_fault(self, at: RouteAttempt, node: str, why: str, msg: Any, log: Any) -> bool:
        """The job failed with ``why``: when that is the bus's fault (busretry.py) or this replica
        is disconnected, wait and return True (route again, ``node`` not excluded)."""
        rid = at.req.request_id
        wait = None
        if self.link.connected() and self.clock.now_ms() < at.req.deadline_unix_ms:
            wait = at.bus_retry.wait_s(why, self.state.node_live(node))
            if wait is None and why == "no_responders" and self.link.settling(RECONNECT_SETTLE_S):
                wait = SETTLING_RETRY_S  # NATS just came back here: the node's agent may not have re-subscribed yet
        if wait is not None:  # the bus's fault, not the node's: not excluded
            log.info("job_retry_bus_fault", node=node, why=why, attempt=at.attempts, wait_s=round(wait, 3))
            self.m.bus_retries.labels(why).inc()
            self.state.forget_routed(rid)
            await self.clock.sleep(wait)
            await msg.in_progress()
            return True
        if self.link.connected():
            return False
        # our own bus is down, not the node: wait for it (nothing excluded); the ingress's arbiter
        # makes a job that did reach the node safe to plan again
        log.info("job_send_disconnected", node=node, why=why)
        self.state.forget_routed(rid)
        while not self.link.connected() and self.clock.now_ms() < at.req.deadline_unix_ms and not self.stop.is_set():
            await self.clock.sleep(RECONNECT_POLL_S)
        if not self.link.connected():
            raise ConnectionError("NATS unavailable until the request's deadline")
        await msg.in_progress()
        return True

    async def _refused(self, at: RouteAttempt, decision: Decision, why: str, span: Any, log: Any) -> bool:
        """``decision.node`` refused (or stayed silent past the retries): re-route, or 503 once
        every try is spent."""
        node = decision.node
        self.state.forget_routed(at.req.request_id)
        self.m.reroutes.labels(why.split(":")[0]).inc()
        span.add_event("job_rerouted", {"kairos.node": node, "why": why, "attempt": at.attempts,
                                        "kairos.decision": decision.decision})
        log.info("job_rerouted", node=node, why=why, attempt=at.attempts)
        if why == "deflection_in_flight":
            self.m.conflicts.labels("node_refused").inc()
            span.add_event("reservation_conflict", {"kairos.node": node, "source": "node_refused"})
        at.refused(node, why)
        if at.spent():
            await self.outcomes.error(at.req, ErrorCode.NO_AVAILABLE_NODE,
                                      f"gave up after {at.attempts} attempts: {at.excluded}", span)
            return True
        return False

    async def _accept(self, at: RouteAttempt, decision: Decision, ack: JobAck, snap: ClusterSnapshot,
                      span: Any) -> None:
        view = self.state.view
        # draining nodes were left out of the snapshot: the record says so (issue 33)
        excluded = {**{n.node: "draining" for n in view.nodes if n.draining}, **at.excluded} if view else at.excluded
        await self.outcomes.accepted(at.req, decision, ack, state_age_ms=snap.state_age_ms, attempts=at.attempts,
                                     excluded=excluded, conflicts=at.conflicts, decide_ms=at.decide_ms,
                                     routing_ms=at.routing_ms(), view_seq=view.seq if view else 0, span=span)
