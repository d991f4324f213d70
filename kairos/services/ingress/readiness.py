"""Readiness: the cluster view the ingress holds, and ``GET /health`` (docs/services.md).

Where data comes from: the state aggregator's :class:`~kairos.contracts.wire.ClusterView` on core
NATS (``kairos.view``, as the aggregator built it; the view bucket's last view is read once at start
and after a reconnect, kairos.runtime.messaging.last_view); the newest is kept
(:func:`kairos.services.state_aggregator.view.newer`), decoded into :class:`ReadyView` — the few fields
read here, not every node's queues (a cost per node per view: 10 views/s of 288 nodes at fleet
scale, ``bench/view_costs.py``). And whether a dispatcher answers a ping on the queue group it takes
requests from. Where it goes: ``GET /health`` — 200 only when everything a request
needs is there (NATS connected, a fresh view with a routable prefill and decode node, a dispatcher
taking requests), else 503 with every reason listed — and the view's node roles to the
liveness watchers.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import msgspec
import orjson
from aiohttp import web

from kairos.contracts import subjects as S
from kairos.contracts.wire import ClusterView, NodeRole, NonNeg, WireError, decode
from kairos.core.cluster.routing import routable
from kairos.runtime.clock import Clock
from kairos.services.ingress.config import IngressConfig
from kairos.services.state_aggregator.view import newer


class ReadyNode(msgspec.Struct, frozen=True, kw_only=True):
    """What the ingress reads of a :class:`~kairos.contracts.wire.NodeView`: its id and role (the
    liveness watchers), and what :func:`~kairos.core.cluster.routing.routable` filters on. The
    NodeView's other fields (queues, in-flight work, pending ids, corrections) are skipped by the
    decoder, unread and unvalidated; the required ones here are NodeView's required ones."""

    node: str
    role: NodeRole
    stale: bool  #: no heartbeat for the view's stale_after_ms: route nothing here
    age_ms: float  #: time since the aggregator received the node's last heartbeat, at build time
    accepting: bool = True  #: False while draining
    draining: bool = False  #: the node drains (issue 33): /health lists it


class ReadyView(msgspec.Struct, frozen=True, kw_only=True):
    """What the ingress reads of a :class:`~kairos.contracts.wire.ClusterView` (the same names and
    types): its stamp (``seq``, ``built_unix_ms``: the newer-view rule), ``stale_after_ms`` (the
    /health staleness limit) and each node's :class:`ReadyNode`."""

    seq: NonNeg
    built_unix_ms: float  #: the aggregator's wall clock when it built the view, ms
    period_ms: float  #: heartbeat period of the nodes, ms
    stale_after_ms: float  #: a node silent this long is stale, ms
    nodes: list[ReadyNode] = []


