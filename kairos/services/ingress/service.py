"""Ingress: OpenAI HTTP in, requests to the dispatchers' queue group (core NATS), token streams back out.

The composition root: :class:`Ingress` builds the parts, connects them to NATS and HTTP at
:meth:`Ingress.start`, and lets go of them in reverse order at :meth:`Ingress.close`
(:class:`kairos.runtime.resources.Resources`). Each part is one concern:

==========================  =========================================================================
:mod:`.app`                 routes, the error middleware, ``/v1/models``, ``/metrics``, ``/v1/requests/{id}``
:mod:`.completions`         the completion endpoints: admission (429), body, validation, span, record
:mod:`.relay`               one request: submit, follow its events through its lifecycle, answer (SSE)
:mod:`.lifecycle`           the rules of a request's life (a pure state machine)
:mod:`.flights`             the in-flight registry; out events and routed nodes to the right request
:mod:`.jobrelay`            the jobs the dispatchers plan, sent to the nodes by this ingress (its arbiter)
:mod:`.liveness`            heartbeats; watchers: clients gone, nodes lost, quiet streams, silent routings, bus down
:mod:`.readiness`           the cluster view and ``/health``
:mod:`.records`             the ingress record and the ``/v1/requests/{id}`` merge
:mod:`.nats_bus`            :class:`~.ports.IngressBus` on NATS (requests to the dispatchers, jobs, cancel, records)
:mod:`.openai_api`          OpenAI parameters, validation, prompt counting, response bodies
==========================  =========================================================================

Every accepted request ends with a completion or an OpenAI-shaped error, promptly: dispatcher and
agent errors are relayed; a lost node or an interrupted stream moves the request (re-submitted as
``<id>-r<n>``) while nothing reached the client, else ends it with 503; a bus outage longer than
``bus_outage_timeout_s``, a client that left, a timeout or this ingress stopping end it explicitly
(docs/services.md has the full list; :mod:`.lifecycle` the rules).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aiohttp import web

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.contracts.events import Resend
from kairos.contracts.wire import ClusterView
from kairos.core.cluster.heartbeat import Liveness
from kairos.core.engine_model.text import EMULATED_VOCAB_SIZE
from kairos.core.model.latency import load_profile
from kairos.runtime import telemetry
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import connect_service, stream_replicas
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.envconfig import ConfigError
from kairos.runtime.messaging import last_view, publish
from kairos.runtime.resources import BackgroundTasks, Resources
from kairos.runtime.service import run_service
from kairos.runtime.streams import ensure_buckets
from kairos.services.ingress.app import IngressApp
from kairos.services.ingress.completions import Completions
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.flights import Flights, Shutdown
from kairos.services.ingress.http import HardenedRunner, load_api_keys
from kairos.services.ingress.jobrelay import JobRelay
from kairos.services.ingress.liveness import FlightWatch
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.nats_bus import NatsIngressBus
from kairos.services.ingress.openai_api.prompt import load_chat_template, load_tokenizer
from kairos.services.ingress.ports import IngressBus
from kairos.services.ingress.readiness import Readiness, ReadyView
from kairos.services.ingress.relay import RelayDeps
from kairos.services.ingress.tokenize import Tokenization
from kairos.services.node_agent.outbox import RESEND_WINDOW_S

#: how long (s) close() lets background tasks (timing records, tombstones) finish before cancelling them
BACKGROUND_DRAIN_S = 2.0


class Ingress:
    """The ingress service (module docstring).

    Args:
        cfg: its configuration (``KAIROS_*``).
        clock: the clocks of its protocol logic (a test's :class:`kairos.runtime.clock.ManualClock`).

    Construction does no I/O (the model profile and tokenizer files are read); :meth:`start`
    connects to NATS and starts the watchers (:class:`~.liveness.FlightWatch`) and HTTP. A unit test
    serves without NATS: :meth:`assemble` with a fake :class:`~.ports.IngressBus`, :meth:`serve_http`,
    and the watchers' checks called when it advanced its clock (tests/unit/test_ingress_relay.py).
    """

    def __init__(self, cfg: IngressConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg, self.clock = cfg, clock
        self.model = load_profile(cfg.profile)
        self.max_model_len = self.model.engine.max_model_len
        try:
            self.counter, self.vocab_size = (load_tokenizer(cfg.tokenizer_path) if cfg.tokenizer_path
                                             else (None, EMULATED_VOCAB_SIZE))
            self.chat_template = (load_chat_template(os.path.dirname(os.path.abspath(cfg.tokenizer_path)))
                                  if cfg.tokenizer_path else None)
            self.tokenization = Tokenization(cfg.served_model, self.max_model_len, cfg.tokenizer_path,
                                             self.chat_template, cfg.body_timeout_s)
        except ValueError as exc:  # the tokenizer or the chat template beside it cannot be loaded
            raise ConfigError(f"KAIROS_TOKENIZER_PATH: {exc}") from None
        self.tel = telemetry.setup("ingress", cfg.replica_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log
        self.res = Resources(self.log)
        self.res.push("telemetry", self.tel.shutdown)  # closed last
        self.bg = BackgroundTasks(self.log)
        self.m = IngressMetrics(self.tel.registry, model_name=cfg.served_model, engine=cfg.replica_id,
                                max_model_len=self.max_model_len, flights=lambda: self.flights.values())
        self.origin = OriginGuard(forged_counter("ingress", self.tel.registry), self.log)
        self.liveness = Liveness(timeout_ms=cfg.liveness_timeout_s * 1000.0)
        self.members = stream_replicas(cfg)  #: NATS members (1: a single server, nats_bus.UNRESPONSIVE_PONG_S)
        self.api_keys = load_api_keys(cfg.api_keys, cfg.api_key_file)
        self.flights = Flights(self.origin, self.liveness, clock, self.log)
        self.readiness = Readiness(cfg, self._connected, self._ping_dispatchers, self._on_view, clock, self.log)
        self.nc: Any = None
        self.js: Any = None
        self.bus: IngressBus | None = None
        self.watch: FlightWatch | None = None
        self.jobs: JobRelay | None = None
        self.completions: Completions | None = None
        self.port: int | None = None
        self.app: web.Application | None = None  #: the HTTP application, once serving (its routes)
        self._bus_watch: BusWatch | None = None

    @property
    def view(self) -> ClusterView | None:
        """The newest cluster view received."""
        return self.readiness.view

    def assemble(self, bus: IngressBus) -> None:
        """Wire the parts that use the bus: the watchers, the relays' dependencies, the endpoints."""
        self.bus = bus
        self.watch = FlightWatch(self.cfg, self.flights, self.liveness, bus, self.m, self.origin, self.bg,
                                 self.clock, self.log)
        deps = RelayDeps(self.cfg, self.flights, bus, self.m, self.bg, self.clock, self.tel.tracer)
        self.flights.late = self._late_event
        self.jobs = JobRelay(self.flights, bus, self.m, self.bg, self.log)
        self.completions = Completions(deps, self.tel.tracer, self.log, self.counter, self.vocab_size,
                                       self.chat_template, self.max_model_len)

    def _late_event(self, attempt_id: str, ev: Any, fence: bool) -> None:
        """An event of an attempt this ingress gave up (:meth:`Flights._late`): counted as dropped
        ``old_attempt``; with ``fence``, its node is told to stop it (a cancel it missed while paused
        or cut off; issue 33)."""
        self.m.dropped.labels("old_attempt").inc()
        if fence:
            self.log.info("late_attempt_fenced", request_id=attempt_id, node=getattr(ev, "node", None))
            self.bg.spawn(self.bus.cancel(attempt_id, "superseded"), "fence")

    async def start(self) -> None:
        """Connect to NATS, declare the buckets, subscribe, start the watchers and HTTP."""
        nc = self.nc = await connect_service(self.cfg, f"ingress:{self.cfg.replica_id}", self.log)
        self.res.push("nats", lambda: bus_close(nc, graceful=True))
        self.res.push("background_tasks", self._drain_background)
        self.js = nc.jetstream()
        bus = NatsIngressBus(nc, self.members, None, self.cfg.enqueue_timeout_s, self.m, self.clock,
                             self.log, self.cfg.job_ack_timeout_s)
        bus.notices = nc.new_inbox()  # <inbox>.<attempt id>: the dispatchers' alive notices
        self.assemble(bus)
        await self._declare()
        self._bus_watch = bus.watch = BusWatch(nc, self._resume, self._on_bus_lost, log=self.log,
                                               on_connected=self._ask_resend).start()
        self.res.push("bus_watch", self._bus_watch.stop)
        subs = [(S.VIEW_SUBJECT, self.readiness.on_view_msg), (S.STATE_WILDCARD, self.watch.on_state),
                (f"{bus.notices}.*", self.jobs.on_notice)]
        if self.cfg.out_wildcard:  # every token stream, dispatched to its flight by request id
            subs.append((S.OUT_WILDCARD, self.flights.on_out))
        for subject, cb in subs:
            sub = await nc.subscribe(subject, cb=cb)
            self.res.push(f"unsubscribe {subject}", sub.unsubscribe)
        self.res.push_task("flight_watch", asyncio.create_task(self.watch.run()))
        await self.serve_http()

    async def serve_http(self) -> None:
        """Start the HTTP server (after :meth:`assemble`)."""
        assert self.completions is not None and self.bus is not None
        if not self.api_keys:
            self.log.warning("api_open", message="no API key configured (KAIROS_API_KEYS / KAIROS_API_KEY_FILE / "
                                                 "kairos up --api-key): every client may use the API")
        self.app = app = IngressApp(self.cfg, self.completions, self.readiness, self.bus, self.m, self.tel.registry,
                         self.api_keys, self.max_model_len, self.log, self.tokenization).build()
        runner = HardenedRunner(app, access_log=None, header_timeout_s=self.cfg.header_timeout_s,
                                keepalive_timeout=self.cfg.keepalive_timeout_s, on_slow_client=self.m.slow_clients.inc)
        await runner.setup()
        self.res.push("http", runner.cleanup)  # waits for the handlers to send their answers
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = self.completions.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.log.info("ingress_started", host=self.cfg.host, port=self.port, model=self.cfg.served_model,
                      tokenizer=self.cfg.tokenizer_path or "estimate(ceil(bytes/4))", vocab_size=self.vocab_size,
                      chat_template="model" if self.chat_template else "fixed")

    async def close(self) -> None:
        """Stop: every request still in flight ends now with an explicit 503 ``ingress_shutdown``
        (normally none: ``kairos up`` stops dispatchers and agents first, whose errors are relayed),
        then the HTTP server waits for those handlers to send their answers, then the rest closes in
        reverse order of opening."""
        for f in self.flights.values():
            f.shutting_down = True
            f.queue.put_nowait(Shutdown())
        await self.res.aclose()

    async def _drain_background(self) -> None:
        """Let background tasks (timing records, tombstones) finish for :data:`BACKGROUND_DRAIN_S`, then
        cancel what is left (e.g. a tombstone still waiting for the bus: the connection goes now)."""
        await self.bg.drain(BACKGROUND_DRAIN_S)

    # -- the bus connection ------------------------------------------------------------------------
    def _connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def _ping_dispatchers(self) -> str | None:
        return await self.bus.ping_dispatchers() if self.bus is not None else "not started"

    def _on_view(self, view: ReadyView) -> None:
        if self.watch is not None:
            self.watch.on_view(view)

    async def _declare(self) -> None:
        """Declare the buckets and read the view bucket's last view: at start and after every reconnect."""
        buckets = await ensure_buckets(self.js, replicas=stream_replicas(self.cfg))
        assert isinstance(self.bus, NatsIngressBus)
        self.bus.requests = buckets.requests
        self.bg.spawn(last_view(buckets.view, self.readiness.take_view, self.log), "last view")

    async def _ask_resend(self) -> None:
        """Reconnected (BusWatch ``on_connected``, before the re-declare): the server this ingress
        was on may have held token events for it — every node agent publishes again what it sent
        since shortly before the loss (``Resend``; dropped here by token index if already had)."""
        b = self._bus_watch
        if not self.flights or b is None or b.reconnected_at is None:
            return
        window = self.clock.monotonic() - b.reconnected_at + (b.outage_s or 0.0) + RESEND_WINDOW_S
        await publish(self.nc, S.RESEND_SUBJECT, Resend(window_s=window, sent_unix_ms=self.clock.now_ms()))
        self.log.info("resend_requested", window_s=round(window, 3), in_flight=len(self.flights))

    async def _on_bus_lost(self) -> None:
        assert self.watch is not None
        self.watch.on_bus_lost()

    async def _resume(self) -> None:
        """NATS is back: re-declare, then the watchers restart every node's liveness clock and give
        each in-flight request ``outage_grace_s`` to show its stream is still alive."""
        await self._declare()
        assert self.watch is not None
        self.watch.on_bus_back()


async def run(cfg: IngressConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set (what a failed start opened is closed too)."""
    await run_service(Ingress(cfg), stop)
