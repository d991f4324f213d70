"""What a dispatcher replica listens to, and what it declares on the bus (at start and after a reconnect).

Subscriptions (core NATS; nats-py re-subscribes them after a reconnect by itself):

* ``kairos.route.decided`` — every replica's routed jobs, folded into this replica's snapshots until
  the view has them;
* ``kairos.view`` — the view as the aggregator built it, the only way views come (the view bucket is
  read once per declare: the last view, until the next one comes here);
* ``kairos.cancel`` — requests the ingress already answered must not be routed when dequeued later;
* ``kairos.state.*`` — prefix-aware policies only: the heartbeats' cache events (origin-checked,
  :mod:`kairos.contracts.origin`).

KV watchers (restarted by every :meth:`ClusterWatch.declare`: a restarted NATS may have lost them,
old ones may sit on consumers that no longer exist): the reservations
(``kairos_reservations``) and, with ``watch_models``, the latency model (``kairos_models`` /
``latency.current``: hot reload, ``kairos profile --publish``). Everything heard goes into the
replica's :class:`~kairos.services.dispatcher.state.RoutingState`.

Declarations: the buckets (:mod:`kairos.runtime.streams`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import nats.errors
from nats.aio.client import Client

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard
from kairos.contracts.events import Cancel
from kairos.contracts.wire import NodeState, RoutedEvent, WireError
from kairos.runtime.messaging import decoded, last_view
from kairos.core.model.latency import LatencyModel
from kairos.runtime.bus import stream_replicas
from kairos.runtime.resources import BackgroundTasks
from kairos.runtime.streams import ensure_buckets, ensure_models_bucket
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.state import RoutingState


class ClusterWatch:
    """The replica's subscriptions, KV watchers and declarations (see the module docstring).

    Args:
        cfg: the replica's configuration.
        state: where what is heard goes.
        origin: checks that a heartbeat comes from the node it names.
        model: the latency model in use (a callable: the router's).
        use_model: called with a newly published latency model (a hot reload).
        log: the replica's logger.
    """

    def __init__(self, cfg: DispatcherConfig, state: RoutingState, origin: OriginGuard,
                 model: Callable[[], LatencyModel], use_model: Callable[[LatencyModel], None], log: Any) -> None:
        self.cfg, self.state, self.origin, self.log = cfg, state, origin, log
        self._model, self._use_model = model, use_model
        self.nc: Client | None = None
        self._watchers: list = []
        self._watch_tasks: list[asyncio.Task] = []
        self._tasks = BackgroundTasks(log)

    # -- declarations -------------------------------------------------------------------------------
    async def declare(self) -> None:
        """Declare the buckets, (re)start the KV watchers: at start and
        after every reconnect (:class:`kairos.runtime.buswatch.BusWatch`)."""
        js = self.nc.jetstream()
        buckets = await ensure_buckets(js, replicas=stream_replicas(self.cfg))
        resv_w = await buckets.reservations.watchall()
        watchers = [resv_w]
        tasks = [self._tasks.spawn(last_view(buckets.view, self._take_view, self.log), "last view"),
                 self._tasks.spawn(self._watch_resv(resv_w), "reservation watcher")]
        if self.cfg.watch_models:  # hot reload of the latency model (kairos profile --publish)
            try:
                models_w = await (await ensure_models_bucket(js, stream_replicas(self.cfg))).watch(S.CURRENT_MODEL_KEY)
            except Exception as exc:  # optional: routing must not wait for it (the next re-declare retries)
                self.log.warning("model_watch_failed", error=repr(exc))
            else:
                watchers.append(models_w)
                tasks.append(self._tasks.spawn(self._watch_models(models_w), "model watcher"))
        old, self._watchers = self._watchers, watchers
        if old:
            self.state.forget_reservations()  # the new watcher replays every live key
        old_tasks, self._watch_tasks = self._watch_tasks, tasks
        for t in old_tasks:
            t.cancel()
        await self._stop_watchers(old)

    async def _stop_watchers(self, watchers: list) -> None:
        for w in watchers:
            try:
                await w.stop()
            except nats.errors.Error as exc:  # its consumer or connection is gone already: nothing left to stop
                self.log.info("kv_watcher_stop_failed", error=repr(exc))

    async def close(self) -> None:
        """Stop the KV watchers and their tasks."""
        await self._tasks.cancel_all()
        await self._stop_watchers(self._watchers)
        self._watchers, self._watch_tasks = [], []

    # -- subscriptions -------------------------------------------------------------------------------
    async def subscribe(self) -> list:
        """Subscribe (see the module docstring); returns the subscriptions (the caller unsubscribes)."""
        nc = self.nc
        subs = [await nc.subscribe(S.ROUTED_SUBJECT, cb=self._on_routed),
                await nc.subscribe(S.VIEW_SUBJECT, cb=self._on_view),
                await nc.subscribe(S.CANCEL_SUBJECT, cb=self._on_cancel)]
        if self.state.prefix is not None:  # heartbeats' incremental cache events → this replica's index
            subs.append(await nc.subscribe(S.STATE_WILDCARD, cb=self._on_state))
        return subs

    async def _on_routed(self, msg) -> None:
        # the aggregator logs every malformed routing event at warning level: once is enough
        if (ev := decoded(msg.data, RoutedEvent, self.log, "bad_routed", "debug")) is None:
            return
        self.state.remember_routed(ev)  # the node's acknowledged event replaces a provisional one

    async def _on_view(self, msg) -> None:
        self._take_view(msg.data)

    def _take_view(self, data: bytes) -> None:
        try:
            self.state.take_view(data)
        except WireError as exc:
            self.log.warning("bad_view", error=str(exc))

    async def _on_cancel(self, msg) -> None:
        if (c := decoded(msg.data, Cancel, self.log, "bad_cancel")) is None:
            return
        self.state.cancelled.add(c.request_id)

    async def _on_state(self, msg) -> None:
        # the aggregator logs every malformed heartbeat at warning level: once is enough
        if (st := decoded(msg.data, NodeState, self.log, "bad_state", "debug")) is None:
            return
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # one node's prefix-cache events are never another's (kairos/contracts/origin.py)
        self.state.on_heartbeat(st)

    # -- KV watchers ---------------------------------------------------------------------------------
    async def _watch_resv(self, watcher) -> None:
        async for e in watcher:
            if e is not None:
                self.state.watched_reservation(e.key, e.revision, e.value, deleted=e.operation is not None)

    async def _watch_models(self, watcher) -> None:
        """Hot-reload: a new artifact under ``latency.current`` replaces the model for the next
        decisions (each decision records the ``name@version`` it used); an invalid one is logged
        and ignored."""
        async for e in watcher:
            if e is None or e.value is None or e.operation is not None:
                continue
            try:
                model = LatencyModel.from_dict(json.loads(e.value))
            except ValueError as exc:  # not JSON, or not a valid artifact (LatencyProfileError is a ValueError)
                self.log.warning("bad_model_artifact", key=e.key, revision=e.revision, error=str(exc))
                continue
            old = self._model().artifact_version
            if model.artifact_version == old:
                continue
            self._use_model(model)
            self.log.info("model_reloaded", model=model.artifact_version, previous=old, revision=e.revision,
                          mape=model.mape)
