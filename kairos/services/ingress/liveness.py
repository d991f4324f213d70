"""Heartbeat intake and the watchers of in-flight requests: who is alive, and which requests lost their node.

Where data comes from: every node's heartbeats (``kairos.state.<node>``, validated as the aggregator
validates them: epoch, sequence, clock skew; :func:`kairos.core.cluster.heartbeat.accept_heartbeat`),
the tokens of each request (a sign of life of their node, :mod:`.flights`), the client connections,
the bus connection's state. Where it goes: verdicts queued to the relay of each affected request
(:class:`~.flights.NodeLost`, :class:`~.flights.Interrupted`, :class:`~.flights.BusDown`,
:class:`~.flights.ClientGone`), whose lifecycle decides (re-submit or end).

Every ``disconnect_poll_s`` (:meth:`FlightWatch.run`):

* **clients**: a closed connection (aiohttp does not cancel the handler) → ClientGone;
* **node lost**: a node silent — no heartbeat and no token — for ``liveness_timeout_s``, or for 3
  of its own heartbeat periods where that is longer (up to a minute), is dead (positive evidence;
  routing staleness is not enough, the aggregator is not needed), and so is a node with a newer
  incarnation than when the request started depending on it (restarted). On the keep path before
  the first token, a dead prefill or decode node is first checked against the prefill record (was
  the KV handed off, and to whom?): the decision's decode node alone does not count, the prefill
  agent tries the other candidates;
* **quiet streams**: after a reconnect, a routed request with no event for ``outage_grace_s`` lost
  its stream;
* **routings**: a queued request whose routing went silent (its dispatcher died, or its NATS member)
  is sent to the dispatchers again, the same bytes and bus id;
* **bus down**: NATS unreachable for ``bus_outage_timeout_s`` ends every request (503 ``bus_unavailable``).

A watcher that wakes :data:`LOOP_STALL_S` late means this process stalled: the nodes' silence over
that gap is no evidence (:meth:`Liveness.stalled`).
"""

from __future__ import annotations

from typing import Any

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard
from kairos.contracts.wire import NodeStateHead, WireError, decode
from kairos.contracts.records import PrefillTiming
from kairos.core.cluster.heartbeat import HeartbeatGuard, Liveness, accept_heartbeat
from kairos.core.vocabulary import KEEP
from kairos.runtime.clock import Clock
from kairos.runtime.resources import BackgroundTasks
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.flights import BusDown, ClientGone, Flight, Flights, Interrupted, NodeLost
from kairos.services.ingress.lifecycle import Phase
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.readiness import ReadyView
from kairos.services.ingress.ports import IngressBus

#: the watcher woke this much (s) later than due: this process stalled, and the silence of the
#: nodes over that gap is not evidence (Liveness.stalled)
LOOP_STALL_S = 0.25


