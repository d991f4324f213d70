"""The in-flight registry: every request being served, keyed by its current bus id, and the bus events for it.

A request's **flight** (:class:`Flight`) holds its lifecycle (:class:`~.lifecycle.RequestLifecycle`:
which attempt is followed, where it runs) and the I/O bits: the queue its relay reads, the senders
its current attempt accepts out events from, how it was sent to the dispatchers. :class:`Flights` maps each flight's
current attempt id (``<id>``, then ``<id>-r1`` … after a re-submission) to it and takes in the bus
events addressed to in-flight requests:

* **out events** (``kairos.out.<attempt id>.<sender>``: tokens, done, errors, KV handoffs) go to the
  queue of the flight whose current attempt they belong to, if their sender is accepted
  (:class:`~.senders.Senders`: the node the attempt's job went to, the decode node its prefill node
  handed the KV to, a dispatcher for errors); an event of another sender is held until its sender is
  accepted, or refused as forged (``kairos_ingress_forged_messages_total{kind="out_event"}``);
* **a node's acceptance of the attempt's job** (the ingress sends every job itself,
  :mod:`.jobrelay`) tells the flight where its attempt runs (lifecycle, senders, the TTFT the decision
  predicted): :meth:`Flights.routed`;
* **notices** (the attempt's notice subject, dispatchers only): the routing of a queued attempt goes on.

Besides its bus events, the relay's queue receives the watchers' verdicts (:mod:`.liveness`): the
queue items below. No I/O here beyond handing events to queues.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard
from kairos.contracts.events import ErrorEvent, HandoffEvent, OutEvent, TokenEvent
from kairos.core.cluster.arbiter import Arbiter
from kairos.core.cluster.heartbeat import Liveness
from kairos.core.cluster.recent import RecentIds
from kairos.core.vocabulary import PathKind
from kairos.runtime.clock import Clock
from kairos.runtime.messaging import decoded
from kairos.services.ingress.lifecycle import RequestLifecycle
from kairos.services.ingress.senders import Senders


@dataclass
class NodeLost:
    """Queue item: a node the request depends on is dead (liveness timeout, or it restarted)."""

    node: str
    attempt_id: str


@dataclass
class Interrupted:
    """Queue item: the attempt's stream lost events (silent after a bus outage)."""

    attempt_id: str
    detail: str


@dataclass
class BusDown:
    """Queue item: NATS has been unreachable for ``outage_s`` seconds."""

    outage_s: float


class ClientGone:
    """Queue item: the HTTP client closed its connection."""


class Shutdown:
    """Queue item: this ingress is stopping; end the request with an explicit error now."""


#: attempt ids given up (moved, re-submitted, ended) whose late events the ingress still recognises
ABANDONED_REMEMBERED = 10_000

#: what a relay's queue carries: out events of its attempts and the watchers' verdicts
QueueItem = OutEvent | NodeLost | Interrupted | BusDown | ClientGone | Shutdown


