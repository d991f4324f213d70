"""Node agent: one engine instance on the bus (the composition root of kairos/services/node_agent).

Inputs: jobs on ``kairos.jobs.<node>`` (request-reply), KV handoffs on ``kairos.kv.<node>``
(decode nodes, request-reply), KV-pulled notices on ``kairos.kvdone.<node>.<decode agent>`` (prefill
nodes), cancels on ``kairos.cancel``, resend requests on ``kairos.resend``. Outputs: heartbeats on
``kairos.state.<node>``, tokens/done/errors on ``kairos.out.<rid>.agent-<node>``, step records on
``kairos.steps.<node>``, timing records in the ``kairos_requests`` bucket, reservations.

The parts, one concern each, sharing one :class:`~.context.NodeContext`:

* :mod:`.request` — one request's lifecycle, a pure state machine (phases, transitions, records);
* :mod:`.jobs` — a job in, its answer out (deflection slots: :mod:`.slots`);
* :mod:`.kv` — the keep path's KV handoff, prefill side and decode side;
* :mod:`.effects` — the engine's request events, cancels and failures, and carrying out the actions;
* :mod:`.steps` — step records and metrics; :mod:`.heartbeat` — heartbeats; :mod:`.tracing` — spans.

Paths (docs/architecture.md): keep — the prefill node prefills and hands the KV to the first decode
candidate that accepts, which pulls it and decodes; deflect — the decode node runs the chunked
prefill (one span event per chunk: χ, predicted ms, actual ms), releases its deflection slot at
the first token, decodes.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.contracts.events import Cancel, Drain, Resend
from kairos.contracts.wire import decode, WireError
from kairos.core.engine_model import GroundTruth
from kairos.core.model.correction import CorrectionEstimator
from kairos.core.model.latency import LatencyModel, load_profile
from kairos.engines import make_backend
from kairos.engines.base import EngineBackend, StepOutput
from kairos.runtime import telemetry
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import flush_barrier
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.resources import BackgroundTasks, Resources
from kairos.runtime.service import forward, forward_all, start_metrics_and_connect
from kairos.services.node_agent.config import AgentConfig
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.drain import DrainReport, Drainer
from kairos.services.node_agent.effects import Effects
from kairos.services.node_agent.heartbeat import Heartbeats
from kairos.services.node_agent.jobs import Jobs
from kairos.services.node_agent.kv import KvReceiver, KvSender
from kairos.services.node_agent.metrics import AgentMetrics
from kairos.services.node_agent.outbox import RESEND_WINDOW_S
from kairos.services.node_agent.slots import DeflectionSlots
from kairos.services.node_agent.steps import StepRecords

#: a draining close waits this long (s) for the background tasks in flight (records, releases)
DRAIN_TASKS_S = 2.0


def ground_truth(cfg: AgentConfig, model: LatencyModel) -> GroundTruth | None:
    """The emulated engine's real step times from ``truth_profile``/``truth_scale`` (None: the model, exactly)."""
    if cfg.truth_profile is None and cfg.truth_scale == 1.0:
        return None
    return GroundTruth(load_profile(cfg.truth_profile) if cfg.truth_profile else model, scale=cfg.truth_scale)


