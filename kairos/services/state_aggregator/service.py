"""State aggregator: heartbeats + routing events in, the cluster view out (KV bucket kairos_view).

All rules (staleness, folding routed-but-unreported jobs) are in :mod:`kairos.services.state_aggregator.view`; this shell
subscribes, feeds the :class:`~kairos.services.state_aggregator.view.ViewBuilder` with its own monotonic clock, and writes the
view every ``state_period_ms``. It also feeds every node's step records (``kairos.steps.*``) to one
:class:`~kairos.core.model.correction.CorrectionEstimator` (the simulator's class) and puts each node's
correction into the view, so all dispatcher replicas apply the same one (kairos+).

Restarts: a new aggregator writes its first view only after one ``stale_after_ms`` of listening
(warm-up), so its empty first view never replaces the previous one (the bucket is file-backed and
keeps it) — every live node has heartbeated by then. A NATS restart is survived by re-declaring the
bucket after each reconnect (:class:`kairos.runtime.bus.BusWatch`).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge, Histogram

from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.runtime.service import start_metrics_and_connect
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import BusWatch, ensure_buckets, flush_barrier, kv_put_nowait, stream_replicas
from kairos.core.model.correction import CorrectionEstimator
from kairos.core.cluster.heartbeat import REJECT_REASONS
from kairos.runtime.lanes import consumer_infos, lane_count
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.services.state_aggregator.view import ViewBuilder, with_corrections
from kairos.contracts.wire import ClusterView, NodeState, RoutedEvent, WireError, decode, decode_step_records, encode, now_ms


#: bucket boundaries (ms) of ``kairos_aggregator_decode_step_seconds``; the configured TBT SLO is added
DECODE_STEP_BUCKETS_MS = (5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 120.0, 150.0, 200.0,
                          300.0, 500.0, 1000.0)


def decode_step_buckets(tbt_slo_ms: float | None) -> tuple[float, ...]:
    """The histogram's bucket boundaries in **seconds** (Prometheus' unit): :data:`DECODE_STEP_BUCKETS_MS`
    with ``tbt_slo_ms`` (ms) among them, sorted."""
    ms = set(DECODE_STEP_BUCKETS_MS) | ({float(tbt_slo_ms)} if tbt_slo_ms else set())
    return tuple(v / 1000.0 for v in sorted(ms))


def _mono_ms() -> float:
    return time.monotonic() * 1000.0


class StateAggregator:
    def __init__(self, cfg: AggregatorConfig) -> None:
        self.cfg = cfg
        self.builder = ViewBuilder(period_ms=cfg.state_period_ms, stale_after_ms=cfg.stale_after_ms)
        self.corrector = CorrectionEstimator(window_ms=cfg.correction_window_ms)
        self.tel = telemetry.setup("state_aggregator", "aggregator", cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log
        reg = self.tel.registry
        self.m_states = Counter("kairos_aggregator_states_total", "Heartbeats received", registry=reg)
        self.m_routed = Counter("kairos_aggregator_routed_total", "Routing events received", registry=reg)
        self.m_rejected = Counter("kairos_aggregator_heartbeats_rejected_total",
                                  "Heartbeats refused, by reason (future: timestamp or epoch too far ahead of this "
                                  "clock; replay: seq not newer; seq_jump: implausibly large seq; old_epoch: a previous "
                                  "incarnation)", ("reason",), registry=reg)
        for r in REJECT_REASONS:
            self.m_rejected.labels(r)
        self.origin = OriginGuard(forged_counter("aggregator", reg), self.log)
        self.m_views = Counter("kairos_aggregator_views_total", "Views written", registry=reg)
        self.m_steps = Counter("kairos_aggregator_step_records_total", "Engine step records received", registry=reg)
        self.m_corr = Gauge("kairos_aggregator_node_step_correction",
                            "Learned step-time correction per node (actual / predicted): factor=bias (mean) or "
                            "safety (Eq. 5 bound)", ("node", "factor"), registry=reg)
        self.m_decode_step = Histogram(
            "kairos_aggregator_decode_step_seconds",
            "Measured wall time (s) of each engine step that carried decodes (batch size > 0, with or without a "
            "prefill chunk), per node, from the step records: the live counterpart of the simulator's decode "
            "steps whose share above the TBT SLO is Table 4's TBT violation rate", ("node",),
            buckets=decode_step_buckets(cfg.tbt_slo_ms), registry=reg)
        self.m_node_steps = Counter("kairos_aggregator_node_steps_total", "Engine step records received, per node",
                                    ("node",), registry=reg)
        self.m_step_time = Counter(
            "kairos_aggregator_step_seconds_total",
            "Sum of the step times of a node's step records: clock=measured (wall time) or predicted (the latency "
            "profile the node predicts with); their ratio over an interval is how much slower than its profile the "
            "engine ran (kairos.cli.stepscale)", ("node", "clock"), registry=reg)
        self.m_nodes = Gauge("kairos_aggregator_nodes", "Nodes in the view", ("role", "stale"), registry=reg)
        self.m_age = Gauge("kairos_aggregator_node_state_age_seconds",
                           "Time since the node's last heartbeat was received, when the view was built",
                           ("node", "role"), registry=reg)
        self.m_stale = Gauge("kairos_aggregator_node_stale", "1 if the node is stale (no route), else 0",
                             ("node", "role"), registry=reg)
        self.m_queue = Gauge("kairos_aggregator_request_queue_messages",
                             "Request work queue (JetStream consumer of the dispatchers): pending = not yet "
                             "delivered, ack_pending = delivered and not acknowledged", ("state",), registry=reg)
        self._labelled: set[tuple[str, str]] = set()
        self._bg: set[asyncio.Task] = set()  #: queue-depth polls in flight
        self._queue_polled = 0.0
        self.view: ClusterView | None = None
        self.metrics_port: int | None = None
        self._stale: set[str] = set()
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._runner = None
        self._bus: BusWatch | None = None
        self.nc = None

    async def _declare(self) -> None:
        self.buckets = await ensure_buckets(self.nc.jetstream(), replicas=stream_replicas(self.cfg))

    async def start(self) -> None:
        await start_metrics_and_connect(self, "state_aggregator")
        await self._declare()
        self._bus = BusWatch(self.nc, self._declare, log=self.log).start()
        await self.nc.subscribe(S.STATE_WILDCARD, cb=self._on_state)
        await self.nc.subscribe(S.ROUTED_SUBJECT, cb=self._on_routed)
        await self.nc.subscribe(S.STEPS_WILDCARD, cb=self._on_step)
        await flush_barrier(self.nc)
        self._task = asyncio.create_task(self._loop())
        self.log.info("aggregator_started", metrics_port=self.metrics_port,
                      stale_after_ms=self.builder.stale_after_ms)

    async def close(self) -> None:
        self._stop.set()
        if self._bus is not None:
            await self._bus.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await bus_close(self.nc, graceful=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self.tel.shutdown()

    async def _on_state(self, msg) -> None:
        try:
            st = decode(msg.data, NodeState)
        except WireError as exc:
            self.log.warning("bad_state", error=str(exc))
            return
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # a heartbeat is its sender's, never another node's (kairos/contracts/origin.py)
        self.m_states.inc()
        why = self.builder.on_state(st, _mono_ms(), now_ms())
        if why is not None:
            self.m_rejected.labels(why).inc()
            self.log.warning("heartbeat_rejected", node=st.node, reason=why, seq=st.seq, epoch_unix_ms=st.epoch_unix_ms,
                             sent_unix_ms=st.sent_unix_ms)

    async def _on_step(self, msg) -> None:
        try:
            recs = decode_step_records(msg.data)
        except WireError as exc:
            self.log.warning("bad_step_record", error=str(exc))
            return
        sender = S.subject_node(msg.subject, S.steps_subject)
        bad = next((r.node for r in recs if r.node != sender), None) if sender is not None else None
        if not self.origin.check(msg, "step_record", sender, bad or sender):
            return  # the whole batch: one foreign record proves the sender forges
        self.m_steps.inc(len(recs))
        now = _mono_ms()
        for rec in recs:
            self.corrector.observe(rec.node, rec.predicted_ms, rec.wall_ms, now,
                                   mixed=rec.batch_size > 0 and rec.prefill_tokens > 0)
            if rec.batch_size > 0:
                self.m_decode_step.labels(rec.node).observe(rec.wall_ms / 1000.0)
            self.m_node_steps.labels(rec.node).inc()
            self.m_step_time.labels(rec.node, "measured").inc(rec.wall_ms / 1000.0)
            self.m_step_time.labels(rec.node, "predicted").inc(rec.predicted_ms / 1000.0)

    async def _on_routed(self, msg) -> None:
        try:
            ev = decode(msg.data, RoutedEvent)
        except WireError as exc:
            self.log.warning("bad_routed", error=str(exc))
            return
        self.m_routed.inc()
        self.builder.on_routed(ev, _mono_ms())

    async def _loop(self) -> None:
        period = self.cfg.state_period_ms / 1000.0
        try:  # warm-up: hear every live node before the first view replaces the previous aggregator's
            await asyncio.wait_for(self._stop.wait(), float(self.builder.stale_after_ms) / 1000.0)
        except asyncio.TimeoutError:
            pass
        while not self._stop.is_set():
            corrections = self.corrector.corrections(_mono_ms())
            view = with_corrections(self.builder.build(_mono_ms(), built_unix_ms=now_ms()), corrections)
            for node, c in corrections.items():
                self.m_corr.labels(node, "bias").set(c.bias)
                self.m_corr.labels(node, "safety").set(c.safety)
            self.view = view
            self._report(view)
            try:  # core NATS at once, and the bucket unacknowledged: its leader may be electing (seconds)
                data = encode(view)
                await self.nc.publish(S.VIEW_SUBJECT, data)
                await kv_put_nowait(self.nc, S.VIEW_BUCKET, S.VIEW_KEY, data)
                self.m_views.inc()
            except Exception as exc:
                self.log.warning("view_write_failed", error=repr(exc))
            if time.monotonic() - self._queue_polled >= 1.0:  # in the background: a dead lane's timeout
                self._queue_polled = time.monotonic()        # must not hold the next view back
                t = asyncio.create_task(self._poll_queue())
                self._bg.add(t)
                t.add_done_callback(self._bg.discard)
            try:
                await asyncio.wait_for(self._stop.wait(), period)
            except asyncio.TimeoutError:
                pass

    async def _poll_queue(self) -> None:
        """Request work-queue depth from JetStream, summed over the request lanes that answer
        (absent until a dispatcher declared them; a lane whose member is down is left out)."""
        infos = await consumer_infos(self.nc.jetstream(), lane_count(self.cfg), 0.5)
        ok = [i for i in infos if not isinstance(i, BaseException)]
        if ok:
            self.m_queue.labels("pending").set(sum(i.num_pending or 0 for i in ok))
            self.m_queue.labels("ack_pending").set(sum(i.num_ack_pending or 0 for i in ok))

    def _report(self, view: ClusterView) -> None:
        counts: dict[tuple[str, str], int] = {(r, s): 0 for r in ("prefill", "decode") for s in ("true", "false")}
        stale = set()
        for n in view.nodes:
            counts[(n.role, "true" if n.stale else "false")] += 1
            if n.stale:
                stale.add(n.node)
        for (r, s), c in counts.items():
            self.m_nodes.labels(r, s).set(c)
        present = set()
        for n in view.nodes:
            present.add((n.node, n.role))
            self.m_age.labels(n.node, n.role).set(telemetry.seconds(n.age_ms))
            self.m_stale.labels(n.node, n.role).set(1 if n.stale else 0)
        for gone in self._labelled - present:  # forgotten nodes leave the metrics too
            self.m_age.remove(*gone)
            self.m_stale.remove(*gone)
        self._labelled = present
        for n in stale - self._stale:
            self.log.warning("node_stale", node=n)
        for n in self._stale - stale:
            self.log.info("node_fresh", node=n)
        self._stale = stale


async def run(cfg: AggregatorConfig, stop: asyncio.Event) -> None:
    """Run the aggregator until ``stop`` is set."""
    agg = StateAggregator(cfg)
    await agg.start()
    try:
        await stop.wait()
    finally:
        await agg.close()