class Readiness:
    """The view intake and the ``/health`` handler.

    Args:
        cfg: the ingress's configuration (staleness, the dispatcher check's interval and window).
        connected: whether NATS is connected now.
        ping_dispatchers: pings the dispatchers' queue group once: None when one answered, else why
            not (``no_responders``: none subscribes; ``timeout``; ``disconnected``).
        on_view: called with each newer view, as a :class:`ReadyView` (the liveness watchers learn
            the nodes' roles).
        clock, log: clocks and the service's logger.
    """

    def __init__(self, cfg: IngressConfig, connected: Callable[[], bool],
                 ping_dispatchers: Callable[[], Awaitable[str | None]], on_view: Callable[[ReadyView], None],
                 clock: Clock, log: Any) -> None:
        self.cfg, self.connected, self.ping_dispatchers, self.on_view = cfg, connected, ping_dispatchers, on_view
        self.clock, self.log = clock, log
        self.ready: ReadyView | None = None  #: the newest view received (what /health reads of it)
        self.view_rx: float | None = None  #: monotonic s when the last view arrived
        self._data: bytes | None = None  #: the newest view's body, for :attr:`view`
        self._full: ClusterView | None = None  #: :attr:`view`, once decoded
        self._disp: dict | None = None  #: cached dispatcher-consumer check
        self._disp_at = 0.0
        self._waiting_seen: float | None = None  #: monotonic s when a dispatcher last answered a ping
        self._disp_lock = asyncio.Lock()

    # -- the view ----------------------------------------------------------------------------------
    async def on_view_msg(self, msg: Any) -> None:
        """A view as the aggregator built it (core NATS, ``kairos.view``): how views come (the view
        bucket is read once at start and after a reconnect, kairos.runtime.messaging.last_view)."""
        self.take_view(msg.data)

    def take_view(self, data: bytes) -> None:
        """Keep the view in ``data`` if it is :func:`~kairos.services.state_aggregator.view.newer` than
        the one held; a body that is not a view is ignored. The bucket's last view may be the one the
        subject just brought, as the same bytes: dropped on a byte comparison, before any decoding."""
        if data == self._data:
            return
        try:
            view = decode(data, ReadyView)
        except WireError:
            return
        if not newer(view, self.ready):
            return
        self.ready, self.view_rx = view, self.clock.monotonic()
        self._data, self._full = data, None
        try:
            self.on_view(view)
        except Exception as exc:  # never let the watcher die (logged; the next view tries again)
            self.log.error("view_check_failed", error=repr(exc))

    @property
    def view(self) -> ClusterView | None:
        """The newest view in full (every node's queues, pending ids, corrections), decoded on first
        read and kept until a newer view arrives; nothing in the ingress's request path reads it.
        None before the first view, or if its nodes are not all NodeViews (fields :class:`ReadyNode`
        skips: the aggregator never writes such a view)."""
        if self._full is None and self._data is not None:
            try:
                self._full = decode(self._data, ClusterView)
            except WireError:
                return None
        return self._full

    def stale_after_ms(self) -> float:
        if self.cfg.view_stale_after_ms > 0:
            return self.cfg.view_stale_after_ms
        return self.ready.stale_after_ms if self.ready is not None else 0.0

    # -- /health -----------------------------------------------------------------------------------
    async def health(self, _req: web.Request) -> web.Response:
        """Readiness (docs/services.md): 200 only when everything a request needs is there —
        NATS connected, a fresh cluster view (the aggregator is alive) with at least one routable
        prefill and decode node, and a dispatcher taking requests; otherwise 503 with
        every reason listed."""
        connected = self.connected()
        reasons: list[dict[str, str]] = []
        if not connected:
            reasons.append({"code": "nats_disconnected", "message": "the ingress is not connected to NATS"})
        view_age = None if self.view_rx is None else round((self.clock.monotonic() - self.view_rx) * 1000.0, 1)
        limit = self.stale_after_ms()
        if self.ready is None:
            reasons.append({"code": "no_cluster_view",
                            "message": "no cluster view received yet (is the state aggregator running?)"})
        elif view_age is not None and view_age > limit:
            reasons.append({"code": "cluster_view_stale",
                            "message": f"the cluster view is {view_age:.0f} ms old (stale after {limit:.0f} ms): "
                                       f"the state aggregator stopped publishing"})
        pfs, dcs = routable(self.ready)  # type: ignore[arg-type]  # ReadyNode has every field routable reads
        if self.ready is not None and (not pfs or not dcs):
            missing = " and ".join(r for r, ns in (("prefill", pfs), ("decode", dcs)) if not ns)
            reasons.append({"code": "no_routable_nodes", "message": f"no routable {missing} node in the cluster view"})
        disp = await self.dispatcher_check() if connected else {"consuming": False, "detail": "not connected"}
        if connected and not disp["consuming"]:
            reasons.append({"code": "no_dispatcher",
                            "message": f"no dispatcher is taking requests ({disp['detail']})"})
        status = reasons[0]["code"] if reasons else "ok"
        body = {"status": status, "reasons": reasons,
                "routable": {"prefill": [n.node for n in pfs], "decode": [n.node for n in dcs]},
                "draining": [n.node for n in self.ready.nodes if n.draining and not n.stale]
                if self.ready is not None else [],
                "view_age_ms": view_age, "dispatchers": disp}
        return web.Response(body=orjson.dumps(body), status=503 if reasons else 200, content_type="application/json")

    async def dispatcher_check(self) -> dict:
        """Is some dispatcher taking requests? Cached ``dispatcher_check_interval_s``.

        Rule: a ping on ``kairos.req.route`` (the dispatchers' queue group, header ``Kairos-Ping``) is
        answered within a second. A first ping unanswered is sent again once (a replica busy for a
        moment); then a ping answered within ``dispatcher_active_window_s`` counts (a loaded machine:
        without it /health flapped to 503 under load). The first one must be answered: right after
        start, /health is 503 until a dispatcher subscribes.
        """
        if (cached := self._cached()) is not None:
            return cached
        async with self._disp_lock:
            if (cached := self._cached()) is not None:
                return cached
            why = await self.ping_dispatchers()
            if why is not None and why != "no_responders":
                why = await self.ping_dispatchers()
            now = self.clock.monotonic()
            if why is None:
                self._waiting_seen = now
                out = {"consuming": True, "detail": "ok"}
            elif self._waiting_seen is not None and now - self._waiting_seen <= self.cfg.dispatcher_active_window_s:
                out = {"consuming": True, "detail": f"ok: a dispatcher answered {now - self._waiting_seen:.1f} s ago"}
            elif why == "no_responders":
                out = {"consuming": False, "detail": f"no dispatcher subscribes to {S.ROUTE_SUBJECT!r}"}
            else:
                out = {"consuming": False, "detail": f"no dispatcher answered a ping on {S.ROUTE_SUBJECT!r} ({why})"}
            self._disp, self._disp_at = out, now
            return out

    def _cached(self) -> dict | None:
        if self._disp is not None and self.clock.monotonic() - self._disp_at < self.cfg.dispatcher_check_interval_s:
            return self._disp
        return None
