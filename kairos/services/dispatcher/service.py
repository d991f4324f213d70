"""Dispatcher replica: work-queue requests in, one accepted job per request out.

Per request (rules in :mod:`kairos.core.cluster.routing`, decision in :mod:`kairos.core.policy`):

1. snapshot from the watched cluster view + the reservations (watched, and from the nodes' job
   answers) + this replica's deflection jobs not answered yet, minus nodes excluded so far;
2. ``policy.decide``; a deflection onto a decode node whose slots are all held becomes a keep;
3. the job goes to the node by request-reply; a refusal excludes the node and routing starts
   over — a re-route, never a drop. No responder, a timeout or ``claim_failed`` is the bus's fault
   while the node is live in the view: routing starts over after a short backoff without excluding
   it, for at most ``bus_retry_s`` (:mod:`kairos.services.dispatcher.busretry`). A decode node refuses a deflection
   beyond its slots (``deflection_in_flight``: the node is then shown full and the policy runs
   again); the node that accepts one publishes its reservation (docs/bus.md);
4. accepted: routing event (aggregator, ingress, replicas), span with ``kairos.*`` attributes,
   the decision record (KV; written in the background: the ack does not wait for its PubAck),
   then the work-queue message is acknowledged. A replica that dies before that point leaves the
   message unacknowledged and another replica gets it after ``ack_wait_s``.

Nothing routable for ``no_node_wait_s`` (or every node refused) → an explicit 503 error event to
the client, then ack.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import time

import msgspec
import nats.errors
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from kairos.services.dispatcher import faults
from kairos.services.dispatcher.busretry import BusRetry
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.runtime.service import start_metrics_and_connect
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.contracts.permissions import DISPATCHER
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import (BusWatch, RequestQueueSettings, ensure_buckets, ensure_models_bucket, flush_barrier,
                        kv_put_nowait, publish, request_typed, stream_replicas)
from kairos.runtime.lanes import check_lane_count, declare_each, ensure_claim_buckets, ensure_lane, lane_count, lane_of
from kairos.core.model.latency import LatencyModel, ProfileError, load_profile
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.core.policy import Decision
from kairos.core.policy import parse_policy
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.cluster.recent import RecentIds
from kairos.core.cluster.routing import (build_snapshot, fold_recent, keep_instead, live_reservations, make_job,
                            predicted_ttft_ms, reservation_ttl_s)
from kairos.services.state_aggregator.view import newer
from kairos.contracts.wire import (Cancel, Claim, ClusterView, DecisionRecord, ErrorEvent, InferenceRequest, Job, JobAck,
                         NodeState, Reservation, RoutedEvent, WireError, decode, encode, now_ms)

#: routed events kept for folding into the view (the aggregator folds them within one Δh)
RECENT_ROUTED_S = 5.0
#: after a reconnect, "no responders"/timeouts for this long do not exclude a node (agents reconnect
#: at their own pace, up to reconnect_time_wait + jitter later)
RECONNECT_SETTLE_S = 3.0
#: cancelled request ids remembered (a request can wait in the queue while all dispatchers are down)
MAX_CANCELLED = 100_000
#: the request lane of the message the current task routes (each request is handled in a task of its own)
_LANE: contextvars.ContextVar[int | None] = contextvars.ContextVar("kairos_request_lane", default=None)
#: a request lane that cannot be pulled is declared again this often (s): its member came back
#: with an empty store, or was down when this replica started
LANE_REDECLARE_S = 2.0
#: longest time (ms) a deflection job this replica sent holds its slot in this replica's view
#: before the node's answer (the job ack timeout is shorter; a safety net for a routing task that died)
PENDING_DEFLECTION_MS = 5000.0


class _Metrics:
    """The dispatcher's Prometheus metrics (docs/observability.md has the table)."""

    def __init__(self, reg) -> None:
        T = telemetry
        self.decisions = Counter("kairos_dispatcher_decisions_total", "Requests routed, by the decision carried out",
                                 ("policy", "decision", "reason"), registry=reg)
        self.decide = Histogram("kairos_dispatcher_decision_seconds",
                                "Policy evaluation time per routed request (all attempts)", registry=reg,
                                buckets=T.DECIDE_BUCKETS)
        self.route = Histogram("kairos_dispatcher_routing_seconds", "Dequeue to a node accepting the job",
                               registry=reg, buckets=T.ROUTING_BUCKETS)
        self.state_age = Histogram("kairos_dispatcher_decision_state_age_seconds",
                                   "Age of the cluster state a routed decision used", registry=reg,
                                   buckets=T.STATE_AGE_BUCKETS)
        self.conflicts = Counter("kairos_dispatcher_reservation_conflicts_total",
                                 "Deflections that found the decode node's slots taken (node_refused: the node "
                                 "refused it, deflection_in_flight — another replica's deflection got there first)",
                                 ("source",), registry=reg)
        for source in ("node_refused",):  # known label values start at 0 (rate() works at once)
            self.conflicts.labels(source)
        self.reroutes = Counter("kairos_dispatcher_reroutes_total", "Jobs re-routed after a node refused or was silent",
                                ("why",), registry=reg)
        self.bus_retries = Counter("kairos_dispatcher_bus_retries_total",
                                   "Jobs sent again, the node not excluded, after a bus fault (no responders, no "
                                   "answer, claim not stored: a NATS cluster failing over)", ("why",), registry=reg)
        self.errors = Counter("kairos_dispatcher_errors_total", "Requests answered with an error", ("code",),
                              registry=reg)
        self.redeliveries = Counter("kairos_dispatcher_redeliveries_total",
                                    "JetStream redeliveries received (a request whose earlier delivery was not "
                                    "acknowledged in time)", registry=reg)
        self.adopted = Counter("kairos_dispatcher_claimed_elsewhere_total",
                               "Requests found already claimed by a node (an earlier delivery's job was accepted): "
                               "recorded as routed there, not executed again", registry=reg)
        self.expired = Counter("kairos_dispatcher_expired_total",
                               "Requests dequeued after their deadline (the ingress had answered 504)", registry=reg)
        self.inflight = Gauge("kairos_dispatcher_requests_in_flight", "Requests being routed by this replica",
                              registry=reg)