class FlightWatch:
    """Heartbeat intake and the periodic checks of every in-flight request (module docstring).

    Args:
        cfg: the ingress's configuration (timeouts, poll interval).
        flights: the in-flight registry.
        liveness: node liveness, fed by heartbeats here and by tokens (:mod:`.flights`).
        bus: the bus operations (prefill records, sending a request again).
        metrics, origin, bg, clock, log: the service's metrics, origin guard, background tasks,
            clocks and logger.
    """

    def __init__(self, cfg: IngressConfig, flights: Flights, liveness: Liveness, bus: IngressBus,
                 metrics: IngressMetrics, origin: OriginGuard, bg: BackgroundTasks, clock: Clock, log: Any) -> None:
        self.cfg, self.flights, self.liveness, self.bus = cfg, flights, liveness, bus
        self.m, self.origin, self.bg, self.clock, self.log = metrics, origin, bg, clock, log
        self.guard = HeartbeatGuard(max_future_ms=cfg.heartbeat_max_future_ms)
        self.roles: dict[str, str] = {}  #: node -> role (heartbeats, views)
        self.dead_nodes: set[str] = set()  #: nodes silent past the liveness timeout

    def _mono_ms(self) -> float:
        return self.clock.monotonic() * 1000.0

    # -- intake ----------------------------------------------------------------------------------
    async def on_state(self, msg: Any) -> None:
        """A heartbeat: validated (epoch/seq/future, like the aggregator), then it is a sign of life."""
        try:
            st = decode(msg.data, NodeStateHead)  # only what liveness reads (the state itself is the aggregator's)
        except WireError:
            return
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # another node's heartbeat could declare it restarted or alive (kairos/contracts/origin.py)
        why = accept_heartbeat(self.guard, self.liveness, st, self.clock.now_ms(), self._mono_ms())
        if why is not None:  # refused: no sign of life (kairos/core/cluster/heartbeat.py accept_heartbeat)
            self.m.hb_rejected.labels(why).inc()
            return
        self.roles[st.node] = st.role

    def on_view(self, view: ReadyView) -> None:
        """The view is for routing and /health only: a stale node or one missing from the view
        (e.g. a restarted aggregator's first views) is *not* dead for in-flight requests."""
        self.roles.update((n.node, n.role) for n in view.nodes)

    def on_bus_lost(self) -> None:
        self.liveness.pause()  # we hear nobody now; that is not the nodes' fault
        self.log.warning("bus_lost", in_flight=len(self.flights))

    def on_bus_back(self) -> None:
        """NATS is back: restart every node's liveness clock, and give each in-flight request
        ``outage_grace_s`` to show its stream is still alive."""
        self.liveness.resume(self._mono_ms())
        grace = self.clock.monotonic() + self.cfg.outage_grace_s
        for f in self.flights.values():
            f.quiet_deadline = grace

    # -- the periodic checks ---------------------------------------------------------------------
    async def run(self) -> None:
        """Every ``disconnect_poll_s``: :meth:`check` (a failed check is logged; the watcher goes on)."""
        due = self.clock.monotonic() + self.cfg.disconnect_poll_s
        while True:
            await self.clock.sleep(max(due - self.clock.monotonic(), 0.0))
            late_s = self.clock.monotonic() - due
            due = self.clock.monotonic() + self.cfg.disconnect_poll_s
            if late_s > LOOP_STALL_S:  # this process did not run: the nodes were not silent, we were deaf
                self.liveness.stalled(late_s * 1000.0)
                self.log.warning("ingress_loop_stalled", stalled_s=round(late_s, 3))
            self.check_clients()
            try:
                self.check()
            except Exception as exc:  # never let the watcher die (logged; the next round checks again)
                self.log.error("flight_check_failed", error=repr(exc))

    def check_clients(self) -> None:
        """Clients that closed their connection (aiohttp does not cancel the handler)."""
        for f in self.flights.values():
            t = f.request.transport
            if not f.client_gone and (t is None or t.is_closing()):
                f.client_gone = True
                f.queue.put_nowait(ClientGone())

    def check(self) -> None:
        """Dead nodes, streams silent after a reconnect, silent routings, a bus down too long."""
        self.check_liveness()
        self.check_quiet()
        self.check_routes()
        since = self.bus.disconnected_since()
        if since is not None and self.clock.monotonic() - since > self.cfg.bus_outage_timeout_s:
            for f in self.flights.values():
                if not f.bus_down:
                    f.bus_down = True
                    f.queue.put_nowait(BusDown(self.clock.monotonic() - since))

    def check_liveness(self) -> None:
        """Queue a NodeLost for each request whose node is dead (the keep path before its first
        token: after reading the prefill record, :meth:`_check_handoff`)."""
        dead = self.liveness.dead_nodes(self._mono_ms())
        newly = dead - self.dead_nodes
        if newly:
            self.log.warning("nodes_lost", nodes=sorted(newly), in_flight=len(self.flights),
                             liveness_timeout_s=self.cfg.liveness_timeout_s)
        self.dead_nodes = dead
        decode_died = any(self.roles.get(n) == "decode" for n in newly)
        for f in self.flights.values():
            lc = f.lc
            if not f.watched:
                continue
            if lc.phase is Phase.ROUTED and lc.kind == KEEP and lc.handoff_node is None:
                if (lc.node in dead or decode_died or self._restarted(f, lc.node)) and not f.checking:
                    f.checking = True
                    self.bg.spawn(self._check_handoff(f, f.attempt_id), "check_handoff")
                continue
            node = lc.depends_on()
            if node is not None and (node in dead or self._restarted(f, node)):
                self._lost(f, node)
            elif (lc.phase is Phase.ROUTED and lc.kind == KEEP and lc.node is not None
                  and (lc.node in dead or self._restarted(f, lc.node))):
                # the KV was handed to a decode node that has not sent a token: it may still be pulling
                # from the prefill node that just died (issue 33); nothing reached the client, so the
                # request is sent again rather than left to that pull's failure or the idle timeout
                self._lost(f, lc.node)

    def _restarted(self, f: Flight, node: str | None) -> bool:
        """``node`` has a newer incarnation than when ``f`` started depending on it: the agent
        restarted (within the liveness timeout) and lost the request."""
        epoch = self.liveness.epoch(node) if node is not None else None
        if epoch is None:
            return False
        return f.dep_epochs.setdefault(node, epoch) != epoch

    async def _check_handoff(self, f: Flight, attempt_id: str) -> None:
        """Keep path: read the prefill record of the node that accepted the job (only it can write
        that key): a decode node that took the KV is what the request depends on now."""
        try:
            prefill_node = f.lc.node
            try:
                rec = (await self.bus.read_record(S.record_key(attempt_id, "prefill", prefill_node), PrefillTiming)
                       if prefill_node else None)
            except Exception as exc:  # the bucket did not answer: judged as if there were no record
                self.log.warning("prefill_record_read_failed", request_id=attempt_id, error=repr(exc))
                rec = None
        finally:
            f.checking = False
        lc = f.lc
        if lc.attempt_id != attempt_id or f.lost or f.client_gone or lc.phase is not Phase.ROUTED:
            return
        if rec is not None and rec.handoff_node:
            lc.on_handoff(attempt_id, rec.handoff_node)
        node = lc.depends_on()
        if node is not None and (node in self.dead_nodes or self._restarted(f, node)):
            self._lost(f, node)

    def _lost(self, f: Flight, node: str) -> None:
        f.lost = True
        f.queue.put_nowait(NodeLost(node=node, attempt_id=f.attempt_id))

    def check_quiet(self) -> None:
        """After a reconnect: a routed request that heard nothing within ``outage_grace_s`` lost its
        stream; one not routed yet keeps waiting (its job's answer or silence decides,
        kairos/services/ingress/jobrelay.py, and a silent routing is sent again, :meth:`check_routes`)."""
        now = self.clock.monotonic()
        for f in self.flights.values():
            if f.quiet_deadline is None or now < f.quiet_deadline or not f.watched:
                continue
            f.quiet_deadline = None
            if f.lc.phase is not Phase.QUEUED:
                f.lost = True
                f.queue.put_nowait(Interrupted(f.attempt_id, f"no event for {self.cfg.outage_grace_s:g} s after "
                                                             f"the bus came back"))

    def check_routes(self) -> None:
        """Queued attempts whose routing went silent (:attr:`IngressConfig.route_stall_s` since a
        dispatcher took it or last said it goes on: it died or was cut off) are sent again
        (:meth:`_resend`)."""
        now = self.clock.monotonic()
        for f in self.flights.values():
            if (not f.moving and f.sent is not None and f.enqueued_at is not None
                    and f.lc.phase is Phase.QUEUED and f.watched and now - f.enqueued_at > self.cfg.route_stall_s):
                f.moving = True
                self.bg.spawn(self._resend(f, f.attempt_id), "resend_route")

    async def _resend(self, f: Flight, attempt_id: str) -> None:
        """Send attempt ``attempt_id`` to the dispatchers again, the same bytes and bus id: the jobs
        of every copy meet the attempt's arbiter (kairos/services/ingress/jobrelay.py), which lets
        none go once a node accepted one. Never raises; a send that fails is tried again on a later check."""
        assert f.sent is not None
        body, headers = f.sent
        try:
            if f.attempt_id != attempt_id or f.lc.phase is not Phase.QUEUED:
                return
            sent = await self.bus.enqueue(body, headers, first_delivery=f.deliveries + 1)
            if f.attempt_id != attempt_id:  # re-submitted meanwhile
                return
            f.deliveries += sent
            self.log.info("request_resent", request_id=attempt_id, deliveries=f.deliveries)
            self.m.route_resends.inc()
        except Exception as exc:  # no dispatcher took it: the next check tries again
            self.log.info("route_resend_failed", request_id=attempt_id, error=repr(exc))
        finally:
            if f.attempt_id == attempt_id:
                f.enqueued_at = self.clock.monotonic()
            f.moving = False
