"""Dispatcher rules without I/O: view → policy snapshot, reservation conflicts, re-routes, jobs.

Where data comes from: the :class:`~kairos.contracts.wire.ClusterView` (KV watch), the reservations bucket
(KV watch) and the refusals the dispatcher met while routing one request. Where it goes: the
policy (:mod:`kairos.core.policy`) and the :class:`~kairos.contracts.wire.Job` sent to a node.

Rules (docs/services.md has the same list):

1. Stale nodes, nodes that are not accepting and nodes excluded for this request (refused the
   job, or did not answer) are left out of the snapshot. No routable prefill *or* no routable
   decode node → no snapshot (the dispatcher waits for a view update, then errors 503).
2. The reservations are the dispatchers' view of in-flight deflections: a decode node whose slots
   are reserved by other requests is shown to the policy with ``deflection_in_flight=True`` (and no
   projection data), so ``kairos`` skips it (§5.3); an unreserved node is shown free even if its
   last heartbeat (up to Δh old) still reported the finished deflection. The decode node publishes
   a reservation from when it accepts a deflection until its prefill ends; a replica adds its own
   deflection jobs from the decision until the node answers — what the simulator does.
3. If a policy still deflects onto a reserved node (static policies may), the decision becomes a
   keep on the best prefill node (reason ``keep_reservation_conflict``). The node itself refuses a
   deflection beyond its slots (:func:`job_refusal`; the dispatcher re-routes), so across replicas
   at most ``max_deflections`` run per decode node at a time.
4. Keep-path jobs carry an ordered list of decode candidates so the prefill agent can hand the KV
   to the next one when the chosen decode node is gone (a re-route, never a drop).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Protocol

import msgspec

from kairos.core.model.latency import LatencyModel
from kairos.core.vocabulary import PathKind
from kairos.core.policy import Policy
from kairos.core.policy.base import Decision, PolicyParams
from kairos.core.policy.common import best_prefill, least_loaded_decode
from kairos.core.policy.registry import KAIROS_PLUS_SLOTS, policy_spec  # noqa: F401 (KAIROS_PLUS_SLOTS: re-exported)
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, InFlightDeflection, PrefillNodeView, RequestView
from kairos.contracts.wire import ClusterView, InferenceRequest, Job, NodeView, Reservation, RoutedEvent


def deflection_slots(policy_name: str) -> int | None:
    """Deflections a decode node holds at once under ``policy_name`` — the default of ``kairos up``'s
    dispatchers and agents and of the simulator: the policy's
    :attr:`~kairos.core.policy.registry.PolicySpec.deflection_slots` (None: no cap, simulator only).
    Rule 3 (:func:`decide_within_slots`) turns a deflection onto a full node into a keep.

    Raises:
        kairos.core.policy.PolicyError: unknown policy.
    """
    return policy_spec(policy_name).deflection_slots


def routable(view: ClusterView | None, excluded: Mapping[str, str] = {}) -> tuple[list[NodeView], list[NodeView]]:
    """(prefill, decode) nodes a dispatcher may route to, in view order."""
    if view is None:
        return [], []
    ok = [n for n in view.nodes if not n.stale and n.accepting and n.node not in excluded]
    return [n for n in ok if n.role == "prefill"], [n for n in ok if n.role == "decode"]


def live_reservations(reservations: Mapping[str, Reservation], now_unix_ms: float) -> dict[str, Reservation]:
    """reservation key → reservation, without the ones past their expiry (the bus deletes those)."""
    return {key: r for key, r in reservations.items() if r.expires_unix_ms > now_unix_ms}


def held_by_node(reserved: Mapping[str, Reservation], request_id: str) -> dict[str, list[Reservation]]:
    """decode node → reservations held there by *other* requests, oldest first."""
    out: dict[str, list[Reservation]] = {}
    for r in sorted(reserved.values(), key=lambda r: r.created_unix_ms):
        if r.request_id != request_id:
            out.setdefault(r.decode_node, []).append(r)
    return out


def predicted_ttft_ms(d: Decision) -> float | None:
    """The decision's TTFT estimate (ms) for the path it took: keep → Eq. 1 ``TTFT_pf``, deflect →
    Eq. 6 ``TTFT_dec`` of the chosen node; None if the policy made none."""
    return d.ttft_decode_est_ms.get(d.node) if d.deflected else d.ttft_prefill_est_ms


def fold_recent(view: ClusterView | None, recent: Iterable[RoutedEvent]) -> ClusterView | None:
    """``view`` plus the keep-path jobs routed (by any replica) since the aggregator built it.

    The aggregator folds routed events into the view only when it next writes it (every Δh), so
    between two views every replica would see the same empty queue and send a burst to one node.
    A routed event is already in the view when its node's state was sent after the node accepted
    the job (same node clock) or when the view lists its request id as pending; anything else is
    appended to that prefill node's queue here — what the simulator's dispatcher does with
    ``routed_since``. Deflections need no folding: the reservations carry them.

    The decode node an event named cannot show the request before its prefill ends, and neither
    the aggregator nor the prefill node's queue tells it: every keep event whose prefill node has
    not yet reported it (the first test above) adds its prompt tokens to that decode node's
    ``kv_tokens`` and one to its ``batch_size``, so the keep path's decode choice
    (:func:`kairos.core.policy.common.least_loaded_decode`) spreads a burst too.
    """
    if view is None:
        return None
    extra: dict[str, list[RoutedEvent]] = {}
    for ev in recent:
        if ev.kind == "keep":
            extra.setdefault(ev.node, []).append(ev)
    if not extra:
        return view
    sent = {n.node: n.state_sent_unix_ms for n in view.nodes}
    to_decode: dict[str, tuple[int, int]] = {}
    for node, evs in extra.items():
        since = sent.get(node, float("-inf"))
        for ev in evs:
            if ev.node_accepted_unix_ms > since and ev.decode_node:
                kv, b = to_decode.get(ev.decode_node, (0, 0))
                to_decode[ev.decode_node] = (kv + ev.prompt_tokens, b + 1)
    nodes = []
    for n in view.nodes:
        mine = extra.get(n.node)
        if mine:
            pending = set(n.pending_ids)  # a set: folding is O(events + pending) per node, not their product
            evs = [ev for ev in mine if ev.node_accepted_unix_ms > n.state_sent_unix_ms and ev.request_id not in pending]
            if evs:
                n = msgspec.structs.replace(n, queue_prompt_tokens=[*n.queue_prompt_tokens, *(e.prompt_tokens for e in evs)],
                                            pending_routed=n.pending_routed + len(evs),
                                            pending_ids=[*n.pending_ids, *(e.request_id for e in evs)])
        handed = to_decode.get(n.node)
        if handed and n.role == "decode":
            n = msgspec.structs.replace(n, kv_tokens=n.kv_tokens + handed[0], batch_size=n.batch_size + handed[1])
        nodes.append(n)
    return msgspec.structs.replace(view, nodes=nodes)


def build_snapshot(req: InferenceRequest, view: ClusterView | None, reserved: Mapping[str, Reservation],
                   excluded: Mapping[str, str], now_unix_ms: float, max_deflections: int = 1,
                   full: frozenset[str] | set[str] = frozenset(),
                   prefix_hits: Mapping[str, int] = {}) -> ClusterSnapshot | None:
    """The policy input for ``req``, or None when no prefill or no decode node is routable.

    ``reserved`` is every live reservation (any key); a decode node with ``max_deflections``
    reservations of other requests, or listed in ``full`` (a conflict this dispatcher just met), is
    shown with ``deflection_in_flight=True`` and no projection data (no policy deflects there); a
    node with fewer is shown with its reservations as ``in_flight`` deflections (kairos+ projects
    them; kairos skips the node, §5.3). ``prefix_hits`` (node → leading prompt tokens it holds,
    from the dispatcher's :class:`kairos.core.cluster.prefix_index.PrefixIndex`) becomes ``cached_prefix_tokens``.
    """
    pfs, dcs = routable(view, excluded)
    if not pfs or not dcs or view is None:
        return None
    held = held_by_node(reserved, req.request_id)
    decode = []
    for n in dcs:
        mine = held.get(n.node, [])
        if n.node in full or len(mine) >= max_deflections:
            in_flight, busy = [], True
        else:
            in_flight = [InFlightDeflection(prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens) for r in mine]
            busy = bool(mine)
        decode.append(DecodeNodeView(id=n.node, batch_size=n.batch_size, kv_tokens=n.kv_tokens,
                                     deflection_in_flight=busy, in_flight=in_flight, waiting=n.waiting,
                                     step_bias=n.correction.bias, step_safety=n.correction.safety,
                                     cached_prefix_tokens=prefix_hits.get(n.node, 0)))
    prefill = [PrefillNodeView(id=n.node, queue_prompt_tokens=list(n.queue_prompt_tokens),
                               kv_backlog_ms=n.kv_backlog_ms, step_bias=n.correction.bias,
                               cached_prefix_tokens=prefix_hits.get(n.node, 0)) for n in pfs]
    age = max(0.0, now_unix_ms - view.built_unix_ms) + max(n.age_ms for n in (*pfs, *dcs))
    return ClusterSnapshot(
        request=RequestView(id=req.request_id, prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens),
        prefill_nodes=prefill, decode_nodes=decode, state_age_ms=age)


class SlotCounts(Protocol):
    """Live reservations counted per decode node — what rule 3 (:func:`slot_taken`) reads — kept
    up to date as they change (:class:`kairos.services.dispatcher.state.HeldReservations`)."""

    def taken(self, node: str, request_id: str) -> int:
        """Live reservations on ``node`` held by requests other than ``request_id``."""


class SnapshotBuilder:
    """``build_snapshot(req, fold_recent(view, recent), held, …)`` for every request routed on one
    view, with what depends on the view, on the routed events and on the reservations worked out
    when they change instead of per request (issue 19 §3).

    * At construction (once per view, O(nodes)): the routable nodes, one
      :class:`DecodeNodeView` / :class:`PrefillNodeView` per node, each node's
      ``state_sent_unix_ms`` and pending ids, the oldest node age.
    * :meth:`add_event` / :meth:`remove_event` (once per routed event heard, forgotten or aged
      out, O(1)): :func:`fold_recent`'s two tests for that event, its prompt added to (taken from)
      its prefill node's queue and its decode node's ``kv_tokens``/``batch_size``.
    * :meth:`set_held` (once per change of a node's live reservations): rule 2 for that node.
    * Per request (:meth:`build`): the nodes those changed get their view again (each once), the
      list of views is copied, and only the nodes the request's own reservations, ``full`` and
      its prefix hits name get a view of their own.

    The result equals :func:`build_snapshot` of :func:`fold_recent` of the events added and not
    removed, in the order they were last added, field for field (tests/unit/test_snapshot_builder.py
    holds them to it). The snapshots share their node views and those views' lists with the builder
    and with each other: node views are frozen, and nothing may mutate their lists (a policy is a
    pure function of its snapshot). A view listing a node id twice (no aggregator writes one), or
    ``max_deflections`` < 1 (every node full), is built by the straightforward functions instead.

    Args:
        view: the cluster view (None: nothing routable).
        max_deflections: deflection slots per decode node (rule 2's cap).
    """

    __slots__ = ("view", "max_deflections", "_pf", "_dc", "_pf_at", "_dc_at", "_cur_pf", "_cur_dc", "_held",
                 "_events", "_queued", "_handed", "_dirty_pf", "_dirty_dc", "_sent", "_pending", "_max_age", "_exact")

    def __init__(self, view: ClusterView | None, max_deflections: int = 1) -> None:
        self.view, self.max_deflections = view, max_deflections
        pfs: list[NodeView] = []
        dcs: list[NodeView] = []
        self._sent: dict[str, float] = {}  #: node -> its state_sent_unix_ms (fold_recent's first test)
        self._pending: dict[str, set[str]] = {}  #: routable prefill node -> its pending ids (the second)
        for n in view.nodes if view is not None else ():  # routable()'s test, in one pass
            self._sent[n.node] = n.state_sent_unix_ms
            if not n.stale and n.accepting:
                if n.role == "prefill":
                    pfs.append(n)
                    if n.pending_ids:
                        self._pending[n.node] = set(n.pending_ids)
                elif n.role == "decode":
                    dcs.append(n)
        self._pf, self._dc = pfs, dcs
        self._pf_at = {n.node: i for i, n in enumerate(pfs)}
        self._dc_at = {n.node: i for i, n in enumerate(dcs)}
        #: each routable node's view with the events folded in and (decode) its reservations
        self._cur_pf = [_prefill_view(n, n.queue_prompt_tokens, 0) for n in pfs]
        self._cur_dc = [_decode_view(n, n.kv_tokens, n.batch_size, False, [], 0) for n in dcs]
        self._held: dict[str, list[Reservation]] = {}  #: routable decode node -> its live reservations
        self._events: dict[str, RoutedEvent] = {}  #: request id -> its routed event, in the order added
        self._queued: dict[str, dict[str, int]] = {}  #: routable prefill node -> request id -> prompt folded in
        self._handed: dict[str, tuple[int, int]] = {}  #: routable decode node -> (kv tokens, requests) folded in
        self._dirty_pf: set[str] = set()  #: nodes whose view is out of date
        self._dirty_dc: set[str] = set()
        self._exact = view is not None and len(self._sent) == len(view.nodes) and max_deflections >= 1
        self._max_age = max((n.age_ms for n in (*pfs, *dcs)), default=0.0)

    def add_event(self, ev: RoutedEvent) -> None:
        """A routed event to fold in, replacing any earlier one of its request (it moves last, as in
        :meth:`kairos.services.dispatcher.state.RoutingState.remember_routed`)."""
        self.remove_event(ev.request_id)
        self._events[ev.request_id] = ev
        self._fold(ev, 1)

    def remove_event(self, request_id: str) -> None:
        """The routed event of ``request_id`` is not to be folded in any more (none: nothing)."""
        ev = self._events.pop(request_id, None)
        if ev is not None:
            self._fold(ev, -1)

    def _fold(self, ev: RoutedEvent, sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) what :func:`fold_recent` folds in for ``ev``."""
        if ev.kind != "keep" or not ev.node_accepted_unix_ms > self._sent.get(ev.node, float("-inf")):
            return
        node, dn = ev.node, ev.decode_node
        if dn and dn in self._dc_at:
            kv, b = self._handed.get(dn, (0, 0))
            kv, b = kv + sign * ev.prompt_tokens, b + sign
            if b:
                self._handed[dn] = (kv, b)
            else:
                del self._handed[dn]
            self._dirty_dc.add(dn)
        if node in self._pf_at and ev.request_id not in self._pending.get(node, ()):
            queued = self._queued.setdefault(node, {})
            if sign > 0:
                queued[ev.request_id] = ev.prompt_tokens
            else:
                del queued[ev.request_id]
                if not queued:
                    del self._queued[node]
            self._dirty_pf.add(node)

    def set_held(self, node: str, reservations: list[Reservation]) -> None:
        """``node``'s live reservations are now ``reservations`` (every request's, oldest first, as
        :func:`held_by_node` orders them; [] when none)."""
        if node not in self._dc_at:
            return
        if reservations:
            self._held[node] = reservations
        else:
            self._held.pop(node, None)
        self._dirty_dc.add(node)

    def _decode_of(self, node: str, mine: list[Reservation], full: bool, hit: int) -> DecodeNodeView:
        """Routable decode node ``node``'s view (rule 2, as :func:`build_snapshot`) with the folded events."""
        n = self._dc[self._dc_at[node]]
        kv, b = self._handed.get(node, (0, 0))
        if full or len(mine) >= self.max_deflections:
            in_flight, busy = [], True
        else:
            in_flight = [InFlightDeflection(prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens) for r in mine]
            busy = bool(mine)
        return _decode_view(n, n.kv_tokens + kv, n.batch_size + b, busy, in_flight, hit)

    def _prefill_of(self, node: str, hit: int) -> PrefillNodeView:
        """Routable prefill node ``node``'s view with the folded events."""
        n = self._pf[self._pf_at[node]]
        queued = self._queued.get(node)
        return _prefill_view(n, [*n.queue_prompt_tokens, *queued.values()] if queued else n.queue_prompt_tokens, hit)

    def build(self, req: InferenceRequest, own: Mapping[str, list[Reservation]], excluded: Mapping[str, str],
              now_unix_ms: float, full: frozenset[str] | set[str] = frozenset(),
              prefix_hits: Mapping[str, int] = {}) -> ClusterSnapshot | None:
        """``build_snapshot(req, fold_recent(view, events), held, excluded, now_unix_ms,
        max_deflections, full, prefix_hits)``, ``events`` the ones added and not removed and
        ``held`` the live reservations given to :meth:`set_held`; ``own``: for each node where
        ``req`` holds a reservation itself, that node's other reservations
        (:func:`held_by_node` ``(held, req.request_id)`` of those nodes; {} for a request holding
        none). O(nodes changed since the last call + nodes this request changes), plus a list
        copy, and an O(nodes) pass when ``excluded`` is not empty."""
        view = self.view
        if not self._exact:
            held = {f"{node}.{k}": r for node, rs in self._held.items() for k, r in enumerate(rs)}
            return None if view is None else build_snapshot(
                req, fold_recent(view, self._events.values()), held, excluded, now_unix_ms, self.max_deflections,
                full, prefix_hits)
        pf_at, dc_at, held = self._pf_at, self._dc_at, self._held
        for node in self._dirty_pf:
            self._cur_pf[pf_at[node]] = self._prefill_of(node, 0)
        for node in self._dirty_dc:
            self._cur_dc[dc_at[node]] = self._decode_of(node, held.get(node, []), False, 0)
        self._dirty_pf.clear()
        self._dirty_dc.clear()
        prefill, decode = self._cur_pf.copy(), self._cur_dc.copy()
        for node, hit in prefix_hits.items():
            if node in pf_at:
                prefill[pf_at[node]] = self._prefill_of(node, hit)
        for node in {*own, *full, *prefix_hits}:
            if node in dc_at:
                decode[dc_at[node]] = self._decode_of(node, own[node] if node in own else held.get(node, []),
                                                      node in full, prefix_hits.get(node, 0))
        max_age = self._max_age
        if excluded:
            prefill = [v for v in prefill if v.id not in excluded]
            decode = [v for v in decode if v.id not in excluded]
            max_age = max((n.age_ms for n in (*self._pf, *self._dc) if n.node not in excluded), default=0.0)
        if not prefill or not decode:
            return None
        return ClusterSnapshot(
            request=RequestView(id=req.request_id, prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens),
            prefill_nodes=prefill, decode_nodes=decode,
            state_age_ms=max(0.0, now_unix_ms - view.built_unix_ms) + max_age)


def _prefill_view(n: NodeView, queue: list[int], cached_prefix_tokens: int) -> PrefillNodeView:
    """A routable prefill node as a snapshot shows it (its queue with anything folded in)."""
    return PrefillNodeView(id=n.node, queue_prompt_tokens=list(queue), kv_backlog_ms=n.kv_backlog_ms,
                           step_bias=n.correction.bias, cached_prefix_tokens=cached_prefix_tokens)


def _decode_view(n: NodeView, kv_tokens: int, batch_size: int, busy: bool, in_flight: list[InFlightDeflection],
                 cached_prefix_tokens: int) -> DecodeNodeView:
    """A routable decode node as a snapshot shows it (rule 2; ``kv_tokens``/``batch_size`` with
    the keep jobs folded in)."""
    return DecodeNodeView(id=n.node, batch_size=batch_size, kv_tokens=kv_tokens, deflection_in_flight=busy,
                          in_flight=in_flight, waiting=n.waiting, step_bias=n.correction.bias,
                          step_safety=n.correction.safety, cached_prefix_tokens=cached_prefix_tokens)


def keep_instead(decision: Decision, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams,
                 reason: str) -> Decision:
    """Turn a deflection the dispatcher cannot carry out into a keep (best TTFT_pf prefill node)."""
    node, ttft_pf, kv_ms = best_prefill(snap, model, params, include_kv=params.kv_transfer_aware)
    return msgspec.structs.replace(decision, decision="keep", node=node, decode_node=least_loaded_decode(snap),
                                   reason=reason, chunk_schedule=[], predicted_step_ms=[],
                                   ttft_prefill_est_ms=ttft_pf, kv_transfer_est_ms=kv_ms)


def slot_taken(decision: Decision, held: Mapping[str, Reservation] | SlotCounts, full: frozenset[str] | set[str],
               max_deflections: int) -> bool:
    """Rule 3: ``decision`` deflects onto a decode node that has no free slot — ``max_deflections``
    reservations of other requests in ``held`` (live reservations, any key; or their
    :class:`SlotCounts`), or listed in ``full`` (a conflict or refusal this routing met)."""
    if not decision.deflected:
        return False
    node = decision.node
    if isinstance(held, Mapping):
        taken = sum(1 for r in held.values() if r.decode_node == node and r.request_id != decision.request_id)
    else:
        taken = held.taken(node, decision.request_id)
    return node in full or taken >= max_deflections


def decide_within_slots(policy: Policy, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams,
                        held: Mapping[str, Reservation] | SlotCounts, full: frozenset[str] | set[str],
                        max_deflections: int) -> Decision:
    """The dispatcher's decision for ``snap`` (from :func:`build_snapshot` with the same ``held``,
    ``full`` and ``max_deflections``): the policy's, with a deflection onto a node without a free slot
    (:func:`slot_taken`) turned into a keep (reason ``keep_reservation_conflict``, rule 3). Pure;
    the simulator applies the same rule to its own reservations."""
    decision = policy.decide(snap, model, params)
    if slot_taken(decision, held, full, max_deflections):
        return keep_instead(decision, snap, model, params, "keep_reservation_conflict")
    return decision


def decode_candidates(decision: Decision, snap: ClusterSnapshot) -> list[str]:
    """Keep path: the decision's decode node first, then the others, least loaded first."""
    rest = sorted((d for d in snap.decode_nodes if d.id != decision.decode_node),
                  key=lambda d: (d.kv_tokens, d.batch_size, d.waiting))
    return [decision.decode_node, *(d.id for d in rest)]


def make_job(decision: Decision, req: InferenceRequest, snap: ClusterSnapshot, dispatcher_id: str, attempt: int,
             reservation_ttl_s: int = 0) -> Job:
    """The job for ``decision.node`` (``reservation_ttl_s``: a deflection's, :func:`reservation_ttl_s`)."""
    if decision.deflected:
        return Job(kind="deflect", request=req, node=decision.node, decode_candidates=[decision.node],
                   chunk_schedule=list(decision.chunk_schedule), predicted_step_ms=list(decision.predicted_step_ms),
                   reservation_ttl_s=reservation_ttl_s,
                   decision_batch_size=decision_batch_size(decision, snap), dispatcher_id=dispatcher_id,
                   attempt=attempt, predicted_ttft_ms=predicted_ttft_ms(decision))
    return Job(kind="keep", request=req, node=decision.node, decode_candidates=decode_candidates(decision, snap),
               dispatcher_id=dispatcher_id, attempt=attempt, predicted_ttft_ms=predicted_ttft_ms(decision))


def decision_batch_size(decision: Decision, snap: ClusterSnapshot) -> int:
    """B the decision's chunk schedule was computed with on ``decision.node``: the node's B_n, plus
    one per deflection in flight there that kairos+ projected ahead of this one (each joins the
    batch before this prefill runs, kairos/core/policy/kairos.py). 0 when the node is not in the snapshot."""
    for dn in snap.decode_nodes:
        if dn.id == decision.node:
            return dn.batch_size + len(dn.in_flight)
    return 0


def reservation_ttl_s(decision: Decision, floor_s: float) -> int:
    """Reservation TTL (whole seconds, the bus's unit): ≥ ``floor_s`` and ≥ 4 × the predicted
    deflected prefill time, so a healthy deflection always releases before expiry."""
    predicted_s = sum(decision.predicted_step_ms) / 1000.0
    return max(1, int(max(floor_s, 4.0 * predicted_s) + 0.999))


def job_refusal(job_kind: PathKind, job_node: str, node: str, role: str, accepting: bool, deflecting: int,
                prompt_tokens: int, max_tokens: int, max_model_len: int, deadline_unix_ms: float,
                now_unix_ms: float, max_deflections: int = 1) -> str | None:
    """Why a node agent refuses a job (the dispatcher then re-routes it), or None to accept.

    A decode node takes ``max_deflections`` deflections at a time (1 for kairos, §5.3): one more
    deflect job is refused (``deflection_in_flight``) — it is how two replicas that deflected onto
    the node within the same few ms learn it (docs/bus.md).
    """
    if job_node != node:
        return "wrong_node"
    if not accepting:
        return "draining"
    if (job_kind == "keep") != (role == "prefill"):  # the keep path prefills on a prefill node
        return "wrong_role"
    if prompt_tokens + max_tokens > max_model_len:
        return "too_long"
    if deadline_unix_ms <= now_unix_ms:
        return "deadline_passed"
    if job_kind == "deflect" and deflecting >= max_deflections:
        return "deflection_in_flight"
    return None
