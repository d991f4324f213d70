"""State aggregator: heartbeats + routing events in, the cluster view out (KV bucket kairos_view).

All rules (staleness, folding routed-but-unreported jobs) are in :mod:`kairos.services.state_aggregator.view`; this shell
subscribes, feeds the :class:`~kairos.services.state_aggregator.view.ViewBuilder` with its own monotonic clock, and writes the
view every ``state_period_ms``. It also feeds every node's step records (``kairos.steps.*``) to one
:class:`~kairos.core.model.correction.CorrectionEstimator` (the simulator's class) and puts each node's
correction into the view, so all dispatcher replicas apply the same one (kairos+).

Restarts: a new aggregator writes its first view only after one ``stale_after_ms`` of listening
(warm-up), so its empty first view never replaces the previous one (the bucket is file-backed and
keeps it) — every live node has heartbeated by then. A NATS restart is survived by re-declaring the
bucket after each reconnect (:class:`kairos.runtime.buswatch.BusWatch`).

Start and close go through one :class:`kairos.runtime.resources.Resources` (the ``/metrics`` server,
the connection, the subscriptions, the view loop: closed in reverse, each failure logged). Its clocks (receive time of
each heartbeat, the view's build time) come from a :class:`kairos.runtime.clock.Clock`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.contracts.wire import ClusterView, NodeState, RoutedEvent, WireError, decode_step_records, encode
from kairos.core.cluster.heartbeat import REJECT_REASONS
from kairos.core.model.correction import CorrectionEstimator
from kairos.runtime import telemetry
from kairos.runtime.bus import flush_barrier, stream_replicas
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.messaging import decoded, kv_put_nowait
from kairos.runtime.resources import Resources
from kairos.runtime.service import run_service, start_metrics_and_connect
from kairos.runtime.streams import ensure_buckets
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.view import ViewBuilder, with_corrections


#: bucket boundaries (ms) of ``kairos_aggregator_decode_step_seconds``; the configured TBT SLO is added
DECODE_STEP_BUCKETS_MS = (5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 120.0, 150.0, 200.0,
                          300.0, 500.0, 1000.0)


def decode_step_buckets(tbt_slo_ms: float | None) -> tuple[float, ...]:
    """The histogram's bucket boundaries in **seconds** (Prometheus' unit): :data:`DECODE_STEP_BUCKETS_MS`
    with ``tbt_slo_ms`` (ms) among them, sorted."""
    ms = set(DECODE_STEP_BUCKETS_MS) | ({float(tbt_slo_ms)} if tbt_slo_ms else set())
    return tuple(v / 1000.0 for v in sorted(ms))


#: the view bucket gets a view at most this often (s): it is read once by a service that starts
#: (kairos.runtime.messaging.last_view); every view goes out on ``kairos.view``
VIEW_BUCKET_PERIOD_S = 1.0


@dataclass(slots=True)
class NodeGauges:
    """One node's labelled children of the per-node gauges, kept across views: ``Gauge.labels()``
    (label checks, a lock, a look-up: ~2 µs) runs once per (node, role), not per node per view,
    and a child is set only when its value changed (``bench/view_costs.py``). Nothing else sets
    these children, so the value last set is the one exposed."""

    age: Any  #: child of ``kairos_aggregator_node_state_age_seconds``
    stale: Any  #: child of ``kairos_aggregator_node_stale``
    age_s: float | None = None  #: the age last set, s (None: not yet)
    is_stale: bool | None = None  #: the staleness last set (None: not yet)
    seen: int = 0  #: the last report (StateAggregator._reports) whose view listed the node


class StateAggregator:
    """The cluster's one state aggregator (see the module docstring).

    Args:
        cfg: its configuration (``KAIROS_*``).
        clock: its clocks: monotonic (heartbeat receive times, staleness) and wall (the view's build time).
    """

    def __init__(self, cfg: AggregatorConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg = cfg
        self.clock = clock
        self.builder = ViewBuilder(period_ms=cfg.state_period_ms, stale_after_ms=cfg.stale_after_ms)
        self.corrector = CorrectionEstimator(window_ms=cfg.correction_window_ms)
        self.tel = telemetry.setup("state_aggregator", "aggregator", cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log
        self.res = Resources(self.log)
        self.res.push("telemetry", self.tel.shutdown)
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
        self._node_gauges: dict[tuple[str, str], NodeGauges] = {}  #: (node, role) -> its gauge children
        self._corr: dict[tuple[str, str], tuple[Any, float]] = {}  #: (node, factor) -> (child, value set)
        self._reports = 0  #: views reported (:meth:`_report`)
        self._view_stored = float("-inf")  #: when a view last went into the view bucket (monotonic s)
        self.view: ClusterView | None = None
        self.metrics_port: int | None = None
        self._stale: set[str] = set()
        self._stop = asyncio.Event()
        self._runner = None
        self._bus: BusWatch | None = None
        self.nc = None

    async def _declare(self) -> None:
        self.buckets = await ensure_buckets(self.nc.jetstream(), replicas=stream_replicas(self.cfg))

    def _mono_ms(self) -> float:
        return self.clock.monotonic() * 1000.0

    async def start(self) -> None:
        """Connect, declare, subscribe, start the view loop; :meth:`close` closes whatever was opened."""
        await start_metrics_and_connect(self, "state_aggregator", self.res)
        await self._declare()
        self._bus = BusWatch(self.nc, self._declare, log=self.log).start()
        self.res.push("bus watch", self._bus.stop)
        for subject, cb in ((S.STATE_WILDCARD, self._on_state), (S.ROUTED_SUBJECT, self._on_routed),
                            (S.STEPS_WILDCARD, self._on_step)):
            sub = await self.nc.subscribe(subject, cb=cb)
            self.res.push(f"subscription {subject}", sub.unsubscribe)
        await flush_barrier(self.nc)
        self.res.push_task("view loop", asyncio.create_task(self._loop()))
        self.log.info("aggregator_started", metrics_port=self.metrics_port,
                      stale_after_ms=self.builder.stale_after_ms)

    async def close(self) -> None:
        """Stop the view loop, unsubscribe, close the connection, the /metrics server and telemetry."""
        self._stop.set()
        await self.res.aclose()

    async def _on_state(self, msg) -> None:
        if (st := decoded(msg.data, NodeState, self.log, "bad_state")) is None:
            return
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # a heartbeat is its sender's, never another node's (kairos/contracts/origin.py)
        self.m_states.inc()
        why = self.builder.on_state(st, self._mono_ms(), self.clock.now_ms())
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
        now = self._mono_ms()
        for rec in recs:
            self.corrector.observe(rec.node, rec.predicted_ms, rec.wall_ms, now,
                                   mixed=rec.batch_size > 0 and rec.prefill_tokens > 0)
            if rec.batch_size > 0:
                self.m_decode_step.labels(rec.node).observe(rec.wall_ms / 1000.0)
            self.m_node_steps.labels(rec.node).inc()
            self.m_step_time.labels(rec.node, "measured").inc(rec.wall_ms / 1000.0)
            self.m_step_time.labels(rec.node, "predicted").inc(rec.predicted_ms / 1000.0)

    async def _on_routed(self, msg) -> None:
        if (ev := decoded(msg.data, RoutedEvent, self.log, "bad_routed")) is None:
            return
        self.m_routed.inc()
        self.builder.on_routed(ev, self._mono_ms())

    async def _loop(self) -> None:
        period = self.cfg.state_period_ms / 1000.0
        # warm-up: hear every live node before the first view replaces the previous aggregator's
        await self.clock.wait_event(self._stop, float(self.builder.stale_after_ms) / 1000.0)
        while not self._stop.is_set():
            corrections = self.corrector.corrections(self._mono_ms())
            view = with_corrections(self.builder.build(self._mono_ms(), built_unix_ms=self.clock.now_ms()), corrections)
            self._report_corrections(corrections)
            self.view = view
            self._report(view)
            try:  # core NATS at once, and the bucket unacknowledged: its leader may be electing (seconds)
                data = encode(view)
                await self.nc.publish(S.VIEW_SUBJECT, data)
                if self.clock.monotonic() - self._view_stored >= VIEW_BUCKET_PERIOD_S:
                    self._view_stored = self.clock.monotonic()
                    await kv_put_nowait(self.nc, S.VIEW_BUCKET, S.VIEW_KEY, data)
                self.m_views.inc()
            except Exception as exc:  # disconnected (the next period writes a newer view): logged, not raised
                self.log.warning("view_write_failed", error=repr(exc))
            await self.clock.wait_event(self._stop, period)

    def _report_corrections(self, corrections: dict) -> None:
        """Each node's correction factors into ``kairos_aggregator_node_step_correction`` (a child
        stays once a node had one: its last value, as before), set when they changed."""
        for node, c in corrections.items():
            for factor, value in (("bias", c.bias), ("safety", c.safety)):
                kid = self._corr.get((node, factor))
                if kid is None or kid[1] != value:
                    child = kid[0] if kid is not None else self.m_corr.labels(node, factor)
                    child.set(value)
                    self._corr[(node, factor)] = (child, value)

    def _report(self, view: ClusterView) -> None:
        """The view's node gauges (counts by role and staleness; each node's heartbeat age and
        staleness; a node that left the view leaves them), and a log line per node that turned
        stale, fresh again, or was forgotten. Per node per view: a dict look-up and the gauge
        children whose value changed (:class:`NodeGauges`)."""
        counts: dict[tuple[str, str], int] = {(r, s): 0 for r in ("prefill", "decode") for s in ("true", "false")}
        stale = set()
        self._reports += 1
        kids, seq = self._node_gauges, self._reports
        for n in view.nodes:
            key = (n.node, n.role)
            g = kids.get(key)
            if g is None:
                g = kids[key] = NodeGauges(self.m_age.labels(*key), self.m_stale.labels(*key))
            g.seen = seq
            age_s = telemetry.seconds(n.age_ms)
            if age_s != g.age_s:
                g.age.set(age_s)
                g.age_s = age_s
            if n.stale != g.is_stale:
                g.stale.set(1 if n.stale else 0)
                g.is_stale = n.stale
            counts[(n.role, "true" if n.stale else "false")] += 1
            if n.stale:
                stale.add(n.node)
        for (r, s), c in counts.items():
            self.m_nodes.labels(r, s).set(c)
        for key in [k for k, g in kids.items() if g.seen != seq]:  # forgotten nodes (or a node's former
            del kids[key]  # role) leave the metrics too
            self.m_age.remove(*key)
            self.m_stale.remove(*key)
        for n in stale - self._stale:
            self.log.warning("node_stale", node=n)
        back = self._stale - stale
        in_view = {n for n, _ in kids} if back else set()
        for n in back:  # fresh again, or gone from the view (forgotten after forget_after_ms)
            if n in in_view:
                self.log.info("node_fresh", node=n)
            else:
                self.log.warning("node_forgotten", node=n)
        self._stale = stale


async def run(cfg: AggregatorConfig, stop: asyncio.Event) -> None:
    """Run the aggregator until ``stop`` is set."""
    await run_service(StateAggregator(cfg), stop)