class Dispatcher:
    def __init__(self, cfg: DispatcherConfig, model: LatencyModel | None = None) -> None:
        self.cfg = cfg
        self.lanes = lane_count(cfg)  #: request lanes / claim buckets (one per NATS member, kairos/runtime/lanes.py)
        self.model = model or load_profile(cfg.profile)
        self.policy = parse_policy(cfg.policy)
        self.params = cfg.params(self.model.engine.max_num_batched_tokens)
        self.tel = telemetry.setup("dispatcher", cfg.replica_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log.bind(replica=cfg.replica_id)
        self.m = _Metrics(self.tel.registry)
        self.origin = OriginGuard(forged_counter("dispatcher", self.tel.registry), self.log)
        self.view: ClusterView | None = None
        self.reservations: dict[str, Reservation] = {}
        #: reservation key -> the newest revision applied (watched, or from a node's job answer):
        #: an older event of the key arriving later is ignored
        self.resv_rev: dict[str, int] = {}
        #: request id -> the slot its deflection holds here from the decision until the decode node
        #: answers the job (at the latest PENDING_DEFLECTION_MS): this replica's next decisions see
        #: the slot taken at once, before the node's reservation is watched
        self.pending_deflections: dict[str, Reservation] = {}
        #: request id -> (monotonic s when heard, its routed event), oldest first: O(1) replace/forget
        #: per event (a list scan per routed event was quadratic in the rate, issue 12)
        self.recent_routed: dict[str, tuple[float, RoutedEvent]] = {}
        self.cancelled = RecentIds(MAX_CANCELLED)  # request ids cancelled (maybe before they were pulled)
        self._subs: list = []
        self.metrics_port: int | None = None
        self.routed = 0
        #: prefix caches of the nodes, fed by their heartbeats' cache events (prefix-aware policies only)
        self.prefix: PrefixIndex | None = (PrefixIndex(cfg.prefix_block_tokens)
                                           if self.policy.uses_prefix_caches(self.params) else None)
        self._view_changed = asyncio.Event()
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._main: list[asyncio.Task] = []
        self._watchers: list = []
        self._watch_tasks: list[asyncio.Task] = []
        self._runner = None
        self._bus: BusWatch | None = None
        self.nc = None
        self.js = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        await start_metrics_and_connect(self, f"dispatcher:{cfg.replica_id}")
        await check_lane_count(self.nc.jetstream(timeout=2.0), self.lanes)
        await self._declare()
        # routed jobs of every replica (folded into the view until the aggregator has them) and
        # cancels (requests the ingress already answered must not be routed when dequeued later)
        self._subs = [await self.nc.subscribe(S.ROUTED_SUBJECT, cb=self._on_routed),
                      await self.nc.subscribe(S.VIEW_SUBJECT, cb=self._on_view),
                      await self.nc.subscribe(S.CANCEL_SUBJECT, cb=self._on_cancel)]
        if self.prefix is not None:  # heartbeats' incremental cache events → this replica's index
            self._subs.append(await self.nc.subscribe(S.STATE_WILDCARD, cb=self._on_state))
        self._main = [asyncio.create_task(self._pull(lane)) for lane in range(self.lanes)]
        self._bus = BusWatch(self.nc, self._declare, log=self.log).start()
        self.log.info("dispatcher_started", policy=self.policy.spec, model=self.model.artifact_version,
                      metrics_port=self.metrics_port)

    async def _declare(self) -> None:
        """Declare the request stream, its consumer and the buckets, and (re)start the KV watchers:
        at start and after every reconnect (a restarted NATS may have lost them; old watchers may
        sit on consumers that no longer exist)."""
        js = self.js = self.nc.jetstream()
        self.buckets = await ensure_buckets(js, replicas=stream_replicas(self.cfg))
        view_w = await self.buckets.view.watch(S.VIEW_KEY)
        resv_w = await self.buckets.reservations.watchall()
        new_watchers = [view_w, resv_w]
        new_tasks = [asyncio.create_task(self._watch_view(view_w)), asyncio.create_task(self._watch_resv(resv_w))]
        if self.cfg.watch_models:  # hot reload of the latency model (kairos profile --publish)
            try:
                models_w = await (await ensure_models_bucket(js, stream_replicas(self.cfg))).watch(S.CURRENT_MODEL_KEY)
            except Exception as exc:  # optional: routing must not wait for it (the next re-declare retries)
                self.log.warning("model_watch_failed", error=repr(exc))
            else:
                new_watchers.append(models_w)
                new_tasks.append(asyncio.create_task(self._watch_models(models_w)))
        old, self._watchers = self._watchers, new_watchers
        if old:
            self.reservations.clear()  # the new watcher replays every live key
            self.resv_rev.clear()
        old_tasks, self._watch_tasks = self._watch_tasks, new_tasks
        for t in old_tasks:
            t.cancel()
        for w in old:
            try:
                await w.stop()
            except Exception:
                pass
        # the lanes last: a lane whose member is down fails its declaration (logged; its pull loop
        # declares it again), and the watchers above must not wait for that
        await declare_each("request_lane", self.lanes, self._declare_lane, self.log)
        await ensure_claim_buckets(js, self.lanes, self.log)

    async def _declare_lane(self, lane: int) -> None:
        await ensure_lane(self.nc.jetstream(), lane, self.lanes, RequestQueueSettings().max_age_s,
                          consumer=(self.cfg.ack_wait_s, self.cfg.max_deliver))

    async def close(self, drain: bool = True) -> None:
        """Stop pulling; ``drain`` waits for in-flight requests (else they are redelivered elsewhere)."""
        self._stop.set()
        if self._bus is not None:
            await self._bus.stop()
        for t in [*self._main, *self._watch_tasks]:
            t.cancel()
        await asyncio.gather(*self._main, *self._watch_tasks, return_exceptions=True)
        if drain and self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)
        for t in self._tasks:
            t.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        for w in self._watchers:
            try:
                await w.stop()
            except Exception:
                pass
        await bus_close(self.nc, graceful=drain)
        if self._runner is not None:
            await self._runner.cleanup()
        self.tel.shutdown()

    async def _watch_models(self, watcher) -> None:
        """Hot-reload: a new artifact under ``latency.current`` replaces the model for the next
        decisions (each decision records the ``name@version`` it used); an invalid one is logged
        and ignored."""
        async for e in watcher:
            if e is None or e.value is None or e.operation is not None:
                continue
            try:
                model = LatencyModel.from_dict(json.loads(e.value))
            except (ProfileError, ValueError) as exc:
                self.log.warning("bad_model_artifact", key=e.key, revision=e.revision, error=str(exc))
                continue
            if model.artifact_version == self.model.artifact_version:
                continue
            old, self.model = self.model.artifact_version, model
            self.params = self.cfg.params(model.engine.max_num_batched_tokens)
            self.log.info("model_reloaded", model=model.artifact_version, previous=old, revision=e.revision,
                          mape=model.mape)

    async def _watch_view(self, watcher) -> None:
        async for e in watcher:
            if e is None or e.value is None or e.operation is not None:
                continue
            self._take_view(e.value)

    async def _on_view(self, msg) -> None:
        """A view as the aggregator built it (core NATS, ``kairos.view``): the bucket's watch may lag
        seconds behind while a NATS cluster elects the bucket's leader."""
        self._take_view(msg.data)

    def _take_view(self, data: bytes) -> None:
        try:
            view = decode(data, ClusterView)
        except WireError as exc:
            self.log.warning("bad_view", error=str(exc))
            return
        if not newer(view, self.view):  # each view comes twice (subject and bucket)
            return
        self.view = view
        self._prune_routed(view)
        self._view_changed.set()

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

    def _provisional(self, req: InferenceRequest, node: str, decode_node: str) -> None:
        """A keep-path job this replica is sending: fold it into its own snapshots right away
        (concurrent requests of one replica would otherwise all see the same queue)."""
        self._remember_routed(RoutedEvent(
            request_id=req.request_id, kind="keep", node=node, decode_node=decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=float("inf")))

    async def _on_state(self, msg) -> None:
        try:
            st = decode(msg.data, NodeState)
        except WireError:
            return  # the aggregator logs malformed heartbeats
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # one node's prefix-cache events are never another's (kairos/contracts/origin.py)
        if st.cache_block_tokens:
            self.prefix.on_heartbeat(st.node, st.seq, st.cache_block_tokens, st.cache_stored, st.cache_removed,
                                     st.cache_full)

    def _prefix_hits(self, req: InferenceRequest) -> dict[str, int]:
        """node → leading prompt tokens of ``req`` its prefix cache holds (empty: unknown/none)."""
        if self.prefix is None or not req.block_hashes or req.block_hash_tokens != self.prefix.block_tokens:
            return {}
        return self.prefix.match_tokens(req.block_hashes, req.prompt_tokens)

    def _forget_routed(self, request_id: str) -> None:
        self.recent_routed.pop(request_id, None)

    def _remember_routed(self, ev: RoutedEvent) -> None:
        """Keep ``ev`` (replacing any earlier event of its request, e.g. a provisional one) as the newest."""
        self.recent_routed.pop(ev.request_id, None)
        self.recent_routed[ev.request_id] = (time.monotonic(), ev)

    async def _on_routed(self, msg) -> None:
        try:
            ev = decode(msg.data, RoutedEvent)
        except WireError:
            return
        self._remember_routed(ev)  # the node's acknowledged event replaces a provisional one

    def _recent_routed(self):
        """Routed events younger than RECENT_ROUTED_S (older ones are in the view by now)."""
        now, recent = time.monotonic(), self.recent_routed
        for rid in list(itertools.takewhile(lambda k: now - recent[k][0] > RECENT_ROUTED_S, recent)):
            del recent[rid]
        return (ev for _, ev in recent.values())

    async def _on_cancel(self, msg) -> None:
        try:
            c = decode(msg.data, Cancel)
        except WireError:
            return
        self.cancelled.add(c.request_id)

    async def _watch_resv(self, watcher) -> None:
        async for e in watcher:
            if e is None:
                continue
            if S.node_of_reservation_key(e.key) is None:
                continue
            if e.revision is not None:
                if e.revision <= self.resv_rev.get(e.key, 0):
                    continue  # already applied from the node's job answer (or older than what was)
                self.resv_rev[e.key] = e.revision
            if e.operation is not None or not e.value:  # DEL / PURGE / TTL-expiry marker
                self.reservations.pop(e.key, None)
                continue
            try:
                r = self.reservations[e.key] = decode(e.value, Reservation)
            except WireError:
                self.reservations.pop(e.key, None)
                continue
            self.pending_deflections.pop(r.request_id, None)  # the node's own reservation replaces it

    async def _pull(self, lane: int) -> None:
        """Pull request lane ``lane`` (kairos/runtime/lanes.py) one message at a time while this replica
        has room (``max_concurrency``, shared by every lane). A lane that cannot be pulled (its
        member down, or its consumer never declared because the member was down) is declared
        again every :data:`LANE_REDECLARE_S` until it answers; the other lanes go on meanwhile."""
        sub, failing_since, declared_at = None, None, 0.0
        while not self._stop.is_set():
            await self._sem.acquire()
            self._sem.release()
            try:
                if sub is None:
                    sub = await self.nc.jetstream().pull_subscribe_bind(durable=S.DISPATCHER_CONSUMER,
                                                                        stream=S.request_stream(lane))
                # one message per pull: a lingering pull the server answers with the next request (a
                # batch pull costs an extra "no more messages" status per fetch, and requests arrive
                # one by one; under a backlog each pull still returns at once)
                msgs = await sub.fetch(batch=1, timeout=1.0)
                failing_since = None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as exc:  # disconnected (nats-py reconnects), or the lane's member is down
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.log.warning("fetch_failed", lane=lane, error=repr(exc))
                await asyncio.sleep(0.2)
                if time.monotonic() - declared_at > LANE_REDECLARE_S and self.nc.is_connected:
                    declared_at = time.monotonic()
                    try:
                        await asyncio.wait_for(self._declare_lane(lane), LANE_REDECLARE_S)
                    except Exception:
                        pass
                continue
            for m in msgs:
                # every lane pulls: a message may wait here for a free slot; it must not pass its ack wait
                while True:
                    try:
                        await asyncio.wait_for(self._sem.acquire(), self.cfg.ack_wait_s / 2)
                        break
                    except (asyncio.TimeoutError, TimeoutError):
                        try:
                            await m.in_progress()
                        except Exception:  # disconnected: it is redelivered, and its claim keeps it to one run
                            pass
                t = asyncio.create_task(self._handle(m))
                self._tasks.add(t)
                t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        self._sem.release()
        if not t.cancelled() and t.exception() is not None:
            self.log.error("handler_failed", error=repr(t.exception()))

    # -- one request ----------------------------------------------------------------------------
    async def _handle(self, msg) -> None:
        try:
            req = decode(msg.data, InferenceRequest)
        except WireError as exc:
            self.log.error("bad_request_message", error=str(exc))
            await msg.term()
            return
        T = telemetry
        _LANE.set(lane_of(msg.metadata.stream, self.lanes))
        delivery = msg.metadata.num_delivered
        if delivery > 1:
            self.m.redeliveries.inc()
        self.m.inflight.inc()
        with self.tel.tracer.start_as_current_span(
                "dispatcher.decide", context=T.extract_context(msg.headers), kind=SpanKind.CONSUMER, attributes={
                    T.REQUEST_ID: req.request_id, "kairos.replica_id": self.cfg.replica_id,
                    "kairos.policy": self.policy.spec, "kairos.model_version": self.model.artifact_version,
                    "kairos.prompt_tokens": req.prompt_tokens, "kairos.max_tokens": req.max_tokens,
                    T.GEN_AI_REQUEST_MODEL: req.model, T.GEN_AI_USAGE_INPUT_TOKENS: req.prompt_tokens,
                    T.GEN_AI_REQUEST_MAX_TOKENS: req.max_tokens, T.MESSAGING_SYSTEM: "nats",
                    T.MESSAGING_DESTINATION: msg.subject, T.MESSAGING_OPERATION_TYPE: "process",
                    T.MESSAGING_DELIVERY_COUNT: delivery, "kairos.delivery": delivery}) as span:
            log = self.log.bind(request_id=req.request_id, **T.trace_fields(span))
            try:
                if req.deadline_unix_ms <= now_ms() or req.request_id in self.cancelled:
                    span.set_attribute("kairos.outcome", "expired")
                    self.m.expired.inc()
                    log.info("request_expired")  # the ingress has already answered (504 / client gone)
                    await msg.ack()
                    return
                faults.die("before_decide")
                try:
                    await self._route(req, msg, span, log)
                except Exception as exc:
                    log.error("routing_failed", error=repr(exc))
                    span.record_exception(exc)
                    # the client sees no exception name; the log line above has it, with the request id
                    await self._error(req, 500, "routing_failed", f"dispatcher {self.cfg.replica_id} could not route "
                                                                  "the request (internal error)", span)
                faults.die("before_ack")
                await msg.ack()
            finally:
                self.m.inflight.dec()

    async def _route(self, req: InferenceRequest, msg, span, log) -> None:
        t_start = time.perf_counter()
        excluded: dict[str, str] = {}
        conflicts: list[str] = []
        full: set[str] = set()  # decode nodes whose slots this request found taken (conflict or refusal)
        decide_ms = 0.0
        attempts = 0
        waited_since: float | None = None
        rid = req.request_id
        max_attempts = 2 * (len(self.view.nodes) if self.view else 4) + 4
        hits = self._prefix_hits(req)
        bus_retry = BusRetry(self.cfg.bus_retry_s)
        #: node -> (decision, job) of this routing's try there that met a bus fault: its claim may be
        #: stored although its answer was lost (an orphan another node then reports as "claimed")
        bus_faulted: dict[str, tuple[Decision, Job]] = {}
        while True:
            if rid in self.cancelled:  # its cancel came in while it was being routed: send no job
                span.set_attribute("kairos.outcome", "cancelled")
                log.info("request_cancelled_while_routing", attempts=attempts)
                return
            now = now_ms()
            held = live_reservations(self._reservations_and_pending(), now)
            view = fold_recent(self.view, self._recent_routed())
            snap = build_snapshot(req, view, held, excluded, now, self.cfg.max_deflections_per_node, full, hits)
            if snap is None:
                if waited_since is None:
                    span.add_event("waiting_for_nodes", {"excluded": [f"{k}:{v}" for k, v in excluded.items()]})
                waited_since = waited_since or time.monotonic()
                left = self.cfg.no_node_wait_s - (time.monotonic() - waited_since)
                if left <= 0 or excluded:
                    why = "every node refused or did not answer" if excluded else "no live prefill and decode node"
                    await self._error(req, 503, "no_available_node", f"{why} (excluded: {excluded})", span)
                    return
                self._view_changed.clear()
                try:
                    await asyncio.wait_for(self._view_changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass
                await msg.in_progress()
                continue
            t0 = time.perf_counter()
            decision = self.policy.decide(snap, self.model, self.params)
            decide_ms += (time.perf_counter() - t0) * 1000.0
            resv_ttl = 0
            if decision.deflected:
                node = decision.node
                taken = sum(1 for r in held.values() if r.decode_node == node and r.request_id != rid)
                if node in full or taken >= self.cfg.max_deflections_per_node:
                    decision = keep_instead(decision, snap, self.model, self.params, "keep_reservation_conflict")
                else:
                    resv_ttl = reservation_ttl_s(decision, self.cfg.reservation_ttl_s)
                    self.pending_deflections[rid] = Reservation(
                        request_id=rid, decode_node=node, dispatcher_id=self.cfg.replica_id,
                        prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, created_unix_ms=now,
                        expires_unix_ms=now + PENDING_DEFLECTION_MS)
            faults.die("after_decide")
            attempts += 1
            job = msgspec.structs.replace(make_job(decision, req, snap, self.cfg.replica_id, attempts - 1, resv_ttl),
                                          claim_buckets=self.lanes)
            if not decision.deflected:  # count it in the view at once; the node's ack replaces it
                self._provisional(req, decision.node, decision.decode_node)
            headers = telemetry.inject_headers()
            why = None
            if faults.armed("after_publish"):  # the job reaches the node; this replica dies before the answer
                await self.nc.publish(S.jobs_subject(decision.node), encode(job), reply=self.nc.new_inbox(),
                                      headers=headers)
                await flush_barrier(self.nc)
                faults.die("after_publish")
            try:
                ack = await request_typed(self.nc, S.jobs_subject(decision.node), job, JobAck,
                                          self.cfg.job_ack_timeout_s, headers)
                if not ack.accepted:
                    why = ack.reason or "refused"
            except nats.errors.NoRespondersError:
                why = "no_responders"
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                why = "timeout"
            # answered or failed, the job no longer holds a slot here: accepted, the node's own
            # reservation (stored before its answer, which carries it) takes over
            if why is None and ack.reservation_key and ack.reservation is not None and ack.reservation_revision:
                self._apply_reservation(ack.reservation_key, ack.reservation, ack.reservation_revision)
            unconfirmed = (why is None and decision.deflected and ack.reason != "duplicate"
                           and ack.reservation_revision is None)  # held here until it expires
            if not unconfirmed:
                self.pending_deflections.pop(rid, None)
            if why == "cancelled":  # the ingress ended this attempt (its cancel or tombstone claim): route it nowhere
                self._forget_routed(rid)
                self.cancelled.add(rid)
                span.set_attribute("kairos.outcome", "cancelled")
                log.info("request_cancelled_by_node", node=decision.node, attempts=attempts)
                return
            if why == "claimed" and ack.claim is not None:  # an earlier delivery's job runs there: not again
                self._forget_routed(rid)
                claim = ack.claim
                holder = claim.node
                if holder in bus_faulted and holder != decision.node:
                    # it is this routing's own earlier try, whose answer was lost: that node holds the claim
                    # and never started the request — send it that job again (it runs it, or says duplicate)
                    decision, job = bus_faulted[holder]
                    log.info("job_resent_to_claim_holder", node=holder)
                    try:
                        ack = await request_typed(self.nc, S.jobs_subject(holder), job, JobAck,
                                                  self.cfg.job_ack_timeout_s, telemetry.inject_headers())
                    except (nats.errors.Error, asyncio.TimeoutError):
                        ack = None
                    if ack is not None and ack.accepted:
                        await self._accepted(req, decision, ack, snap.state_age_ms, attempts, excluded, conflicts,
                                             decide_ms, (time.perf_counter() - t_start) * 1000.0, span)
                        return
                    if ack is not None and ack.reason != "claimed":
                        # it refused for a reason of its own (and gave its claim up): route elsewhere
                        del bus_faulted[holder]
                        excluded[holder] = ack.reason or "refused"
                        log.info("job_rerouted", node=holder, why=excluded[holder], attempt=attempts)
                        continue
                await self._adopt(req, claim, span, log)
                return
            if why in ("timeout", "claim_failed"):  # a claim may be stored there all the same
                bus_faulted[decision.node] = (decision, job)
            settling = self._bus is not None and self._bus.settling(RECONNECT_SETTLE_S)
            wait = None
            if self.nc.is_connected and now_ms() < req.deadline_unix_ms:
                wait = bus_retry.wait_s(why, self._node_live(decision.node))
                if wait is None and why in ("no_responders", "timeout") and settling:
                    wait = 0.2  # NATS just came back here: the node's agent may not have re-subscribed yet
            if wait is not None:  # the bus's fault, not the node's (busretry.py): not excluded
                log.info("job_retry_bus_fault", node=decision.node, why=why, attempt=attempts, wait_s=round(wait, 3))
                self.m.bus_retries.labels(why).inc()
                self._forget_routed(rid)
                await asyncio.sleep(wait)
                await msg.in_progress()
                continue
            if why is not None and not self.nc.is_connected:
                # our own bus is down, not the node: wait for it (nothing excluded); the claim makes a
                # job that did reach the node safe to send again
                log.info("job_send_disconnected", node=decision.node, why=why)
                self._forget_routed(rid)
                await self._wait_connected(req.deadline_unix_ms)
                if not self.nc.is_connected:
                    raise ConnectionError("NATS unavailable until the request's deadline")
                await msg.in_progress()
                continue
            if why is not None:
                self._forget_routed(rid)
                self.m.reroutes.labels(why.split(":")[0]).inc()
                span.add_event("job_rerouted", {"kairos.node": decision.node, "why": why, "attempt": attempts,
                                                "kairos.decision": decision.decision})
                log.info("job_rerouted", node=decision.node, why=why, attempt=attempts)
                if why == "deflection_in_flight":
                    self.m.conflicts.labels("node_refused").inc()
                    span.add_event("reservation_conflict", {"kairos.node": decision.node, "source": "node_refused"})
                    full.add(decision.node)
                    conflicts.append(decision.node)
                else:
                    excluded[decision.node] = why
                if attempts - bus_retry.retries >= max_attempts:  # bus retries are bounded by their budget
                    await self._error(req, 503, "no_available_node", f"gave up after {attempts} attempts: {excluded}",
                                      span)
                    return
                continue
            faults.die("after_accept")
            await self._accepted(req, decision, ack, snap.state_age_ms, attempts, excluded, conflicts, decide_ms,
                                 (time.perf_counter() - t_start) * 1000.0, span)
            return

    def _node_live(self, node: str) -> bool:
        """``node`` is in the watched view and not stale (its heartbeats are arriving)."""
        return self.view is not None and any(n.node == node and not n.stale for n in self.view.nodes)

    async def _wait_connected(self, deadline_unix_ms: float) -> None:
        """Poll (every 50 ms) until this replica is connected again or the deadline passed."""
        while not self.nc.is_connected and now_ms() < deadline_unix_ms and not self._stop.is_set():
            await asyncio.sleep(0.05)

    async def _adopt(self, req: InferenceRequest, claim: Claim, span, log) -> None:
        """``req`` was already claimed by ``claim.node`` (a previous delivery's job, whose
        dispatcher died or stalled before acking): publish where it is — the routing event may never
        have been sent — and let the message be acked. If that node is dead, the ingress's liveness
        check re-submits the request under a new bus id."""
        self.m.adopted.inc()
        span.set_attribute("kairos.outcome", "claimed_elsewhere")
        span.set_attribute("kairos.accepted_by", claim.node)
        log.info("request_claimed_elsewhere", node=claim.node, claim_dispatcher=claim.dispatcher_id)
        await publish(self.nc, S.ROUTED_SUBJECT, RoutedEvent(
            request_id=req.request_id, kind=claim.kind, node=claim.node, decode_node=claim.decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=claim.claimed_unix_ms,
            lane=_LANE.get()))

    async def _accepted(self, req: InferenceRequest, d: Decision, ack: JobAck, state_age_ms: float | None,
                        attempts: int, excluded: dict, conflicts: list, decide_ms: float, routing_ms: float,
                        span) -> None:
        rid = req.request_id
        rec = DecisionRecord(request_id=rid, dispatcher_id=self.cfg.replica_id, decision=d, node=ack.node,
                             decode_node=d.decode_node, attempts=attempts, excluded_nodes=excluded,
                             reservation_conflicts=conflicts, state_age_ms=state_age_ms,
                             view_seq=self.view.seq if self.view else 0, decided_unix_ms=now_ms(),
                             decide_ms=decide_ms, routing_ms=routing_ms)
        set_decision_attributes(span, d, state_age_ms, attempts, excluded, conflicts)
        span.set_attributes({"kairos.accepted_by": ack.node, "kairos.view_seq": rec.view_seq,
                             "kairos.decide_ms": decide_ms, "kairos.routing_ms": routing_ms})
        self.m.decisions.labels(self.policy.spec, d.decision, d.reason).inc()
        self.m.decide.observe(telemetry.seconds(decide_ms))
        self.m.route.observe(telemetry.seconds(routing_ms))
        if state_age_ms is not None:
            self.m.state_age.observe(telemetry.seconds(state_age_ms))
        self.routed += 1
        self.log.info("request_routed", request_id=rid, decision=d.decision, reason=d.reason, node=ack.node,
                      decode_node=d.decode_node, attempts=attempts, state_age_ms=state_age_ms)
        await publish(self.nc, S.ROUTED_SUBJECT, RoutedEvent(
            request_id=rid, kind="deflect" if d.deflected else "keep", node=ack.node, decode_node=d.decode_node,
            prompt_tokens=req.prompt_tokens, output_tokens=req.max_tokens, node_accepted_unix_ms=ack.accepted_unix_ms,
            predicted_ttft_ms=predicted_ttft_ms(d), lane=_LANE.get()))
        # unacknowledged (kairos.runtime.bus.kv_put_nowait): the routing event, the record and the work-queue
        # ack leave in one socket write
        try:
            await kv_put_nowait(self.nc, S.REQUESTS_BUCKET, S.record_key(rid, "decision"), encode(rec))
        except Exception as exc:
            self.log.warning("record_write_failed", request_id=rid, error=repr(exc))

    def _apply_reservation(self, key: str, value: Reservation, revision: int) -> None:
        """A node's reservation from its job answer, applied unless the watcher already delivered
        this revision or a newer one (e.g. its delete: a short deflection can end before its answer
        gets here); the watcher's older events of the key are ignored from now on."""
        if revision > self.resv_rev.get(key, 0):
            self.resv_rev[key] = revision
            self.reservations[key] = value

    def _reservations_and_pending(self) -> dict[str, Reservation]:
        """The watched reservations plus this replica's deflections not watched yet (keyed
        ``pending.<request id>``; expired ones are dropped here)."""
        if not self.pending_deflections:
            return self.reservations
        now = now_ms()
        for rid in [rid for rid, r in self.pending_deflections.items() if r.expires_unix_ms <= now]:
            del self.pending_deflections[rid]
        return {**self.reservations, **{f"pending.{rid}": r for rid, r in self.pending_deflections.items()}}

    async def _error(self, req: InferenceRequest, status: int, code: str, message: str, span=None) -> None:
        self.m.errors.labels(code).inc()
        if span is not None:
            span.set_attribute("kairos.outcome", code)
            span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
        self.log.warning("request_failed", request_id=req.request_id, code=code, message=message)
        await publish(self.nc, S.out_subject(req.request_id, DISPATCHER), ErrorEvent(
            request_id=req.request_id, status=status, code=code, message=message,
            source=f"dispatcher:{self.cfg.replica_id}", sent_unix_ms=now_ms()))


def set_decision_attributes(span, d: Decision, state_age_ms: float | None, attempts: int, excluded: dict,
                            conflicts: list) -> None:
    """The decision as ``kairos.*`` span attributes (ARCHITECTURE §2 "Tracing").

    Per-node maps are flattened (span attributes are scalars or homogeneous lists):
    ``kairos.ttft_decode_est_ms.<node>`` for every decode node with an estimate and
    ``kairos.decode_infeasible.<node>`` (the reason) for every node that could not take the
    deflection. Values equal the decision record (``GET /v1/requests/{id}``)."""
    attrs = {"kairos.decision": d.decision, "kairos.reason": d.reason, "kairos.node": d.node, "kairos.outcome": "routed",
             "kairos.decode_node": d.decode_node, "kairos.chunk_schedule": list(d.chunk_schedule),
             "kairos.predicted_step_ms": list(d.predicted_step_ms), "kairos.attempts": attempts,
             "kairos.model_version": d.model_version, "kairos.policy": d.policy}
    if d.ttft_prefill_est_ms is not None:
        attrs["kairos.ttft_prefill_est_ms"] = d.ttft_prefill_est_ms
    if d.kv_transfer_est_ms is not None:
        attrs["kairos.kv_transfer_est_ms"] = d.kv_transfer_est_ms
    if state_age_ms is not None:
        attrs["kairos.state_age_ms"] = state_age_ms
    for node, est in d.ttft_decode_est_ms.items():
        if est is not None:
            attrs[f"kairos.ttft_decode_est_ms.{node}"] = est
    for node, why in d.decode_infeasible.items():
        attrs[f"kairos.decode_infeasible.{node}"] = why
    if excluded:
        attrs["kairos.excluded"] = [f"{k}:{v}" for k, v in excluded.items()]
    if conflicts:
        attrs["kairos.reservation_conflicts"] = list(conflicts)
    span.set_attributes(attrs)
    span.set_status(Status(StatusCode.OK))


async def run(cfg: DispatcherConfig, stop: asyncio.Event, model: LatencyModel | None = None) -> None:
    """Run one dispatcher replica until ``stop`` is set."""
    d = Dispatcher(cfg, model)
    await d.start()
    try:
        await stop.wait()
    finally:
        await d.close()