class NodeAgent:
    """One node agent. ``start()`` connects and runs; ``close()`` drains (or dies abruptly).

    Args:
        cfg: the node's settings.
        model: its latency profile (default: ``cfg.profile``).
        backend: its engine (default: :func:`kairos.engines.make_backend` for ``cfg.backend``).
        clock: the clocks its protocol logic reads (a manual clock in tests).
    """

    def __init__(self, cfg: AgentConfig, model: LatencyModel | None = None, backend: EngineBackend | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg = cfg
        self.model = model or load_profile(cfg.profile)
        self.backend = backend or make_backend(cfg, self.model, ground_truth(cfg, self.model))
        self.tel = telemetry.setup("node_agent", cfg.node_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log.bind(node=cfg.node_id, role=cfg.role)
        self.m = AgentMetrics(self.tel.registry, cfg.node_id)
        self.epoch_unix_ms = clock.now_ms()  #: this incarnation (heartbeats, job answers): a restart is a newer epoch
        self.ctx = NodeContext(cfg=cfg, model=self.model, backend=self.backend, log=self.log, tracer=self.tel.tracer,
                               metrics=self.m, origin=OriginGuard(forged_counter("agent", self.tel.registry), self.log),
                               tasks=BackgroundTasks(self.log), clock=clock, epoch_unix_ms=self.epoch_unix_ms)
        self.corrector = CorrectionEstimator()  #: the node's own step-time correction, for its guard
        self.slots = DeflectionSlots(self.ctx)
        self.effects = Effects(self.ctx, self.slots, hand_off=lambda r: self.kv_out.start(r),
                               pull=lambda r: self.kv_in.start_pull(r))
        self.kv_out, self.kv_in = KvSender(self.ctx, self.effects), KvReceiver(self.ctx, self.effects)
        self.jobs = Jobs(self.ctx, self.slots, self.effects)
        self.steps = StepRecords(self.ctx, self.corrector)
        self.heartbeats = Heartbeats(self.ctx, self.slots, self.steps, self.corrector, self.epoch_unix_ms)
        self.drainer = Drainer(self.ctx, self.effects, self.heartbeats.send)
        self.drained = asyncio.Event()  #: set when an operator's drain finished: the agent should exit
        self.metrics_port: int | None = None
        self._runner: Any = None  #: the /metrics server (kairos.runtime.service.start_metrics_and_connect)
        self._stop = asyncio.Event()
        self._main: list[asyncio.Task] = []  #: the engine's driver and the heartbeats
        self._subs: list[Any] = []
        self._drain = True
        self.res = Resources(self.log)
        for name, step in (("telemetry", self.tel.shutdown), ("metrics_server", self._close_runner),
                           ("nats", self._close_nats), ("background_tasks", self._end_tasks),
                           ("step_records", self._end_steps), ("engine_and_heartbeats", self._stop_main),
                           ("drain", self._drain_requests), ("bus_watch", self._stop_bus_watch)):
            self.res.push(name, step)  # closed last first: bus watch, drain, …, telemetry

    # -- what the node's parts share, as attributes of the agent (tests, kairos profile) ----------------
    # the NATS connection (None until started), False once the node drains (or a test makes it refuse
    # work), the requests this node holds by bus request id, the request ids cancelled recently, the
    # forged-message guard
    nc, accepting, reqs, cancelled, origin = forward_all("ctx", "nc", "accepting", "reqs", "cancelled", "origin")
    deflecting = forward("slots.held", "request id -> the reservation key of the deflection slot it holds")
    max_concurrent_deflections = forward("slots.max_concurrent", "the most deflections accepted at once")
    deflect_overlaps = forward("slots.overlaps", "deflect jobs refused: every slot was taken")
    jobs_received = forward("jobs.received", "request ids of every job received")

    # -- start / close ------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        await start_metrics_and_connect(self, f"node_agent:{cfg.node_id}")
        if cfg.role == "decode":
            await self.slots.clear_stale()
        self.ctx.bus = BusWatch(self.nc, self._bus_back, log=self.log, on_connected=self._resend_lost).start()
        subs = [(S.jobs_subject(cfg.node_id), self._on_job), (S.CANCEL_SUBJECT, self._on_cancel),
                (S.RESEND_SUBJECT, self._on_resend), (S.drain_subject(cfg.node_id), self._on_drain)]
        if cfg.role == "decode":
            subs.append((S.kv_wildcard(cfg.node_id), self.kv_in.on_kv))
        else:
            subs.append((S.kvdone_wildcard(cfg.node_id), self.kv_out.on_kvdone))
        for subject, cb in subs:
            self._subs.append(await self.nc.subscribe(subject, cb=cb))
        await flush_barrier(self.nc)
        self._main = [asyncio.create_task(self.backend.run(self, self._stop)),
                      asyncio.create_task(self.heartbeats.run(self._stop, self.kv_out.expire_held))]
        await self.heartbeats.send()
        self.log.info("agent_started", metrics_port=self.metrics_port, profile=self.model.artifact_version)

    async def _bus_back(self) -> None:
        """NATS is back (BusWatch): nothing to declare again — an agent uses no stream but its
        reservation keys and records, written by plain publishes; its lost out events are sent
        again at the reconnect itself (:meth:`_resend_lost`)."""

    async def drain(self, why: str) -> DrainReport:
        """Drain gracefully (kairos/services/node_agent/drain.py: nothing new, the queued moved at once,
        the running finished within ``drain_timeout_s``, the rest moved); :meth:`close` follows."""
        return await self.drainer.run(why)

    async def close(self, drain: bool = True) -> None:
        """Stop. ``drain``: refuse new work and send an explicit error for every request still
        here; ``drain=False`` emulates a crash (connection dropped, nothing sent). The close steps
        (:class:`~kairos.runtime.resources.Resources`, pushed in ``__init__``) run last first."""
        self.ctx.accepting = False
        self._drain = drain
        await self.res.aclose()

    async def _stop_bus_watch(self) -> None:
        if self.ctx.bus is not None:
            await self.ctx.bus.stop()

    async def _drain_requests(self) -> None:
        """Unsubscribe, fail every request this node still owes an answer, say so in a heartbeat."""
        if not (self._drain and self.nc is not None and self.nc.is_connected):
            return
        for s in self._subs:
            await s.unsubscribe()
        for r in list(self.reqs.values()):
            await self.effects.run(r, r.shutdown(self.ctx.clock.now_ms()))
        await self.heartbeats.send()

    async def _stop_main(self) -> None:
        self._stop.set()
        for t in self._main:
            t.cancel()
        await asyncio.gather(*self._main, return_exceptions=True)

    def _end_steps(self) -> None:
        if self._drain:
            self.steps.flush()  # the last steps' records go out before the connection closes
        else:
            self.steps.drop_timer()

    async def _end_tasks(self) -> None:
        """Draining: the records and releases in flight get :data:`DRAIN_TASKS_S` to finish; a crash cancels them."""
        if self._drain:
            await self.ctx.tasks.drain(DRAIN_TASKS_S)
        else:
            await self.ctx.tasks.cancel_all()

    async def _close_nats(self) -> None:
        await bus_close(self.nc, graceful=self._drain)

    async def _close_runner(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- subscriptions --------------------------------------------------------------------------------
    async def _on_job(self, msg: Any) -> None:
        await self.jobs.on_job(msg)

    async def _on_drain(self, msg: Any) -> None:
        """An operator's drain (``kairos drain NODE`` through the ingress, which alone may publish it):
        drain, then ask the process to exit (:attr:`drained`)."""
        try:
            d = decode(msg.data, Drain)
        except WireError:
            return
        mine = msg.subject == S.drain_subject(self.cfg.node_id)
        if not self.origin.check(msg, "drain", self.cfg.node_id if mine else None, d.node):
            return
        self.log.info("drain_requested", reason=d.reason)
        self.ctx.tasks.spawn(self._drain_then_exit(), "drain")

    async def _drain_then_exit(self) -> None:
        await self.drain("operator")
        self.drained.set()

    async def _on_cancel(self, msg: Any) -> None:
        try:
            c = decode(msg.data, Cancel)
        except WireError:
            return
        await self.effects.cancel(c.request_id, c.reason)

    async def _resend_lost(self) -> None:
        """After a reconnect (BusWatch ``on_connected``): publish again the out events sent in
        ``RESEND_WINDOW_S`` before the connection was lost — the dead server may have had them."""
        b = self.ctx.bus
        if b is None or b.reconnected_at is None:
            return
        await self._resend(self.effects.outbox.since(b.reconnected_at - (b.outage_s or 0.0) - RESEND_WINDOW_S), "agent")

    async def _on_resend(self, msg: Any) -> None:
        """The ingress reconnected (``Resend``): publish again the out events of its window."""
        try:
            r = decode(msg.data, Resend)
        except WireError:
            return
        outbox = self.effects.outbox
        await self._resend(outbox.since(self.ctx.clock.monotonic() - min(r.window_s, outbox.keep_s)), "ingress")

    async def _resend(self, again: list[tuple[str, bytes]], why: str) -> None:
        for subject, payload in again:
            await self.nc.publish(subject, payload)
        if again:
            self.log.info("out_events_resent", events=len(again), reconnected=why)

    # -- the engine's events (EngineEvents, kairos/engines/base.py) -----------------------------------
    async def on_step(self, out: StepOutput) -> None:
        await self.steps.on_step(out)

    async def on_allocated(self, rids: list[str]) -> None:
        await self.kv_in.on_allocated(rids)

    async def on_prefill_done(self, rid: str) -> None:
        await self.effects.on_prefill_done(rid)

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str,
                        finish_reason: str | None = None, logprobs: list | None = None,
                        stop_reason: str | int | None = None, token_ids: list[int] | None = None) -> None:
        await self.effects.on_tokens(rid, first_index, count, text, finish_reason, logprobs, stop_reason, token_ids)

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int,
                          stop_reason: str | int | None = None) -> None:
        await self.effects.on_finished(rid, finish_reason, cached_tokens, stop_reason)

    async def on_failed(self, rid: str, status: int, code: Any, message: str) -> None:
        await self.effects.on_failed(rid, status, code, message)


async def run(cfg: AgentConfig, stop: asyncio.Event, model: LatencyModel | None = None) -> None:
    """Run one node agent until ``stop`` is set or an operator's drain finished, then close: after
    SIGTERM (what Kubernetes and ``docker stop`` send) or a drain, gracefully (issue 33:
    kairos/services/node_agent/drain.py); after SIGINT (Ctrl-C; ``kairos up`` stopping the whole
    stack) at once, every request it holds ending with ``node_shutdown`` (moved by the ingress)."""
    agent = NodeAgent(cfg, model)
    await agent.start()
    try:
        signalled = asyncio.ensure_future(stop.wait())
        drained = asyncio.ensure_future(agent.drained.wait())
        await asyncio.wait({signalled, drained}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        drained.cancel()
        if getattr(stop, "signum", None) != signal.SIGINT:
            await agent.drain("SIGTERM" if stop.is_set() else "operator")
    finally:
        await agent.close(drain=True)
