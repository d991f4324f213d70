"""Readiness: the cluster view the ingress holds, and ``GET /health`` (docs/services.md).

Where data comes from: the state aggregator's :class:`~kairos.contracts.wire.ClusterView`, twice —
on core NATS (``kairos.view``, as the aggregator built it) and from the view bucket's watch (which
may lag seconds behind while a NATS cluster elects the bucket's leader); the newer one is kept
(:func:`kairos.services.state_aggregator.view.newer`). And the dispatchers' consumers of the request
lanes (JetStream consumer info). Where it goes: ``GET /health`` — 200 only when everything a request
needs is there (NATS connected, a fresh view with a routable prefill and decode node, a dispatcher
consuming the request lanes), else 503 with every reason listed — and the view's node roles to the
liveness watchers.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any, Awaitable, Callable

import nats.js.errors
import orjson
from aiohttp import web

from kairos.contracts import subjects as S
from kairos.contracts.wire import ClusterView, WireError
from kairos.core.cluster.routing import routable
from kairos.runtime.clock import Clock
from kairos.services.ingress.config import IngressConfig
from kairos.services.state_aggregator.view import decode_if_newer


class Readiness:
    """The view intake and the ``/health`` handler.

    Args:
        cfg: the ingress's configuration (staleness, the dispatcher check's interval and window).
        connected: whether NATS is connected now.
        consumer_infos: the dispatchers' consumer info of every request lane (an exception in place
            of a lane that did not answer; kairos/runtime/lanes.py ``consumer_infos``).
        on_view: called with each newer view (the liveness watchers learn the nodes' roles).
        clock, log: clocks and the service's logger.
    """

    def __init__(self, cfg: IngressConfig, connected: Callable[[], bool],
                 consumer_infos: Callable[[], Awaitable[list]], on_view: Callable[[ClusterView], None],
                 clock: Clock, log: Any) -> None:
        self.cfg, self.connected, self.consumer_infos, self.on_view = cfg, connected, consumer_infos, on_view
        self.clock, self.log = clock, log
        self.view: ClusterView | None = None
        self.view_rx: float | None = None  #: monotonic s when the last view arrived
        self._disp: dict | None = None  #: cached dispatcher-consumer check
        self._disp_at = 0.0
        self._disp_lock = asyncio.Lock()

    # -- the view ----------------------------------------------------------------------------------
    async def watch_view(self, watcher: Any) -> None:
        """Take the views of the view bucket's watch (until cancelled)."""
        async for e in watcher:
            if e is None or not e.value or e.operation is not None:
                continue
            self.take_view(e.value)

    async def on_view_msg(self, msg: Any) -> None:
        """A view as the aggregator built it (core NATS, ``kairos.view``): the bucket's watch may lag
        seconds behind while a NATS cluster elects the bucket's leader (/health would say
        ``cluster_view_stale`` meanwhile)."""
        self.take_view(msg.data)

    def take_view(self, data: bytes) -> None:
        try:
            view = decode_if_newer(data, self.view)  # each view comes twice (subject and bucket)
        except WireError:
            return
        if view is None:
            return
        self.view, self.view_rx = view, self.clock.monotonic()
        try:
            self.on_view(view)
        except Exception as exc:  # never let the watcher die (logged; the next view tries again)
            self.log.error("view_check_failed", error=repr(exc))

    def stale_after_ms(self) -> float:
        if self.cfg.view_stale_after_ms > 0:
            return self.cfg.view_stale_after_ms
        return self.view.stale_after_ms if self.view is not None else 0.0

    # -- /health -----------------------------------------------------------------------------------
    async def health(self, _req: web.Request) -> web.Response:
        """Readiness (docs/services.md): 200 only when everything a request needs is there —
        NATS connected, a fresh cluster view (the aggregator is alive) with at least one routable
        prefill and decode node, and a dispatcher consuming the request stream; otherwise 503 with
        every reason listed."""
        connected = self.connected()
        reasons: list[dict[str, str]] = []
        if not connected:
            reasons.append({"code": "nats_disconnected", "message": "the ingress is not connected to NATS"})
        view_age = None if self.view_rx is None else round((self.clock.monotonic() - self.view_rx) * 1000.0, 1)
        limit = self.stale_after_ms()
        if self.view is None:
            reasons.append({"code": "no_cluster_view",
                            "message": "no cluster view received yet (is the state aggregator running?)"})
        elif view_age is not None and view_age > limit:
            reasons.append({"code": "cluster_view_stale",
                            "message": f"the cluster view is {view_age:.0f} ms old (stale after {limit:.0f} ms): "
                                       f"the state aggregator stopped publishing"})
        pfs, dcs = routable(self.view)
        if self.view is not None and (not pfs or not dcs):
            missing = " and ".join(r for r, ns in (("prefill", pfs), ("decode", dcs)) if not ns)
            reasons.append({"code": "no_routable_nodes", "message": f"no routable {missing} node in the cluster view"})
        disp = await self.dispatcher_check() if connected else {"consuming": False, "detail": "not connected"}
        if connected and not disp["consuming"]:
            reasons.append({"code": "no_dispatcher",
                            "message": f"no dispatcher is consuming the request stream ({disp['detail']})"})
        status = reasons[0]["code"] if reasons else "ok"
        body = {"status": status, "reasons": reasons,
                "routable": {"prefill": [n.node for n in pfs], "decode": [n.node for n in dcs]},
                "view_age_ms": view_age, "dispatchers": disp}
        return web.Response(body=orjson.dumps(body), status=503 if reasons else 200, content_type="application/json")

    async def dispatcher_check(self) -> dict:
        """Is some dispatcher consuming the work queue? Cached ``dispatcher_check_interval_s``.

        Rule: the shared consumer has a pull request waiting (``num_waiting`` > 0; an idle
        dispatcher always has one outstanding) or delivered a message within
        ``dispatcher_active_window_s`` (a busy one). A zero ``num_waiting`` is re-read once after
        100 ms, as a dispatcher renews its pull request every second.
        """
        if (cached := self._cached()) is not None:
            return cached
        async with self._disp_lock:
            if (cached := self._cached()) is not None:
                return cached
            out = await self._consumer_state()
            if not out["consuming"] and out.get("num_waiting") == 0:
                await self.clock.sleep(0.1)
                out = await self._consumer_state()
            self._disp, self._disp_at = out, self.clock.monotonic()
            return out

    def _cached(self) -> dict | None:
        if self._disp is not None and self.clock.monotonic() - self._disp_at < self.cfg.dispatcher_check_interval_s:
            return self._disp
        return None

    async def _consumer_state(self) -> dict:
        """The dispatchers' consumers on every request lane, read at once; a lane that does not
        answer (its member is down) is left out while another answers."""
        infos = await self.consumer_infos()
        ok = [i for i in infos if not isinstance(i, BaseException)]
        if not ok:
            if all(isinstance(i, nats.js.errors.NotFoundError) for i in infos):
                return {"consuming": False, "detail": f"consumer {S.DISPATCHER_CONSUMER!r} on stream "
                                                      f"{S.REQUEST_STREAM!r} does not exist: no dispatcher ever started"}
            self.log.warning("consumer_info_failed", error=repr(infos[0]))  # the body names no exception
            return {"consuming": False, "detail": "the consumer state could not be read from JetStream"}
        waiting = sum(i.num_waiting or 0 for i in ok)
        lasts = [i.delivered.last_active for i in ok if i.delivered is not None and i.delivered.last_active]
        since = None
        if lasts:
            since = round((datetime.datetime.now(datetime.timezone.utc) - max(lasts)).total_seconds(), 3)
        window = self.cfg.dispatcher_active_window_s
        consuming = waiting > 0 or (since is not None and since <= window)
        detail = "ok" if consuming else f"no pull request waiting and no delivery in the last {window:g} s"
        return {"consuming": consuming, "detail": detail, "num_waiting": waiting, "last_delivery_s_ago": since,
                "num_pending": sum(i.num_pending or 0 for i in ok),
                "num_ack_pending": sum(i.num_ack_pending or 0 for i in ok), "lanes_answering": len(ok)}
