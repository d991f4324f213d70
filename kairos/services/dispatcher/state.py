"""What one dispatcher replica knows of the cluster when it decides: no I/O, fed by its watchers.

Inputs (each fed by :mod:`kairos.services.dispatcher.watch`, or by the routing of a request):

* the **cluster view** the state aggregator builds (``kairos.view``; the ``kairos_view`` bucket's last
  view once per declare; an older view is ignored, :func:`kairos.services.state_aggregator.view.newer`);
* the **deflection reservations** of the decode nodes (watched in ``kairos_reservations``, and taken
  from a node's job answer, whichever revision is newer), plus this replica's own **pending
  deflections** — the slot a deflection holds here from the decision until the decode node answers
  (at most :data:`PENDING_DEFLECTION_MS`), so this replica's next decisions see it taken at once;
* the **routed events** of every replica (``kairos.route.decided``) not yet in the view, and the
  provisional event of a keep job this replica is sending (folded into each snapshot,
  :func:`kairos.core.cluster.routing.fold_recent`);
* **cancelled** request ids (a cancel may come before the request is pulled);
* the nodes' **prefix caches** (heartbeats' cache events; prefix-aware policies only).

Output: :meth:`RoutingState.snapshot` — one request's policy snapshot, and the live reservations
(pending included) for rule 3. What depends only on the view is built once per view (a
:class:`~kairos.core.cluster.routing.SnapshotBuilder`, rebuilt when the view object changes) and
what depends on the reservations once per change of a node's reservations
(:class:`HeldReservations`, kept up to date by the methods that change them, and the builder's
:meth:`~kairos.core.cluster.routing.SnapshotBuilder.set_held`); each routed event is folded into
the builder once, when it is heard, forgotten or ages out. A request then costs a copy of the list
of node views plus the nodes it changes itself (its prefix hits, own reservations, ``full`` nodes),
instead of rebuilding every node and refolding every event (issue 19 §3).
:meth:`RoutingState.snapshot_inputs` is the straightforward form — the view with the recent events
folded in and the live reservations, for :func:`kairos.core.cluster.routing.build_snapshot` — the
oracle tests/unit/test_snapshot_builder.py and bench/snapshot_cost.py compare it with. Clocks come
from a :class:`kairos.runtime.clock.Clock` (monotonic s for the routed events' age, wall ms for
expiry).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from operator import itemgetter
from typing import Iterator

from kairos.contracts import subjects as S
from kairos.contracts.wire import ClusterView, InferenceRequest, NodeState, Reservation, RoutedEvent, WireError, decode
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.cluster.recent import RecentIds
from kairos.core.cluster.routing import SnapshotBuilder, fold_recent, live_reservations
from kairos.core.cluster.snapshot import ClusterSnapshot
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.services.state_aggregator.view import decode_if_newer

#: routed events kept for folding into the view (the aggregator folds them within one Δh)
RECENT_ROUTED_S = 5.0
#: cancelled request ids remembered (a request can wait in the queue while all dispatchers are down)
MAX_CANCELLED = 100_000
#: longest time (ms) a deflection job this replica sent holds its slot in this replica's view
#: before the node's answer (the job ack timeout is shorter; a safety net for a routing task that died)
PENDING_DEFLECTION_MS = 5000.0

#: a reservation :class:`HeldReservations` tracks: (WATCHED, its key) or (PENDING, its request id)
Entry = tuple[int, str]
WATCHED, PENDING = 0, 1
_ORDER = itemgetter(0)


class HeldReservations:
    """The live reservations — the watched ones (:attr:`RoutingState.reservations`) and this replica's
    pending deflections — grouped by decode node, updated per change instead of per request.

    ``live[node]`` is what :func:`kairos.core.cluster.routing.held_by_node` lists for the node from
    :meth:`RoutingState.snapshot_inputs`' reservations (a request holding none there): the node's
    reservations not expired at the last :meth:`refresh`, oldest first, ties in the order of that
    merged dict (the watched ones in their dict's insertion order, then the pending ones in
    theirs; each entry's rank copies its dict position). :meth:`refresh` re-sorts only the nodes
    a change or an expiry touched (an expiry heap), and lists them in ``changed``.
    Implements :class:`kairos.core.cluster.routing.SlotCounts` (rule 3).
    """

    def __init__(self) -> None:
        self._entries: dict[Entry, tuple[int, Reservation]] = {}  #: entry -> (its dict rank, reservation)
        self._nodes: dict[str, set[Entry]] = {}  #: decode node -> its entries
        self._requests: dict[str, set[Entry]] = {}  #: request id -> its entries
        self._expiry: list[tuple[float, int, Entry, Reservation]] = []  #: heap: (expiry ms, seq, entry, r)
        self._count = itertools.count()  #: ranks and heap sequence numbers
        self._dirty: set[str] = set()  #: nodes whose ``live`` list is out of date
        self._now = float("-inf")  #: the wall ms of the last refresh
        self.live: dict[str, list[Reservation]] = {}  #: decode node -> its live reservations (none: absent)
        self.changed: set[str] = set()  #: nodes whose ``live`` list a refresh rebuilt (their reader clears it)

    def put(self, entry: Entry, r: Reservation) -> None:
        """``entry`` now holds ``r`` (an entry already there keeps its rank, as a dict key its position)."""
        old = self._entries.get(entry)
        rank = old[0] if old is not None else next(self._count)
        if old is not None:
            self._unlink(entry, old[1])
        self._entries[entry] = (rank, r)
        self._nodes.setdefault(r.decode_node, set()).add(entry)
        self._requests.setdefault(r.request_id, set()).add(entry)
        self._dirty.add(r.decode_node)
        heapq.heappush(self._expiry, (r.expires_unix_ms, next(self._count), entry, r))
        if len(self._expiry) > 2 * len(self._entries) + 64:  # drop the heap's entries of replaced ones
            self._expiry = [(r.expires_unix_ms, next(self._count), e, r) for e, (_, r) in self._entries.items()]
            heapq.heapify(self._expiry)

    def pop(self, entry: Entry) -> None:
        """``entry`` is gone (released, deleted, or its pending deflection answered)."""
        old = self._entries.pop(entry, None)
        if old is not None:
            self._unlink(entry, old[1])

    def clear(self, kind: int) -> None:
        """Every entry of ``kind`` (WATCHED or PENDING) is gone."""
        for entry in [e for e in self._entries if e[0] == kind]:
            self.pop(entry)

    def _unlink(self, entry: Entry, r: Reservation) -> None:
        for index, key in ((self._nodes, r.decode_node), (self._requests, r.request_id)):
            entries = index[key]
            entries.discard(entry)
            if not entries:
                del index[key]
        self._dirty.add(r.decode_node)

    def refresh(self, now_unix_ms: float) -> None:
        """Bring ``live`` to ``now_unix_ms``: the nodes changed since, or with a reservation expired
        since (``expires_unix_ms`` ≤ now, as :func:`kairos.core.cluster.routing.live_reservations`),
        are re-listed; all of them when the wall clock stepped back (an expired one is live again)."""
        if now_unix_ms < self._now:
            self._dirty.update(self._nodes)
            self._expiry = [(r.expires_unix_ms, next(self._count), e, r) for e, (_, r) in self._entries.items()]
            heapq.heapify(self._expiry)
        else:
            heap = self._expiry
            while heap and heap[0][0] <= now_unix_ms:
                _, _, entry, r = heapq.heappop(heap)
                current = self._entries.get(entry)
                if current is not None and current[1] is r:
                    self._dirty.add(r.decode_node)
        self._now = now_unix_ms
        for node in self._dirty:
            keyed = []
            for entry in self._nodes.get(node, ()):
                rank, r = self._entries[entry]
                if r.expires_unix_ms > now_unix_ms:
                    keyed.append(((r.created_unix_ms, entry[0], rank), r))
            keyed.sort(key=_ORDER)
            if keyed:
                self.live[node] = [r for _, r in keyed]
            else:
                self.live.pop(node, None)
            self.changed.add(node)
        self._dirty.clear()

    def taken(self, node: str, request_id: str) -> int:
        """Live reservations on ``node`` of requests other than ``request_id`` (at the last refresh)."""
        return sum(1 for r in self.live.get(node, ()) if r.request_id != request_id)

    def own(self, request_id: str) -> dict[str, list[Reservation]]:
        """For each node where ``request_id`` holds a reservation, the node's live reservations of
        other requests (held_by_node's lists for that request; {} for a request holding none)."""
        out: dict[str, list[Reservation]] = {}
        for entry in self._requests.get(request_id, ()):
            node = self._entries[entry][1].decode_node
            out[node] = [r for r in self.live.get(node, ()) if r.request_id != request_id]
        return out


class RoutingState:
    """The replica's picture of the cluster (see the module docstring).

    Args:
        prefix: the nodes' prefix caches (None: the policy does not read them).
        clock: wall and monotonic clocks (:data:`kairos.runtime.clock.SYSTEM_CLOCK`).
    """

    def __init__(self, prefix: PrefixIndex | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.view: ClusterView | None = None
        #: reservation key -> reservation; changed only through the methods below, which keep
        #: the grouping :meth:`snapshot` reads (:class:`HeldReservations`) up to date
        self.reservations: dict[str, Reservation] = {}
        #: reservation key -> the newest revision applied (watched, or from a node's job answer):
        #: an older event of the key arriving later is ignored
        self.resv_rev: dict[str, int] = {}
        #: request id -> the slot its deflection holds here until the decode node answers (changed as ``reservations``)
        self.pending_deflections: dict[str, Reservation] = {}
        #: request id -> (monotonic s when heard, its routed event), oldest first: O(1) replace/forget
        #: per event (a list scan per routed event was quadratic in the rate, issue 12)
        self.recent_routed: dict[str, tuple[float, RoutedEvent]] = {}
        self.cancelled = RecentIds(MAX_CANCELLED)  #: request ids cancelled (maybe before they were pulled)
        self.prefix = prefix
        self.view_changed = asyncio.Event()  #: set by every newer view (a routing waiting for nodes)
        self.held = HeldReservations()  #: ``reservations`` and ``pending_deflections``, grouped by node
        self._builder = SnapshotBuilder(None)  #: the per-view part of the snapshots (of ``view``)
        self._view_data: bytes | None = None  #: the bytes ``view`` was decoded from (its second copy is dropped)

    # -- the view -----------------------------------------------------------------------------------
    def take_view(self, data: bytes) -> None:
        """A view's bytes (subject or bucket), kept when newer than the one held; the second copy of
        a view (the same bytes) is dropped before any decoding.

        Raises:
            WireError: ``data`` is not a :class:`ClusterView`.
        """
        if data == self._view_data:  # the bucket's last view may be the one the subject brought
            return
        view = decode_if_newer(data, self.view)
        if view is None:
            return
        self.view, self._view_data = view, data
        self._prune_routed(view)
        self.view_changed.set()

    def _prune_routed(self, view: ClusterView) -> None:
        """Forget routed events ``view`` already reflects (their node's state was sent after the
        node accepted the job — the first test of :func:`kairos.core.cluster.routing.fold_recent`, which a later
        view keeps passing), so each decision folds only the events since the last view instead of
        every event of the last RECENT_ROUTED_S."""
        sent = {n.node: n.state_sent_unix_ms for n in view.nodes}
        done = [rid for rid, (_, ev) in self.recent_routed.items()
                if ev.node_accepted_unix_ms <= sent.get(ev.node, float("-inf"))]
        for rid in done:
            del self.recent_routed[rid]

    def node_live(self, node: str) -> bool:
        """``node`` is in the view and not stale (its heartbeats are arriving)."""
        return self.view is not None and any(n.node == node and not n.stale for n in self.view.nodes)

    def node_count(self) -> int | None:
        """Nodes in the view (None: no view yet)."""
        return None if self.view is None else len(self.view.nodes)

    # -- routed events ----------------------------------------------------------------------------
    def remember_routed(self, ev: RoutedEvent) -> None:
        """Keep ``ev`` (replacing any earlier event of its request, e.g. a provisional one) as the newest."""
        self.recent_routed.pop(ev.request_id, None)
        self.recent_routed[ev.request_id] = (self.clock.monotonic(), ev)
        self._builder.add_event(ev)

    def forget_routed(self, request_id: str) -> None:
        """Drop ``request_id``'s routed event (its job was refused or not answered: it is not there)."""
        self.recent_routed.pop(request_id, None)
        self._builder.remove_event(request_id)

    def provisional(self, req: InferenceRequest, node: str, decode_node: str) -> None:
        """A keep-path job this replica is sending: fold it into its own snapshots right away
        (concurrent requests of one replica would otherwise all see the same queue)."""
        self.remember_routed(RoutedEvent(
            request_id=req.request_id, kind="keep", node=node, decode_node=decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=float("inf")))

    def _recent(self) -> Iterator[RoutedEvent]:
        """Routed events younger than RECENT_ROUTED_S (older ones are in the view by now)."""
        self._expire_routed()
        return (ev for _, ev in self.recent_routed.values())

    def _expire_routed(self) -> None:
        """Forget the routed events older than RECENT_ROUTED_S (oldest first: they are in order)."""
        now, recent = self.clock.monotonic(), self.recent_routed
        for rid in list(itertools.takewhile(lambda k: now - recent[k][0] > RECENT_ROUTED_S, recent)):
            del recent[rid]
            self._builder.remove_event(rid)

    # -- reservations -------------------------------------------------------------------------------
    def apply_reservation(self, key: str, value: Reservation, revision: int) -> None:
        """A node's reservation from its job answer, applied unless the watcher already delivered
        this revision or a newer one (e.g. its delete: a short deflection can end before its answer
        gets here); the watcher's older events of the key are ignored from now on."""
        if revision > self.resv_rev.get(key, 0):
            self.resv_rev[key] = revision
            self.reservations[key] = value
            self.held.put((WATCHED, key), value)

    def watched_reservation(self, key: str, revision: int | None, value: bytes | None, deleted: bool) -> None:
        """One event of the reservation bucket's watcher (``deleted``: a DEL/PURGE/TTL marker)."""
        if S.node_of_reservation_key(key) is None:
            return
        if revision is not None:
            if revision <= self.resv_rev.get(key, 0):
                return  # already applied from the node's job answer (or older than what was)
            self.resv_rev[key] = revision
        if deleted or not value:
            self.reservations.pop(key, None)
            self.held.pop((WATCHED, key))
            return
        try:
            r = self.reservations[key] = decode(value, Reservation)
        except WireError:
            self.reservations.pop(key, None)
            self.held.pop((WATCHED, key))
            return
        self.held.put((WATCHED, key), r)
        self.pending_deflections.pop(r.request_id, None)  # the node's own reservation replaces it
        self.held.pop((PENDING, r.request_id))

    def forget_reservations(self) -> None:
        """Before a new reservation watcher replays every live key (a re-declare)."""
        self.reservations.clear()
        self.resv_rev.clear()
        self.held.clear(WATCHED)

    def hold_deflection(self, req: InferenceRequest, decode_node: str, dispatcher_id: str, now_unix_ms: float) -> None:
        """Hold a slot on ``decode_node`` for ``req``'s deflection until the node answers."""
        r = self.pending_deflections[req.request_id] = Reservation(
            request_id=req.request_id, decode_node=decode_node, dispatcher_id=dispatcher_id,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, created_unix_ms=now_unix_ms,
            expires_unix_ms=now_unix_ms + PENDING_DEFLECTION_MS)
        self.held.put((PENDING, req.request_id), r)

    def release_deflection(self, request_id: str) -> None:
        """The node answered ``request_id``'s deflection job: the slot held here is given back."""
        self.pending_deflections.pop(request_id, None)
        self.held.pop((PENDING, request_id))

    def _drop_expired_pending(self, now_unix_ms: float) -> None:
        """Forget this replica's pending deflections past their expiry (they are not live any more)."""
        for rid in [rid for rid, r in self.pending_deflections.items() if r.expires_unix_ms <= now_unix_ms]:
            del self.pending_deflections[rid]
            self.held.pop((PENDING, rid))

    def _reservations_and_pending(self, now_unix_ms: float) -> dict[str, Reservation]:
        """The watched reservations plus this replica's deflections not watched yet (keyed
        ``pending.<request id>``; expired ones are dropped here)."""
        if not self.pending_deflections:
            return self.reservations
        self._drop_expired_pending(now_unix_ms)
        return {**self.reservations, **{f"pending.{rid}": r for rid, r in self.pending_deflections.items()}}

    # -- what a decision reads ------------------------------------------------------------------------
    def snapshot_inputs(self, now_unix_ms: float) -> tuple[ClusterView | None, dict[str, Reservation]]:
        """The view with the recent routed events folded in, and the live reservations (pending included)."""
        held = live_reservations(self._reservations_and_pending(now_unix_ms), now_unix_ms)
        return fold_recent(self.view, self._recent()), held

    def snapshot(self, req: InferenceRequest, excluded: dict[str, str], full: set[str], hits: dict[str, int],
                 max_deflections: int, now_unix_ms: float) -> tuple[ClusterSnapshot | None, HeldReservations]:
        """``req``'s policy snapshot (None: no routable prefill or decode node), equal to
        ``build_snapshot(req, *snapshot_inputs(now_unix_ms), excluded, now_unix_ms, max_deflections,
        full, hits)``, and the live reservations it was built from (for rule 3,
        :func:`kairos.core.cluster.routing.decide_within_slots`, at the same ``now_unix_ms``) —
        with the per-view and per-reservation-change work reused (module docstring)."""
        held = self._live_held(now_unix_ms)
        builder = self._builder_for(max_deflections)
        snap = builder.build(req, held.own(req.request_id), excluded, now_unix_ms, full, hits)
        return snap, held

    def _live_held(self, now_unix_ms: float) -> HeldReservations:
        """:attr:`held` brought to ``now_unix_ms`` (expired pending deflections forgotten)."""
        if self.pending_deflections:
            self._drop_expired_pending(now_unix_ms)
        self.held.refresh(now_unix_ms)
        return self.held

    def _builder_for(self, max_deflections: int) -> SnapshotBuilder:
        """The :class:`SnapshotBuilder` of the current view, holding the recent routed events (each
        handed to it as it is heard, forgotten or aged out) — a new one, given every event, when the
        view (or the slot count) changed — and the reservations of the nodes :attr:`held` changed
        since it was last given them."""
        self._expire_routed()
        held, builder = self.held, self._builder
        if builder.view is not self.view or builder.max_deflections != max_deflections:
            builder = self._builder = SnapshotBuilder(self.view, max_deflections)
            for _, ev in self.recent_routed.values():
                builder.add_event(ev)
            changed = held.live
        else:
            changed = {node: held.live.get(node, []) for node in held.changed}
        held.changed.clear()
        for node, rs in changed.items():
            builder.set_held(node, rs)
        return builder

    def prefix_hits(self, req: InferenceRequest) -> dict[str, int]:
        """node → leading prompt tokens of ``req`` its prefix cache holds (empty: unknown/none)."""
        if self.prefix is None or not req.block_hashes or req.block_hash_tokens != self.prefix.block_tokens:
            return {}
        return self.prefix.match_tokens(req.block_hashes, req.prompt_tokens)

    def on_heartbeat(self, st: NodeState) -> None:
        """A node's heartbeat: its prefix-cache events feed the index (prefix-aware policies)."""
        if self.prefix is not None and st.cache_block_tokens:
            self.prefix.on_heartbeat(st.node, st.seq, st.cache_block_tokens, st.cache_stored, st.cache_removed,
                                     st.cache_full)