@dataclass
class Flight:
    """One in-flight request: its lifecycle (where it is and what it may do) plus the I/O bits.

    ``request``: the client's HTTP request (anything with aiohttp's ``transport``: a closed one means
    the client left).
    """

    lc: RequestLifecycle
    queue: asyncio.Queue
    request: Any
    lost: bool = False  #: a NodeLost/Interrupted was queued for the current attempt
    client_gone: bool = False
    shutting_down: bool = False  #: the ingress is closing (a :class:`Shutdown` is queued)
    bus_down: bool = False  #: a BusDown was queued
    checking: bool = False  #: a prefill-record lookup is running
    quiet_deadline: float | None = None  #: monotonic s: after a reconnect, an event must arrive by then
    #: node -> its incarnation when this request first depended on it (a newer one = restarted, lost)
    dep_epochs: dict[str, float] = field(default_factory=dict)
    #: (decision kind, its TTFT estimate in ms) from the job a node accepted for the current attempt
    predicted: tuple[PathKind, float] | None = None
    #: whose out events the current attempt accepts (the node its job went to, ...)
    senders: Senders = field(default_factory=lambda: Senders(""))
    #: what the current attempt is sent to the dispatchers as (its encoded request, headers), set before
    #: the first copy goes: a routing gone silent is sent again, the same bytes and bus id, and a
    #: dispatcher's job — which may come back before ``taken`` — comes without the request, spliced in
    #: from here (kairos/services/ingress/jobrelay.py)
    sent: tuple[bytes, dict[str, str]] | None = None
    #: the last sign of its routing (monotonic s: a replica took it, said it goes on, or handed back a
    #: job); None until a replica took it
    enqueued_at: float | None = None
    deliveries: int = 0  #: copies sent so far
    moving: bool = False
    #: which nodes the current attempt's jobs went to and what they answered (kairos/core/cluster/arbiter.py)
    arbiter: Arbiter = field(default_factory=Arbiter)

    def abandoned(self) -> bool:
        """Nobody waits for this request any more (its client left, or the ingress is closing): an
        enqueue still trying to reach a dispatcher gives up (:class:`~.ports.EnqueueAbandoned`)."""
        return self.client_gone or self.shutting_down

    @property
    def attempt_id(self) -> str:
        return self.lc.attempt_id

    @property
    def watched(self) -> bool:
        """The watchers may still queue a verdict for it (none queued yet, client there, not ended)."""
        return not (self.lost or self.client_gone or self.lc.ended)

    def new_attempt(self, attempt_id: str) -> None:
        """Forget what concerned the previous attempt (its liveness evidence, prediction, senders, routing)."""
        self.lost = self.checking = False
        self.quiet_deadline = None
        self.dep_epochs.clear()
        self.predicted = None
        self.senders = Senders(attempt_id)
        self.sent, self.enqueued_at, self.deliveries = None, None, 0  # nothing of the previous attempt is sent again
        self.arbiter.end()  # a job the previous attempt's dispatcher still plans is not sent
        self.arbiter = Arbiter()


