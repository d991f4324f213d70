"""What one dispatcher replica knows of the cluster when it decides: no I/O, fed by its watchers.

Inputs (each fed by :mod:`kairos.services.dispatcher.watch`, or by the routing of a request):

* the **cluster view** the state aggregator builds (``kairos.view`` and the ``kairos_view`` bucket;
  each view arrives twice, the older copy is ignored, :func:`kairos.services.state_aggregator.view.newer`);
* the **deflection reservations** of the decode nodes (watched in ``kairos_reservations``, and taken
  from a node's job answer, whichever revision is newer), plus this replica's own **pending
  deflections** — the slot a deflection holds here from the decision until the decode node answers
  (at most :data:`PENDING_DEFLECTION_MS`), so this replica's next decisions see it taken at once;
* the **routed events** of every replica (``kairos.route.decided``) not yet in the view, and the
  provisional event of a keep job this replica is sending (folded into each snapshot,
  :func:`kairos.core.cluster.routing.fold_recent`);
* **cancelled** request ids (a cancel may come before the request is pulled);
* the nodes' **prefix caches** (heartbeats' cache events; prefix-aware policies only).

Output: :meth:`RoutingState.snapshot_inputs` — the view with recent events folded in and the live
reservations — for :func:`kairos.core.cluster.routing.build_snapshot`. Clocks come from a
:class:`kairos.runtime.clock.Clock` (monotonic s for the routed events' age, wall ms for expiry).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Iterator

from kairos.contracts import subjects as S
from kairos.contracts.wire import ClusterView, InferenceRequest, NodeState, Reservation, RoutedEvent, WireError, decode
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.cluster.recent import RecentIds
from kairos.core.cluster.routing import fold_recent, live_reservations
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.services.state_aggregator.view import decode_if_newer

#: routed events kept for folding into the view (the aggregator folds them within one Δh)
RECENT_ROUTED_S = 5.0
#: cancelled request ids remembered (a request can wait in the queue while all dispatchers are down)
MAX_CANCELLED = 100_000
#: longest time (ms) a deflection job this replica sent holds its slot in this replica's view
#: before the node's answer (the job ack timeout is shorter; a safety net for a routing task that died)
PENDING_DEFLECTION_MS = 5000.0


class RoutingState:
    """The replica's picture of the cluster (see the module docstring).

    Args:
        prefix: the nodes' prefix caches (None: the policy does not read them).
        clock: wall and monotonic clocks (:data:`kairos.runtime.clock.SYSTEM_CLOCK`).
    """

    def __init__(self, prefix: PrefixIndex | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.view: ClusterView | None = None
        self.reservations: dict[str, Reservation] = {}
        #: reservation key -> the newest revision applied (watched, or from a node's job answer):
        #: an older event of the key arriving later is ignored
        self.resv_rev: dict[str, int] = {}
        #: request id -> the slot its deflection holds here until the decode node answers
        self.pending_deflections: dict[str, Reservation] = {}
        #: request id -> (monotonic s when heard, its routed event), oldest first: O(1) replace/forget
        #: per event (a list scan per routed event was quadratic in the rate, issue 12)
        self.recent_routed: dict[str, tuple[float, RoutedEvent]] = {}
        self.cancelled = RecentIds(MAX_CANCELLED)  #: request ids cancelled (maybe before they were pulled)
        self.prefix = prefix
        self.view_changed = asyncio.Event()  #: set by every newer view (a routing waiting for nodes)

    # -- the view -----------------------------------------------------------------------------------
    def take_view(self, data: bytes) -> None:
        """A view's bytes (subject or bucket), kept when newer than the one held.

        Raises:
            WireError: ``data`` is not a :class:`ClusterView`.
        """
        view = decode_if_newer(data, self.view)  # each view comes twice (subject and bucket)
        if view is None:
            return
        self.view = view
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

    def forget_routed(self, request_id: str) -> None:
        """Drop ``request_id``'s routed event (its job was refused or not answered: it is not there)."""
        self.recent_routed.pop(request_id, None)

    def provisional(self, req: InferenceRequest, node: str, decode_node: str) -> None:
        """A keep-path job this replica is sending: fold it into its own snapshots right away
        (concurrent requests of one replica would otherwise all see the same queue)."""
        self.remember_routed(RoutedEvent(
            request_id=req.request_id, kind="keep", node=node, decode_node=decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=float("inf")))

    def _recent(self) -> Iterator[RoutedEvent]:
        """Routed events younger than RECENT_ROUTED_S (older ones are in the view by now)."""
        now, recent = self.clock.monotonic(), self.recent_routed
        for rid in list(itertools.takewhile(lambda k: now - recent[k][0] > RECENT_ROUTED_S, recent)):
            del recent[rid]
        return (ev for _, ev in recent.values())

    # -- reservations -------------------------------------------------------------------------------
    def apply_reservation(self, key: str, value: Reservation, revision: int) -> None:
        """A node's reservation from its job answer, applied unless the watcher already delivered
        this revision or a newer one (e.g. its delete: a short deflection can end before its answer
        gets here); the watcher's older events of the key are ignored from now on."""
        if revision > self.resv_rev.get(key, 0):
            self.resv_rev[key] = revision
            self.reservations[key] = value

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
            return
        try:
            r = self.reservations[key] = decode(value, Reservation)
        except WireError:
            self.reservations.pop(key, None)
            return
        self.pending_deflections.pop(r.request_id, None)  # the node's own reservation replaces it

    def forget_reservations(self) -> None:
        """Before a new reservation watcher replays every live key (a re-declare)."""
        self.reservations.clear()
        self.resv_rev.clear()

    def hold_deflection(self, req: InferenceRequest, decode_node: str, dispatcher_id: str, now_unix_ms: float) -> None:
        """Hold a slot on ``decode_node`` for ``req``'s deflection until the node answers."""
        self.pending_deflections[req.request_id] = Reservation(
            request_id=req.request_id, decode_node=decode_node, dispatcher_id=dispatcher_id,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, created_unix_ms=now_unix_ms,
            expires_unix_ms=now_unix_ms + PENDING_DEFLECTION_MS)

    def release_deflection(self, request_id: str) -> None:
        """The node answered ``request_id``'s deflection job: the slot held here is given back."""
        self.pending_deflections.pop(request_id, None)

    def _reservations_and_pending(self, now_unix_ms: float) -> dict[str, Reservation]:
        """The watched reservations plus this replica's deflections not watched yet (keyed
        ``pending.<request id>``; expired ones are dropped here)."""
        if not self.pending_deflections:
            return self.reservations
        for rid in [rid for rid, r in self.pending_deflections.items() if r.expires_unix_ms <= now_unix_ms]:
            del self.pending_deflections[rid]
        return {**self.reservations, **{f"pending.{rid}": r for rid, r in self.pending_deflections.items()}}

    # -- what a decision reads ------------------------------------------------------------------------
    def snapshot_inputs(self, now_unix_ms: float) -> tuple[ClusterView | None, dict[str, Reservation]]:
        """The view with the recent routed events folded in, and the live reservations (pending included)."""
        held = live_reservations(self._reservations_and_pending(now_unix_ms), now_unix_ms)
        return fold_recent(self.view, self._recent()), held

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
