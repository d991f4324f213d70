"""Node agent: one engine instance on the bus.

Inputs: jobs on ``kairos.jobs.<node>`` (request-reply), KV handoffs on ``kairos.kv.<node>``
(decode nodes, request-reply), KV-pulled notices on ``kairos.kvdone.<node>.<decode agent>`` (prefill nodes),
cancels on ``kairos.cancel``. Outputs: heartbeats on ``kairos.state.<node>``, tokens/done/errors
on ``kairos.out.<rid>``, timing records in the ``kairos_requests`` bucket, reservation releases.

Paths (ARCHITECTURE §2):

* keep, prefill node: ``add_prefill`` → steps → prefill done → hand the KV to the first decode
  candidate that accepts (request-reply) → blocks held until that node's ``KvDone`` → ``release``.
* keep, decode node: handoff → ``add_remote_decode`` → blocks allocated → ``pull_kv`` (emulated
  link time, one transfer per link at a time) → ``kv_arrived`` → decode, tokens streamed.
* deflect, decode node: ``add_deflected`` with the chunk schedule → chunked prefill (one span event
  per chunk: χ, predicted ms, actual ms) → first token → reservation released → decode.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from prometheus_client import Counter, Gauge, Histogram

from kairos.services.node_agent.acceptance import ClaimResult, Claims
from kairos.services.node_agent.outbox import RESEND_WINDOW_S, Outbox
from kairos.engines import make_backend
from kairos.engines.base import EngineBackend, StepOutput
from kairos.services.node_agent.config import AgentConfig
from kairos.runtime.service import start_metrics_and_connect
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import (BusWatch, flush_barrier, kv_delete_nowait, kv_put_nowait, kv_put_ttl,
                        publish, request_typed)
from kairos.core.model.correction import CorrectionEstimator
from kairos.core.engine import EngineError
from kairos.core.engine import GroundTruth
from kairos.runtime.lanes import claim_buckets, lane_count
from kairos.core.model.latency import LatencyModel, load_profile
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.contracts.permissions import AGENT_PREFIX, PROFILER, agent_user
from kairos.core.cluster.recent import RecentIds
from kairos.core.cluster.routing import job_refusal
from kairos.engines.vllm.api import EngineApiError
from kairos.contracts.wire import (Cancel, DecodeTiming, DoneEvent, ErrorEvent, HandoffEvent, InFlight, InferenceRequest, Job, JobAck, KvAck, KvDone,
                         KvHandoff, NodeState, PrefillTiming, Resend, Reservation, STEP_BATCH_MAX, STEP_BATCH_S, StepRecordEvent,
                         TokenEvent, WireError, decode, encode, now_ms)

#: how many cancelled request ids a node agent remembers (a job delayed past its request's end)
CANCELLED_REMEMBERED = 10_000
#: longest wait for the execution claim's answer, s: below the dispatchers' job_ack_timeout_s (1 s), so
#: a requests bucket electing a leader (seconds, a NATS cluster member died) answers claim_failed in
#: time for the dispatcher's retry instead of blocking this node's jobs, handled one at a time
CLAIM_TIMEOUT_S = 0.75

#: every this many heartbeats (and on the first) the prefix-cache events carry the whole cache
CACHE_RESYNC = 50


#: after a NATS reconnect, a KV handoff nobody took is retried for this long (decode agents
#: reconnect at their own pace) before it fails with kv_handoff_failed
HANDOFF_SETTLE_S = 3.0

#: longest wait (s) for the engine to answer a health probe when its state stream is late and a
#: job (within the dispatcher's 1 s ack timeout) or a KV handoff (within kv_handoff_timeout_s / 2) arrives
ENGINE_PROBE_JOB_S = 0.5
ENGINE_PROBE_KV_S = 3.0

#: TTL (s) of a deflection reservation whose job names none (the dispatcher's floor, reservation_ttl_s)
DEFAULT_RESERVATION_TTL_S = 30
#: longest wait (s) for the bus to confirm a reservation before the job is answered without it
RESERVATION_PUT_TIMEOUT_S = 0.5


@dataclass
class _Req:
    """What the agent tracks for one request on this node."""

    req: InferenceRequest
    kind: str  # "keep" (keep path, prefill node) | "remote_decode" (keep path, decode node) | "deflect"
    received_ms: float
    span: Span
    job: Job | None = None
    src_node: str | None = None
    prefill_start_ms: float | None = None
    prefill_done_ms: float | None = None
    kv_alloc_ms: float | None = None
    kv_arrived_ms: float | None = None
    first_token_ms: float | None = None
    handoff_node: str | None = None
    handoff_sent_ms: float | None = None
    handoff_span: Span | None = None
    decode_span: Span | None = None
    tokens: int = 0
    last_token_ms: float | None = None
    tbt_max_ms: float = 0.0
    chunk_pred: list[float] = field(default_factory=list)
    cached_tokens: int = 0  #: prompt tokens the prefilling node served from its prefix cache
    chunk_actual: list[float] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)


class _Metrics:
    """The node agent's Prometheus metrics, all labelled by ``node`` (docs/observability.md)."""

    def __init__(self, reg, node: str) -> None:
        T = telemetry
        lbl = {"labelnames": ("node",), "registry": reg}
        self.jobs = Counter("kairos_agent_jobs_total", "Jobs received, by kind and outcome", ("node", "kind", "outcome"),
                            registry=reg)
        self.steps = Counter("kairos_agent_steps_total", "Engine steps executed", **lbl)
        self.step = Histogram("kairos_agent_step_seconds", "Engine step wall time", buckets=T.STEP_BUCKETS, **lbl)
        self.tokens = Counter("kairos_agent_tokens_total", "Output tokens emitted", **lbl)
        self.kv_transfers = Counter("kairos_agent_kv_transfers_total", "KV caches pulled (decode side)", **lbl)
        self.kv = Histogram("kairos_agent_kv_transfer_seconds", "KV transfer including waiting for the link",
                            buckets=T.KV_TRANSFER_BUCKETS, **lbl)
        self.chunks = Counter("kairos_agent_deflected_chunks_total", "Deflected chunked-prefill steps run", **lbl)
        self.chunk_pred = Histogram("kairos_agent_chunk_step_predicted_seconds",
                                    "Deflected chunk steps: the dispatcher's predicted step latency (Eq. 5)",
                                    buckets=T.STEP_BUCKETS, **lbl)
        self.chunk_meas = Histogram("kairos_agent_chunk_step_measured_seconds",
                                    "Deflected chunk steps: measured step latency", buckets=T.STEP_BUCKETS, **lbl)
        self.chunk_err = Histogram("kairos_agent_chunk_step_error_ratio",
                                   "Deflected chunk steps: (measured - predicted) / predicted; predictor=decision "
                                   "is the dispatcher's Eq. 5 value (stale state + model error), predictor=engine "
                                   "the latency model on the batch actually run (model error only)",
                                   ("node", "predictor"), registry=reg, buckets=T.ERROR_RATIO_BUCKETS)
        self.overlap = Counter("kairos_agent_deflect_overlap_total",
                               "Deflect jobs that arrived while every deflection slot here was taken (refused, re-routed)", **lbl)
        self.inflight = Gauge("kairos_agent_requests_in_flight", "Requests this node holds (any phase)", **lbl)
        self.batch = Gauge("kairos_agent_batch_size", "Running decodes (B)", **lbl)
        self.kv_tokens = Gauge("kairos_agent_kv_tokens", "KV tokens of running decodes (K)", **lbl)
        self.queue = Gauge("kairos_agent_queue_prompt_tokens", "Prefill tokens queued", **lbl)
        self.node = node
        for m in (self.steps, self.step, self.tokens, self.kv_transfers, self.kv, self.chunks, self.chunk_pred,
                  self.chunk_meas, self.overlap, self.inflight, self.batch, self.kv_tokens, self.queue):
            m.labels(node)  # this node's series exist (at 0) from the start
        for predictor in ("decision", "engine"):
            self.chunk_err.labels(node, predictor)