class Flights:
    """Every in-flight request by current attempt id, and the intake of their bus events.

    Args:
        origin: refuses (counts, logs) out events whose sender the bus does not prove.
        liveness: node liveness (a token is a sign of life of its node; a routed node is watched).
        clock: monotonic s for the liveness tracker and the routings' last signs.
        log: the service's structured logger.
    """

    def __init__(self, origin: OriginGuard, liveness: Liveness, clock: Clock, log: Any) -> None:
        self.origin, self.liveness, self.clock, self.log = origin, liveness, clock, log
        self._by_attempt: dict[str, Flight] = {}
        #: attempts this ingress gave up (moved, re-submitted, ended) lately: their late events are fenced
        self.abandoned = RecentIds(ABANDONED_REMEMBERED)
        self._fenced = RecentIds(ABANDONED_REMEMBERED)  #: those whose node was told to stop already
        #: ``(attempt id, why)`` for the ingress to act on a late event (the service: count it; cancel
        #: the attempt on its node once, ``fence``): set by :meth:`~.service.Ingress.assemble`
        self.late: Callable[[str, OutEvent, bool], None] | None = None

    # -- the registry ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_attempt)

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_attempt)

    def get(self, attempt_id: str) -> Flight | None:
        return self._by_attempt.get(attempt_id)

    def values(self) -> list[Flight]:
        """A snapshot of the flights (safe to iterate while they change)."""
        return list(self._by_attempt.values())

    def bind(self, flight: Flight, attempt_id: str) -> None:
        """Route ``attempt_id``'s events to ``flight`` from now on (and no longer its earlier attempt's);
        events held for the attempt given up are refused: its job's node never vouched for them."""
        self.forget(flight)
        self._by_attempt[attempt_id] = flight
        self.refuse_held(flight)
        flight.new_attempt(attempt_id)

    def forget(self, flight: Flight) -> None:
        """``flight`` ended (or its attempt was given up): no event reaches it any more; a late event of
        its attempt fences the node that sent it (:meth:`on_out`)."""
        for k in [k for k, f in self._by_attempt.items() if f is flight]:
            del self._by_attempt[k]
            self.abandoned.add(k)

    # -- bus events --------------------------------------------------------------------------------
    async def on_out(self, msg: Any) -> None:
        """An out event (``kairos.out.<attempt id>.<sender>``): to the queue of the request whose
        current attempt it belongs to, if its sender is accepted (:class:`Senders`); events of
        finished or superseded attempts are dropped here."""
        where = S.out_origin(msg.subject)
        f = self._by_attempt.get(where[0]) if where is not None else None
        if f is None:
            if where is not None and where[0] in self.abandoned:
                self._late(where[0], msg)
            return
        if (ev := decoded(msg.data, OutEvent, self.log, "bad_out_event", subject=msg.subject)) is None:  # type: ignore[arg-type]
            return
        if not self.origin.check(msg, "out_event", where[1], None, request_id=where[0]):
            return  # a JetStream delivery (kairos/contracts/origin.py)
        why = f.senders.judge(msg.subject, where[1], ev)
        if why == "held":
            return
        if why is not None:
            self._refuse_out(msg.subject, why, where[1], ev)
            return
        self._deliver(f, ev)
        if isinstance(ev, HandoffEvent):
            self._release(f)
        elif isinstance(ev, TokenEvent):  # it streams from its node: nothing held can be accepted any more
            self.refuse_held(f)

    async def on_notice(self, msg: Any) -> None:
        """A dispatcher's notice on an attempt's notice subject (``alive``: its routing goes on):
        the attempt is not sent again for :attr:`IngressConfig.route_stall_s` (.liveness)."""
        f = self._by_attempt.get(msg.subject.rpartition(".")[2])
        if f is not None and f.enqueued_at is not None:
            f.enqueued_at = self.clock.monotonic()

    def routed(self, f: Flight, attempt_id: str, kind: PathKind, node: str, predicted_ttft_ms: float | None,
               node_epoch_unix_ms: float) -> None:
        """``node`` accepted the job of ``f``'s attempt ``attempt_id`` that this ingress sent it
        (``predicted_ttft_ms``: the decision's estimate, ms; ``node_epoch_unix_ms``: the incarnation
        that accepted, 0 = not said): its events are accepted from now on."""
        f.lc.on_routed(attempt_id, kind, node)
        if attempt_id == f.attempt_id:
            f.predicted = None if predicted_ttft_ms is None else (kind, predicted_ttft_ms)
            f.senders.routed(node, kind)
            if node_epoch_unix_ms:  # the incarnation that accepted: a later one lost it (issue 33)
                f.dep_epochs[node] = node_epoch_unix_ms
            self._release(f)
        self.liveness.watch(node, self.clock.monotonic() * 1000.0)

    def _late(self, attempt_id: str, msg: Any) -> None:
        """An event of an attempt this ingress gave up (fencing, issue 33): a node that was paused or
        cut off while its request moved still runs it. Dropped (never relayed: the client follows
        the new attempt), counted, and the first token of it gets the node told to stop: the cancel
        it missed. Not a forgery: the sender did hold the attempt."""
        if (ev := decoded(msg.data, OutEvent, self.log, "bad_out_event", subject=msg.subject)) is None:  # type: ignore[arg-type]
            return
        fence = isinstance(ev, TokenEvent) and attempt_id not in self._fenced
        if fence:
            self._fenced.add(attempt_id)
        if self.late is not None:
            self.late(attempt_id, ev, fence)

    def _deliver(self, f: Flight, ev: OutEvent) -> None:
        if isinstance(ev, HandoffEvent):  # who may send tokens (Senders), and what the request depends on now
            if ev.request_id == f.attempt_id:
                f.lc.on_handoff(ev.request_id, ev.decode_node)
                if ev.decode_epoch_unix_ms:  # the decode agent's incarnation that took the KV (issue 33)
                    f.dep_epochs[ev.decode_node] = ev.decode_epoch_unix_ms
            return
        if isinstance(ev, TokenEvent):  # a token is a sign of life of its node
            self.liveness.heard(ev.node, self.clock.monotonic() * 1000.0)
        if ev.request_id == f.attempt_id:
            f.quiet_deadline = None
        f.queue.put_nowait(ev)

    def _release(self, f: Flight) -> None:
        """Deliver the held events whose sender is accepted now (a routing or handoff event came)."""
        ok, refused = f.senders.release()
        for h, why in refused:
            self._refuse_out(h.subject, why, h.node, h.event)
        for ev in ok:
            self._deliver(f, ev)

    def refuse_held(self, f: Flight) -> None:
        """Give up the events held for ``f``'s attempt (counted and logged as forged)."""
        for h in f.senders.refuse_held():
            self._refuse_out(h.subject, "not_the_jobs_node", h.node, h.event)

    def _refuse_out(self, subject: str, why: str, sender: str | None, ev: OutEvent) -> None:
        claimed = ev.source if isinstance(ev, ErrorEvent) else ev.node
        self.origin.refuse(subject, "out_event", why, sender, claimed, request_id=ev.request_id,
                           event_type=type(ev).__name__)
