"""Cluster view: built by the state aggregator from heartbeats and routing events (no I/O).

Where data comes from: :class:`~kairos.contracts.wire.NodeState` heartbeats (``kairos.state.<node>``) and
:class:`~kairos.contracts.wire.RoutedEvent` (``kairos.route.decided``). Where it goes: the
:class:`~kairos.contracts.wire.ClusterView` the aggregator writes into the ``kairos_view`` KV bucket, which
dispatchers turn into a policy snapshot (:mod:`kairos.core.cluster.routing`).

Rules:

* **Staleness.** A node whose last heartbeat was *received* more than ``stale_after_ms`` ago
  (default 3 × period) is ``stale``; dispatchers route nothing to it. The aggregator's own
  receive clock is used, so skew between hosts does not matter.
* **Routed-but-not-yet-reported work.** Between heartbeats a dispatcher may route more work to a
  node. Each accepted job's routing event is folded into that node's view (prompt appended to a
  prefill queue; deflection marked in flight on a decode node) until a heartbeat *sent after the
  node accepted the job* (same node clock) arrives, which already contains it.
* **Heartbeat validation** (:class:`kairos.core.cluster.heartbeat.HeartbeatGuard`): per-node epoch + seq;
  replays, implausible seq jumps and far-future timestamps are refused (and counted by the
  aggregator), an agent restart (newer epoch) is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kairos.core.model.correction import StepCorrection
from kairos.core.cluster.heartbeat import HeartbeatGuard
from kairos.contracts.wire import ClusterView, InFlight, NodeState, NodeView, RoutedEvent, decode


@dataclass
class _NodeEntry:
    state: NodeState
    received_ms: float  # aggregator clock
    pending: list[RoutedEvent] = field(default_factory=list)


@dataclass
class ViewBuilder:
    """Latest state per node plus routed-but-unreported jobs; :meth:`build` makes the view.

    Attributes:
        period_ms: heartbeat period the nodes are expected to use.
        stale_after_ms: no heartbeat for this long → stale (default 3 × period).
        forget_after_ms: a node silent this long is dropped from the view entirely.
        pending_max_age_ms: routed events older than this are dropped even if no newer
            heartbeat came (bounds memory when a node dies).
    """

    period_ms: float = 100.0
    stale_after_ms: float | None = None
    forget_after_ms: float = 60_000.0
    pending_max_age_ms: float = 10_000.0
    _nodes: dict[str, _NodeEntry] = field(default_factory=dict)
    _orphans: dict[str, list[tuple[float, RoutedEvent]]] = field(default_factory=dict)
    _seq: int = 0
    guard: HeartbeatGuard | None = None  #: default: a guard with ``stale_after_ms``

    def __post_init__(self) -> None:
        if self.stale_after_ms is None:
            self.stale_after_ms = 3.0 * self.period_ms
        if self.guard is None:
            self.guard = HeartbeatGuard(stale_after_ms=float(self.stale_after_ms))

    def on_state(self, st: NodeState, now_ms: float, now_unix_ms: float | None = None) -> str | None:
        """A heartbeat arrived (``now_ms``: aggregator monotonic clock; ``now_unix_ms``: its wall
        clock, default ``st.sent_unix_ms`` — no future check). Returns None if it was used, else why
        it was refused (:data:`kairos.core.cluster.heartbeat.REJECT_REASONS`)."""
        assert self.guard is not None
        why = self.guard.check(st.node, st.epoch_unix_ms, st.seq, st.sent_unix_ms, st.period_ms,
                               st.sent_unix_ms if now_unix_ms is None else now_unix_ms, now_ms)
        if why is not None:
            return why
        entry = self._nodes.get(st.node)
        pending = entry.pending if entry else [ev for _, ev in self._orphans.pop(st.node, [])]
        pending = [ev for ev in pending if ev.node_accepted_unix_ms > st.sent_unix_ms]
        self._nodes[st.node] = _NodeEntry(state=st, received_ms=now_ms, pending=pending)
        return None

    def on_routed(self, ev: RoutedEvent, now_ms: float) -> None:
        """A dispatcher routed a job that ``ev.node`` accepted."""
        entry = self._nodes.get(ev.node)
        if entry is None:
            self._orphans.setdefault(ev.node, []).append((now_ms, ev))
            return
        if ev.node_accepted_unix_ms > entry.state.sent_unix_ms:
            entry.pending.append(ev)

    def build(self, now_ms: float, built_unix_ms: float | None = None) -> ClusterView:
        """The view at ``now_ms`` (aggregator clock); forgets long-silent nodes."""
        self._seq += 1
        nodes: list[NodeView] = []
        for nid in sorted(self._nodes):
            e = self._nodes[nid]
            age = now_ms - e.received_ms
            if age > self.forget_after_ms:
                del self._nodes[nid]
                assert self.guard is not None
                self.guard.forget(nid)
                continue
            e.pending = [p for p in e.pending
                         if p.node_accepted_unix_ms >= e.state.sent_unix_ms - self.pending_max_age_ms
                         and age < self.pending_max_age_ms]
            nodes.append(fold_pending(e.state, e.pending, age, stale=age > self.stale_after_ms))
        for nid in list(self._orphans):
            self._orphans[nid] = [(t, ev) for t, ev in self._orphans[nid] if now_ms - t < self.pending_max_age_ms]
            if not self._orphans[nid]:
                del self._orphans[nid]
        return ClusterView(seq=self._seq, built_unix_ms=now_ms if built_unix_ms is None else built_unix_ms,
                           period_ms=self.period_ms, stale_after_ms=float(self.stale_after_ms), nodes=nodes)


class Stamped(Protocol):
    """What orders views: a :class:`ClusterView`, or a reader's partial decode of one (the ingress's
    :class:`kairos.services.ingress.readiness.ReadyView`)."""

    @property
    def seq(self) -> int: ...

    @property
    def built_unix_ms(self) -> float: ...


def newer(view: Stamped, than: Stamped | None) -> bool:
    """Is ``view`` newer than ``than`` (None: no view yet)? By the aggregator's build time, then
    its ``seq`` (a reader may get a view from ``kairos.view`` and, at its start, from the ``kairos_view``
    bucket; a new aggregator's views replace an old one's)."""
    return than is None or (view.built_unix_ms, view.seq) > (than.built_unix_ms, than.seq)


class _ViewStamp(msgspec.Struct):
    """A view's ordering fields alone: decoding them skips the ``nodes`` array (a quarter of a full
    decode at 288 nodes; ``bench/fleet.py``)."""

    seq: int
    built_unix_ms: float


def decode_if_newer(data: bytes, than: ClusterView | None) -> ClusterView | None:
    """The :class:`ClusterView` in ``data`` if it is :func:`newer` than ``than``, else None — and then
    without decoding its nodes (a bucket's last view read at a reconnect, a late copy from a
    former aggregator: dropped at the cost of their stamp).

    Raises:
        WireError: ``data`` is not a view (a stamp that decodes is checked in full before use).
    """
    if than is not None:
        stamp = decode(data, _ViewStamp)
        if (stamp.built_unix_ms, stamp.seq) <= (than.built_unix_ms, than.seq):
            return None
    view = decode(data, ClusterView)
    return view if newer(view, than) else None


def fold_pending(st: NodeState, pending: list[RoutedEvent], age_ms: float, stale: bool) -> NodeView:
    """A node's view: its last state plus the routed jobs it had not yet reported."""
    queue = list(st.queue_prompt_tokens)
    in_flight = list(st.in_flight)
    deflecting = st.deflection_in_flight
    for p in pending:
        if p.kind == "keep" and st.role == "prefill":
            queue.append(p.prompt_tokens)
        elif p.kind == "deflect" and st.role == "decode":
            deflecting = True
            in_flight.append(InFlight(prompt_tokens=p.prompt_tokens, output_tokens=p.output_tokens))
    return NodeView(node=st.node, role=st.role, stale=stale, age_ms=age_ms, accepting=st.accepting,
                    draining=st.draining,
                    batch_size=st.batch_size, kv_tokens=st.kv_tokens, queue_prompt_tokens=queue,
                    deflection_in_flight=deflecting, in_flight=in_flight, waiting=st.waiting,
                    kv_backlog_ms=st.kv_backlog_ms, pending_routed=len(pending),
                    state_sent_unix_ms=st.sent_unix_ms, pending_ids=[p.request_id for p in pending])


def with_corrections(view: ClusterView, corrections: dict[str, StepCorrection]) -> ClusterView:
    """``view`` with each node's learned step-time correction (nodes without one keep the identity)."""
    if not corrections:
        return view
    nodes = [msgspec.structs.replace(n, correction=corrections[n.node]) if n.node in corrections else n
             for n in view.nodes]
    return msgspec.structs.replace(view, nodes=nodes)