class NodeAgent:
    """One node agent. ``start()`` connects and runs; ``close()`` drains (or dies abruptly)."""

    def __init__(self, cfg: AgentConfig, model: LatencyModel | None = None,
                 backend: EngineBackend | None = None) -> None:
        self.cfg = cfg
        self.model = model or load_profile(cfg.profile)
        self.backend = backend or make_backend(cfg, self.model, self._truth())
        self.tel = telemetry.setup("node_agent", cfg.node_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log.bind(node=cfg.node_id, role=cfg.role)
        self.m = _Metrics(self.tel.registry, cfg.node_id)
        self.origin = OriginGuard(forged_counter("agent", self.tel.registry), self.log)
        self.reqs: dict[str, _Req] = {}
        #: request ids cancelled recently, known or not: a job or KV handoff for them is refused
        self.cancelled = RecentIds(CANCELLED_REMEMBERED)
        #: request ids whose claim failed here (a lost answer may hide a stored claim) and that did
        #: not start here since: a later try finding the claim this node's runs it (bounded: the
        #: dispatcher's retries of one request come within seconds)
        self._uncertain_claims = RecentIds(CANCELLED_REMEMBERED)
        self.outbox = Outbox()  #: out events published lately (resent after a reconnect)
        self.deflecting: dict[str, str] = {}  # rid -> the key of the reservation it holds (kairos_resv)
        self.max_concurrent_deflections = 0  #: observed here; the cross-replica invariant says ≤ 1
        self.deflect_overlaps = 0  #: deflect jobs received while every slot was taken here (refused)
        self.jobs_received: list[str] = []  #: request ids of every job received (tests, debugging)
        self.kv_backlog: dict[str, float] = {}  # rid -> expected transfer ms, handed off not yet pulled
        self.accepting = True
        self.metrics_port: int | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._main: list[asyncio.Task] = []
        self._subs: list[Any] = []
        self._runner = None
        self._seq = 0
        self.epoch_unix_ms = now_ms()  #: this incarnation (heartbeats, claims): a restart is a newer epoch
        self.nc = None
        #: the node's own step-time correction, for its guard (the aggregator computes the same for the view)
        self.corrector = CorrectionEstimator()
        self.claims: Claims | None = None
        self._bus: BusWatch | None = None
        self._steps: list[StepRecordEvent] = []  #: step records not sent yet (:meth:`_queue_step`)
        self._steps_timer: asyncio.TimerHandle | None = None
        #: the newest step-record publish (:meth:`_flush_steps`); each waits for the one before it
        self._steps_sending: asyncio.Task | None = None

    def _truth(self) -> GroundTruth | None:
        """The emulated engine's ground truth from ``truth_profile``/``truth_scale`` (None: exact)."""
        if self.cfg.truth_profile is None and self.cfg.truth_scale == 1.0:
            return None
        truth = load_profile(self.cfg.truth_profile) if self.cfg.truth_profile else self.model
        return GroundTruth(truth, scale=self.cfg.truth_scale)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        await start_metrics_and_connect(self, f"node_agent:{cfg.node_id}")
        # in the background: a node started alone (kairos profile) heartbeats while it waits for a
        # control-plane service to declare the bucket; jobs until then are refused (claim_failed)
        self._bg(self._declare())
        if cfg.role == "decode":  # a new incarnation holds no deflection: a crashed one's keys go now, not at their TTL
            for slot in range(cfg.max_deflections):
                await kv_delete_nowait(self.nc, S.RESERVATION_BUCKET, S.reservation_key(cfg.node_id, slot))
        self._bus = BusWatch(self.nc, self._declare, log=self.log, on_connected=self._resend_lost).start()
        self._subs.append(await self.nc.subscribe(S.jobs_subject(cfg.node_id), cb=self._on_job))
        self._subs.append(await self.nc.subscribe(S.CANCEL_SUBJECT, cb=self._on_cancel))
        self._subs.append(await self.nc.subscribe(S.RESEND_SUBJECT, cb=self._on_resend))
        if cfg.role == "decode":
            self._subs.append(await self.nc.subscribe(S.kv_wildcard(cfg.node_id), cb=self._on_kv))
        else:
            self._subs.append(await self.nc.subscribe(S.kvdone_wildcard(cfg.node_id), cb=self._on_kvdone))
        await flush_barrier(self.nc)
        self._main = [asyncio.create_task(self.backend.run(self, self._stop)),
                      asyncio.create_task(self._heartbeats())]
        await self._send_state()
        self.log.info("agent_started", metrics_port=self.metrics_port, profile=self.model.artifact_version)

    async def _declare(self) -> None:
        """(Re-)name the claim buckets (one per NATS member, kairos/runtime/lanes.py): at start and after
        every reconnect. An agent may not create them (docs/security.md): until a control-plane
        service has, its claims fail (``claim_failed``) and the dispatcher retries."""
        self.claims = Claims(claim_buckets(self.nc.jetstream(), lane_count(self.cfg)), self.cfg.node_id,
                             self.epoch_unix_ms)

    async def close(self, drain: bool = True) -> None:
        """Stop. ``drain``: refuse new work and send an explicit error for every request still
        here; ``drain=False`` emulates a crash (connection dropped, nothing sent)."""
        self.accepting = False
        if self._bus is not None:
            await self._bus.stop()
        if drain and self.nc is not None and self.nc.is_connected:
            for s in self._subs:
                await s.unsubscribe()
            for rid, r in list(self.reqs.items()):
                if r.kind != "keep" or r.handoff_node is None:
                    await self._fail(rid, 503, "node_shutdown", f"node {self.cfg.node_id} is shutting down")
            await self._send_state()
        self._stop.set()
        for t in self._main:
            t.cancel()
        await asyncio.gather(*self._main, return_exceptions=True)
        if drain:
            self._flush_steps()  # the last steps' records go out before the connection closes
        elif self._steps_timer is not None:
            self._steps_timer.cancel()
        if self._tasks and drain:
            await asyncio.wait(self._tasks, timeout=2.0)
        for t in self._tasks:
            t.cancel()
        await bus_close(self.nc, graceful=drain)
        if self._runner is not None:
            await self._runner.cleanup()
        self.tel.shutdown()

    def _bg(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self.log.error("background_task_failed", error=repr(task.exception()))
        t.add_done_callback(done)
        return t

    async def _emit(self, rid: str, ev) -> None:
        """Publish out event ``ev`` of ``rid`` (core NATS) and keep it for a resend after a reconnect
        (:mod:`kairos.services.node_agent.outbox`)."""
        subject, payload = self._out(rid), encode(ev)
        await self.nc.publish(subject, payload)
        self.outbox.sent(subject, payload)

    async def _resend_lost(self) -> None:
        """After a reconnect (BusWatch ``on_connected``): publish again the out events sent in
        ``RESEND_WINDOW_S`` before the connection was lost — the dead server may have had them."""
        b = self._bus
        if b is None or b.reconnected_at is None:
            return
        await self._resend(self.outbox.since(b.reconnected_at - (b.outage_s or 0.0) - RESEND_WINDOW_S), "agent")

    async def _on_resend(self, msg) -> None:
        """The ingress reconnected (``Resend``): publish again the out events of its window."""
        try:
            r = decode(msg.data, Resend)
        except WireError:
            return
        await self._resend(self.outbox.since(time.monotonic() - min(r.window_s, self.outbox.keep_s)), "ingress")

    async def _resend(self, again: list[tuple[str, bytes]], why: str) -> None:
        for subject, payload in again:
            await self.nc.publish(subject, payload)
        if again:
            self.log.info("out_events_resent", events=len(again), reconnected=why)

    def _out(self, rid: str) -> str:
        """This agent's out subject of ``rid`` (``kairos.out.<rid>.agent-<node>``: the bus proves the sender)."""
        return S.out_subject(rid, agent_user(self.cfg.node_id))

    def _rlog(self, rid: str, span=None):
        """The logger for lines about ``rid``: request id and trace id bound."""
        if span is None:
            r = self.reqs.get(rid)
            span = r.span if r is not None else None
        return self.log.bind(request_id=rid, **telemetry.trace_fields(span))

    # -- heartbeats -----------------------------------------------------------------------------
    def node_state(self) -> NodeState:
        st = self.backend.state()
        self._seq += 1
        # prefix-cache events: net deltas, the whole cache on the first and every CACHE_RESYNC-th
        # heartbeat (a lost heartbeat makes the dispatchers' index forget the node until then)
        cache = self.backend.cache_events(full=self._seq % CACHE_RESYNC == 1)
        cache_fields = {} if cache is None else dict(
            cache_block_tokens=cache[0], cache_stored=cache[1], cache_removed=cache[2], cache_full=cache[3])
        return NodeState(**cache_fields, node=self.cfg.node_id, role=self.cfg.role, seq=self._seq, sent_unix_ms=now_ms(),
                         epoch_unix_ms=self.epoch_unix_ms,
                         period_ms=self.cfg.state_period_ms, batch_size=st.batch_size, kv_tokens=st.kv_tokens,
                         queue_prompt_tokens=list(st.queue_prompt_tokens),
                         deflection_in_flight=st.deflection_in_flight or bool(self.deflecting),
                         in_flight=[InFlight(f.prompt_tokens, f.output_tokens) for f in st.in_flight],
                         waiting=st.waiting, free_kv_tokens=st.free_kv_tokens, running=st.running,
                         kv_backlog_ms=sum(self.kv_backlog.values()), accepting=self.accepting and self.backend.available)

    async def _send_state(self) -> None:
        # the records of the steps this heartbeat reflects go out before it, on the same connection:
        # a consumer that sees the node idle has every record of the work that came before
        # (the profiler stops listening at such a heartbeat, kairos/services/profiler/service.py _drain)
        self._flush_steps()
        if self._steps_sending is not None and not self._steps_sending.done():
            await asyncio.wait({self._steps_sending})
        st = self.node_state()
        self.m.batch.labels(self.cfg.node_id).set(st.batch_size)
        self.m.kv_tokens.labels(self.cfg.node_id).set(st.kv_tokens)
        self.m.queue.labels(self.cfg.node_id).set(sum(st.queue_prompt_tokens))
        self.m.inflight.labels(self.cfg.node_id).set(len(self.reqs))
        await self.nc.publish(S.state_subject(self.cfg.node_id), encode(st))

    async def _heartbeats(self) -> None:
        period = self.cfg.state_period_ms / 1000.0
        while not self._stop.is_set():
            try:
                await self._send_state()
            except Exception as exc:  # disconnected: keep trying, nats-py reconnects
                self.log.warning("heartbeat_failed", error=repr(exc))
            self._expire_held()
            self._tighten_guard()
            try:
                await asyncio.wait_for(self._stop.wait(), period)
            except asyncio.TimeoutError:
                pass

    def _tighten_guard(self) -> None:
        """kairos+ node-side guard: β·τ / the node's learned safety factor (as in the simulator)."""
        if self.cfg.tbt_guard_ms is not None and self.cfg.guard_correction:
            safety = self.corrector.correction(self.cfg.node_id, now_ms()).safety
            self.backend.set_tbt_guard_ms(self.cfg.tbt_guard_ms / safety)

    def _expire_held(self) -> None:
        """Prefill node: free the blocks of handed-off KV caches whose decode node never said it
        pulled them (it died after accepting the handoff); the client gets its answer from the
        ingress timeout, the cluster gets its memory back."""
        limit = now_ms() - self.cfg.kv_hold_timeout_s * 1000.0
        for rid, r in list(self.reqs.items()):
            if r.kind == "keep" and r.handoff_sent_ms is not None and r.handoff_sent_ms < limit:
                self.reqs.pop(rid, None)
                self.kv_backlog.pop(rid, None)
                if self.backend.phase(rid) == "held":
                    self.backend.release(rid)
                telemetry.end_span(r.handoff_span, "kv_pull_never_confirmed")
                self._rlog(rid, r.span).warning("kv_hold_expired", decode_node=r.handoff_node)

    # -- jobs -----------------------------------------------------------------------------------
    async def _on_job(self, msg) -> None:
        # a job is a request (a dispatcher's or the profiler's: nobody else may publish here) on
        # exactly this subject; a JetStream answer sent here has no reply subject (kairos/contracts/origin.py)
        mine = msg.reply and msg.subject == S.jobs_subject(self.cfg.node_id)
        if not self.origin.check(msg, "job", self.cfg.node_id if mine else None, None):
            return
        try:
            job = decode(msg.data, Job)
        except WireError as exc:
            self.log.error("bad_job", error=str(exc))
            await msg.respond(encode(JobAck(accepted=False, node=self.cfg.node_id, reason="bad_message")))
            return
        rid = job.request.request_id
        self.jobs_received.append(rid)
        if rid in self.reqs:  # a redelivered request re-sent to the node that already has it
            self.m.jobs.labels(self.cfg.node_id, job.kind, "duplicate").inc()
            self._rlog(rid).info("job_duplicate", attempt=job.attempt, dispatcher=job.dispatcher_id)
            await msg.respond(encode(JobAck(accepted=True, node=self.cfg.node_id, reason="duplicate",
                                            accepted_unix_ms=self.reqs[rid].received_ms)))
            return
        if rid in self.cancelled:  # the request ended before its job got here
            self.m.jobs.labels(self.cfg.node_id, job.kind, "cancelled").inc()
            await msg.respond(encode(JobAck(accepted=False, node=self.cfg.node_id, reason="cancelled")))
            return
        engine_ok = self.backend.available or await self.backend.confirm_available(ENGINE_PROBE_JOB_S)
        reason = job_refusal(job.kind, job.node, self.cfg.node_id, self.cfg.role,
                             self.accepting and engine_ok,
                             len(self.deflecting), job.request.prompt_tokens, job.request.max_tokens,
                             self.model.engine.max_model_len, job.request.deadline_unix_ms, now_ms(),
                             self.cfg.max_deflections)
        if reason is None and job.claim_buckets and self.claims is not None \
                and job.claim_buckets != len(self.claims.quorum.buckets):
            # two processes counting different claim buckets could both hold a majority: never run it
            reason = (f"lane_mismatch: the dispatcher has {job.claim_buckets} claim buckets, this node "
                      f"{len(self.claims.quorum.buckets)} (KAIROS_NATS_LANES / KAIROS_NATS_REPLICAS / KAIROS_NATS_URL "
                      f"must agree)")
            self.log.error("lane_mismatch", request_id=rid, dispatcher=job.dispatcher_id,
                           dispatcher_buckets=job.claim_buckets, node_buckets=len(self.claims.quorum.buckets))
        if reason is not None and rid in self._uncertain_claims and rid not in self.reqs and self.claims is not None:
            # an earlier try's claim may be stored here (its answer was lost) and this node will not run
            # it now: give it up, or the request would stay claimed by a node that never runs it (one
            # read and one delete per bucket at once, within the dispatcher's wait for the answer)
            await self.claims.release_mine(rid)
            self._uncertain_claims.discard(rid)
        if reason == "deflection_in_flight":
            self.deflect_overlaps += 1
            self.m.overlap.labels(self.cfg.node_id).inc()
        took_slot = reason is None and job.kind == "deflect" and rid not in self.deflecting
        if took_slot:  # before the claim's await: a concurrent deflect job sees the slot taken
            self._take_slot(rid)
        claim = None
        if reason is None and self.claims is None:
            reason = "claim_failed"  # the requests bucket is not open yet
        if reason is None:  # cluster-wide: at most one node executes this bus request id
            assert self.claims is not None
            try:  # bounded: jobs are handled one at a time, and the dispatcher waits job_ack_timeout_s
                claim = await asyncio.wait_for(self.claims.claim(job), CLAIM_TIMEOUT_S)
            except TimeoutError:
                claim = ClaimResult("failed", error=f"no answer from the requests bucket in {CLAIM_TIMEOUT_S} s")
            if claim.outcome == "failed":  # it may be stored all the same (the answer was lost)
                self._uncertain_claims.add(rid)
            elif claim.outcome == "mine" and rid not in self.reqs and rid in self._uncertain_claims:
                # an earlier try's claim was stored but its answer lost: this node holds it and never
                # started it, so it runs it now (answering "duplicate" would leave it run by nobody)
                claim = ClaimResult("won", claim.claim, claim.revisions)
            if claim.outcome == "mine" or rid in self.reqs:  # executed (or being executed) here already
                if took_slot and rid not in self.reqs:
                    self.deflecting.pop(rid, None)
                self.m.jobs.labels(self.cfg.node_id, job.kind, "duplicate").inc()
                self._rlog(rid).info("job_duplicate", attempt=job.attempt, dispatcher=job.dispatcher_id)
                await msg.respond(encode(JobAck(accepted=True, node=self.cfg.node_id, reason="duplicate",
                                                accepted_unix_ms=self.reqs[rid].received_ms if rid in self.reqs
                                                else now_ms())))
                return
            if claim.outcome == "withdrawn":  # the ingress refused this attempt (its tombstone): never run it
                if took_slot:
                    self.deflecting.pop(rid, None)
                self.cancelled.add(rid)
                self.m.jobs.labels(self.cfg.node_id, job.kind, "cancelled").inc()
                self._rlog(rid).info("job_refused", reason="withdrawn",
                                     withdrawn=claim.claim.withdrawn if claim.claim else None)
                await msg.respond(encode(JobAck(accepted=False, node=self.cfg.node_id, reason="cancelled")))
                return
            if claim.outcome == "claimed":
                if took_slot:
                    self.deflecting.pop(rid, None)
                self.m.jobs.labels(self.cfg.node_id, job.kind, "claimed_elsewhere").inc()
                self._rlog(rid).info("job_claimed_elsewhere", claimed_by=claim.claim.node if claim.claim else None)
                await msg.respond(encode(JobAck(accepted=False, node=self.cfg.node_id, reason="claimed",
                                                claim=claim.claim)))
                if claim.claim is not None and claim.claim.node == self.cfg.node_id:
                    # this node's previous incarnation held it and died with it: say so (the ingress
                    # re-submits it under a new bus id; this one must not run again)
                    await self._emit(rid, ErrorEvent(
                        request_id=rid, status=503, code="node_lost", source=f"node_agent:{self.cfg.node_id}",
                        message=f"node {self.cfg.node_id} restarted and lost request {rid}", sent_unix_ms=now_ms()))
                return
            if claim.outcome == "failed":
                reason = "claim_failed"
                self._rlog(rid).warning("claim_failed", error=claim.error)
        if reason is None:
            try:
                self.backend.note_block_hashes(rid, job.request.block_hashes, job.request.block_hash_tokens)
                if job.kind == "keep":
                    self.backend.add_prefill(job.request)
                else:
                    self.backend.add_deflected(job.request, list(job.chunk_schedule), job.decision_batch_size)
            except (EngineError, EngineApiError) as exc:
                reason = f"engine_refused: {exc}"
                if claim is not None and claim.revisions is not None:
                    await self.claims.release(rid, claim.revisions)  # another node may take it
        ctx = telemetry.extract_context(msg.headers)
        if reason is not None:
            if took_slot:
                self.deflecting.pop(rid, None)
            self.m.jobs.labels(self.cfg.node_id, job.kind, "refused").inc()
            self._rlog(rid, ctx).info("job_refused", reason=reason)
            await msg.respond(encode(JobAck(accepted=False, node=self.cfg.node_id, reason=reason)))
            return
        now = now_ms()
        name = "node.prefill" if job.kind == "keep" else "node.deflected_prefill"
        attrs = {telemetry.REQUEST_ID: rid, "kairos.node": self.cfg.node_id, "kairos.role": self.cfg.role,
                 "kairos.prompt_tokens": job.request.prompt_tokens, "kairos.max_tokens": job.request.max_tokens,
                 "kairos.attempt": job.attempt, "kairos.dispatcher_id": job.dispatcher_id,
                 telemetry.MESSAGING_SYSTEM: "nats", telemetry.MESSAGING_DESTINATION: S.jobs_subject(self.cfg.node_id),
                 telemetry.MESSAGING_OPERATION_TYPE: "process"}
        if job.kind == "deflect":
            attrs["kairos.chunk_schedule"] = list(job.chunk_schedule)
            attrs["kairos.predicted_step_ms"] = list(job.predicted_step_ms)
        else:
            attrs["kairos.decode_candidates"] = list(job.decode_candidates)
        span = self.tel.tracer.start_span(name, context=ctx, kind=SpanKind.CONSUMER, attributes=attrs)
        self.reqs[rid] = _Req(req=job.request, kind=job.kind, received_ms=now, span=span, job=job)
        self._uncertain_claims.discard(rid)
        resv: tuple[Reservation | None, str | None, int | None] = (None, None, None)
        if job.kind == "deflect":
            resv = await self._reserve(rid, job)
            self.max_concurrent_deflections = max(self.max_concurrent_deflections, len(self.deflecting))
        self.m.jobs.labels(self.cfg.node_id, job.kind, "accepted").inc()
        self._rlog(rid, span).info("job_accepted", kind=job.kind, attempt=job.attempt, dispatcher=job.dispatcher_id)
        await msg.respond(encode(JobAck(accepted=True, node=self.cfg.node_id, accepted_unix_ms=now_ms(),
                                        reservation=resv[0], reservation_key=resv[1], reservation_revision=resv[2])))

    async def _on_cancel(self, msg) -> None:
        try:
            c = decode(msg.data, Cancel)
        except WireError:
            return
        self.cancelled.add(c.request_id)  # a job for it arriving late (delayed delivery) is refused
        r = self.reqs.pop(c.request_id, None)
        if r is None:
            return
        self.backend.abort(c.request_id)
        self._end_deflection(c.request_id)
        self.kv_backlog.pop(c.request_id, None)
        for sp in (r.span, r.handoff_span, r.decode_span):
            telemetry.end_span(sp, f"cancelled: {c.reason}")
        self._rlog(c.request_id, r.span).info("request_cancelled", reason=c.reason)
        # the stages that ran stay visible in GET /v1/requests/{id} (a prefill record written at the
        # handoff already says everything about this node's part)
        if r.kind != "keep":
            self._write_decode_timing(r, error=f"cancelled: {c.reason}")
        elif r.handoff_node is None:
            self._write_prefill_timing(r, error=f"cancelled: {c.reason}")

    # -- keep path: prefill node ----------------------------------------------------------------
    async def _handoff(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is None or r.job is None:
            return
        r.handoff_span = self.tel.tracer.start_span(
            "node.kv_handoff", context=trace.set_span_in_context(r.span), kind=SpanKind.PRODUCER,
            attributes={telemetry.REQUEST_ID: rid, "kairos.node": self.cfg.node_id, "kairos.kv_tokens": r.req.prompt_tokens,
                        "kairos.decode_candidates": list(r.job.decode_candidates),
                        "kairos.kv_transfer_est_ms": self.backend.kv_transfer_ms(r.req.prompt_tokens)})
        headers = telemetry.inject_headers(trace.set_span_in_context(r.handoff_span))
        r.handoff_sent_ms = now_ms()
        msg = KvHandoff(request=r.req, src_node=self.cfg.node_id, kv_tokens=r.req.prompt_tokens,
                        prefill_done_unix_ms=r.prefill_done_ms or now_ms(), cached_tokens=r.cached_tokens,
                        kv_transfer_params=self.backend.handoff_params(rid))
        tried: dict[str, str] = {}
        settle_until = asyncio.get_running_loop().time() + HANDOFF_SETTLE_S
        while True:
            ok = await self._try_handoff(rid, r, msg, headers, tried)
            if ok is not None:
                return
            # right after a NATS reconnect the decode agents may not have re-subscribed yet
            if not (self._bus is not None and self._bus.settling(HANDOFF_SETTLE_S)
                    and asyncio.get_running_loop().time() < settle_until and rid in self.reqs):
                break
            await asyncio.sleep(0.2)
            tried.clear()
        self._rlog(rid, r.span).warning("kv_handoff_failed", tried=tried)
        await self._fail(rid, 503, "kv_handoff_failed", f"no decode node took the KV cache: {tried}")

    async def _try_handoff(self, rid: str, r: _Req, msg: KvHandoff, headers, tried: dict[str, str]) -> bool | None:
        """One pass over the decode candidates: True = handed off, False = cancelled meanwhile,
        None = nobody took it (``tried`` says why)."""
        assert r.job is not None and r.handoff_span is not None
        for cand in r.job.decode_candidates:
            try:
                ack = await request_typed(self.nc, S.kv_subject(cand, agent_user(self.cfg.node_id)), msg, KvAck,
                                          self.cfg.kv_handoff_timeout_s, headers)
            except nats.errors.NoRespondersError:
                tried[cand] = "no_responders"
                continue
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                tried[cand] = "timeout"
                continue
            if ack.accepted:
                if rid in self.cancelled:  # cancelled meanwhile: the decode node gets a cancel too
                    return False
                # not in self.reqs any more without a cancel: the decode node's KvDone (another
                # subscription, so another task) was handled before this answer — the handoff
                # happened, and without this event the ingress would hold its tokens until a 504
                pulled = rid not in self.reqs
                r.handoff_node = cand
                # the ingress accepts the tokens of the node this names (it holds any that overtake this)
                await self._emit(rid, HandoffEvent(request_id=rid, node=self.cfg.node_id, decode_node=cand,
                                                   sent_unix_ms=now_ms()))
                r.handoff_span.set_attribute("kairos.decode_node", cand)
                if tried:
                    r.handoff_span.set_attribute("kairos.rerouted_from", [f"{k}:{v}" for k, v in tried.items()])
                if not pulled:
                    self.kv_backlog[rid] = self.backend.kv_transfer_ms(r.req.prompt_tokens)
                self._write_prefill_timing(r)
                return True
            tried[cand] = ack.reason or "refused"
        return None

    async def _on_kvdone(self, msg) -> None:
        """A decode node pulled (or gave up on) a KV cache this node holds: release it. Only from
        a decode node the request's job named (the NATS user in the subject,
        ``kairos.kvdone.<this node>.agent-<decode node>``; not only the one whose acceptance this
        node has already seen: its notice may overtake its answer), else refused as forged."""
        try:
            d = decode(msg.data, KvDone)
        except WireError:
            return
        sender = S.subject_node(msg.subject, lambda u: S.kvdone_subject(self.cfg.node_id, u))
        proven = sender[len(AGENT_PREFIX):] if sender and sender.startswith(AGENT_PREFIX) else None
        if not self.origin.check(msg, "kv_done", proven, d.decode_node, request_id=d.request_id):
            return
        held = self.reqs.get(d.request_id)
        if held is not None and (held.job is None or proven not in held.job.decode_candidates):
            self.origin.refuse(msg.subject, "kv_done", "not_the_holder", proven, d.decode_node,
                               request_id=d.request_id, handed_to=held.handoff_node)
            return
        r = self.reqs.pop(d.request_id, None)
        self.kv_backlog.pop(d.request_id, None)
        if self.backend.phase(d.request_id) == "held":
            self.backend.release(d.request_id)
        if r is not None and r.handoff_span is not None:
            r.handoff_span.set_attribute("kairos.kv_transfer_ms", d.transfer_ms)
            r.handoff_span.end()

    # -- keep path: decode node -----------------------------------------------------------------
    async def _on_kv(self, msg) -> None:
        try:
            h = decode(msg.data, KvHandoff)
        except WireError:
            await msg.respond(encode(KvAck(accepted=False, node=self.cfg.node_id, reason="bad_message")))
            return
        rid = h.request.request_id
        forged = await self._forged_handoff(msg, h)
        if forged is not None:
            await msg.respond(encode(KvAck(accepted=False, node=self.cfg.node_id, reason=forged)))
            return
        if rid in self.reqs:
            await msg.respond(encode(KvAck(accepted=True, node=self.cfg.node_id, reason="duplicate")))
            return
        reason = None if self.accepting else "draining"
        if rid in self.cancelled:
            reason = "cancelled"
        if reason is None and not (self.backend.available
                                   or await self.backend.confirm_available(
                                       min(ENGINE_PROBE_KV_S, self.cfg.kv_handoff_timeout_s / 2))):
            reason = "engine_unavailable"
        if reason is None:
            try:
                self.backend.note_block_hashes(rid, h.request.block_hashes, h.request.block_hash_tokens)
                self.backend.add_remote_decode(h.request, h.kv_transfer_params)
            except (EngineError, EngineApiError) as exc:
                reason = f"engine_refused: {exc}"
        if reason is not None:
            await msg.respond(encode(KvAck(accepted=False, node=self.cfg.node_id, reason=reason)))
            return
        span = self.tel.tracer.start_span("node.kv_transfer", context=telemetry.extract_context(msg.headers),
                                          kind=SpanKind.CONSUMER,
                                          attributes={telemetry.REQUEST_ID: rid, "kairos.src_node": h.src_node,
                                                      "kairos.kv_tokens": h.kv_tokens, "kairos.node": self.cfg.node_id})
        self.reqs[rid] = _Req(req=h.request, kind="remote_decode", received_ms=now_ms(), span=span, src_node=h.src_node,
                              cached_tokens=h.cached_tokens)
        await msg.respond(encode(KvAck(accepted=True, node=self.cfg.node_id)))
        await self._on_allocated(self.backend.take_allocated())

    async def _forged_handoff(self, msg, h: KvHandoff) -> str | None:
        """Why a handoff is refused, or None: it must come from the node it names (the NATS user in
        its subject, ``kairos.kv.<this node>.<user>``) and that node must hold the request's
        execution claim as its prefill node — or come from ``kairos profile``, which drives this node."""
        sender = S.subject_node(msg.subject, lambda u: S.kv_subject(self.cfg.node_id, u))
        if sender == PROFILER:
            return None
        proven = sender[len(AGENT_PREFIX):] if sender and sender.startswith(AGENT_PREFIX) else None
        rid = h.request.request_id
        if not self.origin.check(msg, "kv_handoff", proven, h.src_node, request_id=rid):
            return "forged"
        claim = await self.claims.holder(rid) if self.claims is not None else None
        if claim is None or claim.node != h.src_node or claim.kind != "keep":
            self.origin.counter.labels("kv_handoff").inc()
            self.log.warning("forged_message_refused", kind="kv_handoff", reason="not_the_holder", subject=msg.subject,
                             sender=proven, request_id=rid, claimed_by=claim.node if claim else None)
            return "not_the_holder"
        return None

    async def _on_allocated(self, rids: list[str]) -> None:
        for rid in rids:
            r = self.reqs.get(rid)
            if r is not None:
                r.kv_alloc_ms = now_ms()
                self._bg(self._pull(rid, r))

    async def _pull(self, rid: str, r: _Req) -> None:
        ms = await self.backend.pull_kv(r.src_node or "", rid, r.req.prompt_tokens)
        ok = self.backend.phase(rid) == "awaiting_kv" and rid in self.reqs
        if ok:
            self.backend.kv_arrived(rid)
            r.kv_arrived_ms = now_ms()
            self.m.kv_transfers.labels(self.cfg.node_id).inc()
            self.m.kv.labels(self.cfg.node_id).observe(telemetry.seconds(ms))
            r.span.set_attribute("kairos.kv_transfer_ms", ms)
            r.span.end()
            r.decode_span = self._decode_span(rid, r)
        await publish(self.nc, S.kvdone_subject(r.src_node or "", agent_user(self.cfg.node_id)),
                      KvDone(request_id=rid, decode_node=self.cfg.node_id, ok=ok, transfer_ms=ms))

    # -- engine events (EngineEvents, kairos/engines/base.py) -----------------------------
    def step_record(self, out: StepOutput) -> StepRecordEvent:
        """The bus record of one executed step (contract D: ``kairos.steps.<node>``)."""
        n = sum(t for _, t, _ in out.prefill_chunks)
        cached = sum(t * c for _, t, c in out.prefill_chunks) / n if n else 0.0
        return StepRecordEvent(node=self.cfg.node_id, role=self.cfg.role, step=out.step,
                               started_unix_ms=out.started_unix_ms, wall_ms=out.wall_ms, predicted_ms=out.predicted_ms,
                               batch_size=out.batch_size, kv_tokens=out.kv_tokens, prefill_tokens=out.prefill_tokens,
                               prefill_cached=cached, prefill_chunks=len(out.prefill_chunks),
                               deflected=out.deflected_chunk is not None, model_version=self.model.artifact_version)

    async def on_allocated(self, rids: list[str]) -> None:
        await self._on_allocated(rids)

    def _queue_step(self, rec: StepRecordEvent) -> None:
        """Batch ``rec`` for ``kairos.steps.<node>``: sent at most ``STEP_BATCH_S`` after the batch's
        first step, or at once at ``STEP_BATCH_MAX`` records (one bus message per batch; nothing is
        sent while the engine is idle)."""
        self._steps.append(rec)
        if len(self._steps) >= STEP_BATCH_MAX:
            self._flush_steps()
        elif self._steps_timer is None:
            self._steps_timer = asyncio.get_running_loop().call_later(STEP_BATCH_S, self._flush_steps)

    def _flush_steps(self) -> None:
        """Publish the waiting step records as one message (a JSON array, :data:`kairos.contracts.wire.StepRecords`)."""
        if self._steps_timer is not None:
            self._steps_timer.cancel()
            self._steps_timer = None
        batch, self._steps = self._steps, []
        if batch and self.nc is not None:
            self._steps_sending = self._bg(self._publish_steps(batch, self._steps_sending))

    async def _publish_steps(self, batch: list[StepRecordEvent], previous: asyncio.Task | None) -> None:
        """Publish ``batch`` after ``previous`` (the batch before it) went out: records stay in step order."""
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        try:
            await self.nc.publish(S.steps_subject(self.cfg.node_id), encode(batch))
        except Exception as exc:  # disconnected: the steps still count, their records are lost
            self.log.warning("step_record_failed", error=repr(exc), records=len(batch))

    async def on_step(self, out: StepOutput) -> None:
        """Step metrics, the step record on the bus, the node's step-time correction and the
        deflected chunk's record (span event, predicted vs measured)."""
        node = self.cfg.node_id
        self.corrector.observe(node, out.predicted_ms, out.wall_ms, out.started_unix_ms + out.wall_ms,
                               mixed=out.batch_size > 0 and out.prefill_tokens > 0)
        self._queue_step(self.step_record(out))
        self.m.steps.labels(node).inc()
        self.m.step.labels(node).observe(telemetry.seconds(out.wall_ms))
        for rid, _n, cached in out.prefill_chunks:
            r = self.reqs.get(rid)
            # a keep-path decode's one prompt token after its KV arrived is no prefill of this node: its
            # cached tokens are the prefill node's (the handoff), not the KV it pulled
            if r is not None and r.kind != "remote_decode" and r.prefill_start_ms is None:
                r.prefill_start_ms = out.started_unix_ms
                r.cached_tokens = cached  # the first chunk starts after the prefix-cache hit
        if out.deflected_chunk is not None:
            rid, idx, chi, toks = out.deflected_chunk
            r = self.reqs.get(rid)
            if r is not None:
                pred = (r.job.predicted_step_ms[idx] if r.job and idx < len(r.job.predicted_step_ms)
                        else out.predicted_ms)
                r.chunk_pred.append(pred)
                r.chunk_actual.append(out.wall_ms)
                r.chunk_sizes.append(chi)
                # a real engine's last chunk record can arrive after the first token (separate
                # channels): the prefill span has ended then, the decode span gets the event
                span = r.span if r.span.is_recording() or r.decode_span is None else r.decode_span
                span.add_event("chunk", {"chi": chi, "step_index": idx, "prefill_tokens": toks,
                                         "predicted_ms": pred, "engine_predicted_ms": out.predicted_ms,
                                         "actual_ms": out.wall_ms, "batch_size": out.batch_size})
                self.m.chunks.labels(node).inc()
                self.m.chunk_pred.labels(node).observe(telemetry.seconds(pred))
                self.m.chunk_meas.labels(node).observe(telemetry.seconds(out.wall_ms))
                if pred > 0:
                    self.m.chunk_err.labels(node, "decision").observe((out.wall_ms - pred) / pred)
                if out.predicted_ms > 0:
                    self.m.chunk_err.labels(node, "engine").observe((out.wall_ms - out.predicted_ms) / out.predicted_ms)

    async def on_prefill_done(self, rid: str) -> None:
        """Keep path, prefill node: hand the KV to a decode node."""
        r = self.reqs.get(rid)
        if r is not None:
            r.prefill_done_ms = now_ms()
            r.span.end()
            self._bg(self._handoff(rid))

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str) -> None:
        """Stream tokens to the client; the first one ends a deflection's prefill (slot released)."""
        r = self.reqs.get(rid)
        if r is None:
            return
        now = now_ms()
        if first_index == 0 and r.first_token_ms is None:
            r.first_token_ms = now
            if r.kind == "deflect":
                r.prefill_done_ms = now
                r.span.set_attribute("kairos.chunks_run", len(r.chunk_sizes))
                r.span.end()
                self._end_deflection(rid)
                r.decode_span = self._decode_span(rid, r)
        r.tokens += count
        if r.last_token_ms is not None:
            r.tbt_max_ms = max(r.tbt_max_ms, now - r.last_token_ms)
        r.last_token_ms = now
        await self._emit(rid, TokenEvent(
            request_id=rid, first_index=first_index, count=count, text=text, node=self.cfg.node_id, sent_unix_ms=now))
        self.m.tokens.labels(self.cfg.node_id).inc(count)

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int) -> None:
        """Last token emitted: close the spans, tell the client, write the decode record."""
        r = self.reqs.pop(rid, None)
        if r is None:
            return
        now = now_ms()
        if r.decode_span is not None:  # ended first: the trace is complete when the client has its answer
            r.decode_span.set_attributes(self._decode_summary(r))
            r.decode_span.end()
        await self._emit(rid, DoneEvent(
            request_id=rid, completion_tokens=r.tokens, node=self.cfg.node_id, sent_unix_ms=now,
            finish_reason=finish_reason,
            # keep path: what the prefill node served from its cache (KvHandoff); else the larger of
            # the engine's report (vLLM usage) and the prefix hit seen in the step records
            cached_tokens=r.cached_tokens if r.kind == "remote_decode" else max(cached_tokens, r.cached_tokens)))
        self._write_decode_timing(r, finished_ms=now)

    async def on_failed(self, rid: str, status: int, code: str, message: str) -> None:
        """The engine could not serve ``rid``: explicit error to the client."""
        if rid in self.reqs:
            self._rlog(rid).warning("engine_failed_request", code=code, message=message)
            await self._fail(rid, status, code, message)

    def _decode_span(self, rid: str, r: _Req) -> Span:
        return self.tel.tracer.start_span("node.decode", context=trace.set_span_in_context(r.span), attributes={
            telemetry.REQUEST_ID: rid, "kairos.node": self.cfg.node_id,
            "kairos.path": "deflect" if r.kind == "deflect" else "keep"})

    @staticmethod
    def _decode_summary(r: _Req) -> dict:
        """Output tokens and TBT seen on this node (first token → last token)."""
        out: dict = {telemetry.GEN_AI_USAGE_OUTPUT_TOKENS: r.tokens, "kairos.completion_tokens": r.tokens,
                     "kairos.tbt_max_ms": round(r.tbt_max_ms, 3)}
        if r.tokens > 1 and r.first_token_ms is not None and r.last_token_ms is not None:
            out["kairos.tbt_mean_ms"] = round((r.last_token_ms - r.first_token_ms) / (r.tokens - 1), 3)
        return out

    async def _reserve(self, rid: str, job: Job) -> tuple[Reservation, str, int | None]:
        """Take a free deflection slot of this node for ``rid`` and store its reservation
        (``kairos_resv/decode.<node>.<slot>``, TTL ``job.reservation_ttl_s``) for the dispatchers;
        returns (reservation, key, revision — None if the bus did not confirm it).

        The node is the authority on its own slots (it refuses a deflection beyond
        ``max_deflections``), so it is also the only writer of its reservation keys: a plain put,
        no atomic create. Its engine already has the job: the first token does not wait for this
        write, only the job's answer does, which carries the reservation and its revision (the
        dispatcher applies them at once). A node that dies leaves its reservations to their TTL.
        """
        key = self.deflecting.get(rid) or self._take_slot(rid)
        ttl = job.reservation_ttl_s or DEFAULT_RESERVATION_TTL_S
        now = now_ms()
        value = Reservation(request_id=rid, decode_node=self.cfg.node_id, dispatcher_id=job.dispatcher_id,
                            prompt_tokens=job.request.prompt_tokens, output_tokens=job.request.max_tokens,
                            created_unix_ms=now, expires_unix_ms=now + ttl * 1000.0)
        try:
            rev = await kv_put_ttl(self.nc, S.RESERVATION_BUCKET, key, encode(value), ttl, RESERVATION_PUT_TIMEOUT_S)
            return value, key, rev
        except Exception as exc:  # the slot is still held here; the dispatcher holds it until it expires
            self._rlog(rid).warning("reservation_publish_failed", key=key, error=repr(exc))
            return value, key, None

    def _take_slot(self, rid: str) -> str:
        """Hold the lowest free deflection slot of this node for ``rid``; returns its reservation key."""
        used = set(self.deflecting.values())
        slot = next(i for i in range(len(used) + 1) if S.reservation_key(self.cfg.node_id, i) not in used)
        key = self.deflecting[rid] = S.reservation_key(self.cfg.node_id, slot)
        return key

    def _end_deflection(self, rid: str) -> None:
        """The deflected prefill of ``rid`` finished or failed: free this node's deflection slot
        (the key's delete follows its put on this connection, so it never overtakes it)."""
        key = self.deflecting.pop(rid, None)
        if key is None or self.nc is None:
            return

        async def release() -> None:
            try:
                await kv_delete_nowait(self.nc, S.RESERVATION_BUCKET, key)
            except Exception as exc:  # disconnected: the key expires by its TTL
                self._rlog(rid).info("reservation_release_failed", key=key, error=repr(exc))
        self._bg(release())

    async def _fail(self, rid: str, status: int, code: str, message: str) -> None:
        """Give up on ``rid`` here: free everything and tell the client (explicit error)."""
        r = self.reqs.pop(rid, None)
        phase = self.backend.phase(rid)
        if phase == "held":
            self.backend.release(rid)
        elif phase is not None:
            self.backend.abort(rid)
        self._end_deflection(rid)
        self.kv_backlog.pop(rid, None)
        try:
            await self._emit(rid, ErrorEvent(
                request_id=rid, status=status, code=code, message=message, source=f"node_agent:{self.cfg.node_id}",
                sent_unix_ms=now_ms()))
        except Exception as exc:
            self._rlog(rid, r.span if r else None).warning("error_publish_failed", error=repr(exc))
        if r is not None:
            for sp in (r.span, r.handoff_span, r.decode_span):
                telemetry.end_span(sp, code)
            if r.kind == "keep":
                self._write_prefill_timing(r, error=code)
            else:
                self._write_decode_timing(r, error=code)

    # -- records --------------------------------------------------------------------------------
    def _write_prefill_timing(self, r: _Req, error: str | None = None) -> None:
        rec = PrefillTiming(node=self.cfg.node_id, received_unix_ms=r.received_ms, prefill_start_unix_ms=r.prefill_start_ms,
                            prefill_done_unix_ms=r.prefill_done_ms, handoff_node=r.handoff_node, error=error)
        self._put_record(r.req.request_id, "prefill", rec, r.span)

    def _write_decode_timing(self, r: _Req, finished_ms: float | None = None, error: str | None = None) -> None:
        rec = DecodeTiming(node=self.cfg.node_id, kind="deflect" if r.kind == "deflect" else "keep",
                           received_unix_ms=r.received_ms, kv_allocated_unix_ms=r.kv_alloc_ms,
                           kv_arrived_unix_ms=r.kv_arrived_ms,
                           prefill_start_unix_ms=r.prefill_start_ms if r.kind == "deflect" else None,
                           prefill_done_unix_ms=r.prefill_done_ms if r.kind == "deflect" else None,
                           first_token_unix_ms=r.first_token_ms, finished_unix_ms=finished_ms,
                           completion_tokens=r.tokens, chunk_predicted_ms=r.chunk_pred, chunk_actual_ms=r.chunk_actual,
                           chunk_sizes=r.chunk_sizes, error=error)
        self._put_record(r.req.request_id, "decode", rec, r.span)

    def _put_record(self, rid: str, part: str, rec, span: Span | None = None) -> None:
        """Write ``rid``'s ``part`` record (one unacknowledged message: kairos.runtime.bus.kv_put_nowait)."""
        if self.nc is None:
            return
        log = self._rlog(rid, span)

        async def put() -> None:
            try:
                await kv_put_nowait(self.nc, S.REQUESTS_BUCKET, S.record_key(rid, part, self.cfg.node_id), encode(rec))
            except Exception as exc:
                log.warning("record_write_failed", part=part, error=repr(exc))
        self._bg(put())


async def run(cfg: AgentConfig, stop: asyncio.Event, model: LatencyModel | None = None) -> None:
    """Run one node agent until ``stop`` is set, then drain."""
    agent = NodeAgent(cfg, model)
    await agent.start()
    try:
        await stop.wait()
    finally:
        await agent.close(drain=True)
