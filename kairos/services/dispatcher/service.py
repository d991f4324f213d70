"""Dispatcher replica: requests to route in (a core-NATS queue group), one accepted job per request out.

This module is the composition root: it builds one replica from its parts and opens and closes its
connections. Where each concern lives:

* :mod:`~kairos.services.dispatcher.intake` — the queue-group subscription and the handling of each
  request (taken, deadline, cancel, route);
* :mod:`~kairos.services.dispatcher.route` — the routing of one request: decide, send the job,
  re-route on a refusal, retry a bus fault (:mod:`~kairos.services.dispatcher.busretry`); its loop
  state is a :class:`~kairos.services.dispatcher.route.RouteAttempt`;
* :mod:`~kairos.services.dispatcher.jobs` — jobs to the node agents by request-reply;
* :mod:`~kairos.services.dispatcher.outcome` — routing events, decision records, error events;
* :mod:`~kairos.services.dispatcher.state` — what the replica knows of the cluster (view, routed
  events, reservations, cancels, prefix caches), fed by :mod:`~kairos.services.dispatcher.watch`
  (subscriptions, KV watchers, declarations);
* :mod:`~kairos.services.dispatcher.metrics`, :mod:`~kairos.services.dispatcher.faults` (the fault tier's hooks).

The pure rules are :mod:`kairos.core.cluster.routing` and the decision :mod:`kairos.core.policy`.
Start and close go through one :class:`kairos.runtime.resources.Resources`: ``close()`` stops
taking requests, lets the requests being routed finish (``drain``), then unsubscribes, stops the watchers
and closes the connection, the ``/metrics`` server and telemetry — in that order, each failure logged.
"""

from __future__ import annotations

import asyncio

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.core.cluster.prefix_index import PrefixIndex
from kairos.core.model.latency import LatencyModel, load_profile
from kairos.core.policy import parse_policy
from kairos.runtime import telemetry
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.messaging import kv_put_nowait, publish
from kairos.runtime.resources import Resources
from kairos.runtime.service import forward, forward_all, run_service, start_metrics_and_connect
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.jobs import JobLink
from kairos.services.dispatcher.metrics import DispatcherMetrics
from kairos.services.dispatcher.outcome import Outcomes
from kairos.services.dispatcher.intake import RequestIntake
from kairos.services.dispatcher.route import Router
from kairos.services.dispatcher.state import RoutingState
from kairos.services.dispatcher.watch import ClusterWatch

#: a draining close waits this long (s) for the requests being routed (the rest are sent again by their ingress)
DRAIN_TIMEOUT_S = 5.0


class Dispatcher:
    """One dispatcher replica (any number share the requests, as one queue group).

    Args:
        cfg: its configuration (``KAIROS_*``).
        model: the latency model (default: ``cfg.profile``'s); replaced by a hot reload.
        clock: the clocks its routing reads (:data:`kairos.runtime.clock.SYSTEM_CLOCK`).
    """

    def __init__(self, cfg: DispatcherConfig, model: LatencyModel | None = None, *,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg = cfg
        model = model or load_profile(cfg.profile)
        policy = parse_policy(cfg.policy)
        self.tel = telemetry.setup("dispatcher", cfg.replica_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log.bind(replica=cfg.replica_id)
        self.res = Resources(self.log)
        self.res.push("telemetry", self.tel.shutdown)
        self.m = DispatcherMetrics(self.tel.registry)
        self.origin = OriginGuard(forged_counter("dispatcher", self.tel.registry), self.log)
        self.nc = None
        self.metrics_port: int | None = None
        self._runner = None
        self._bus: BusWatch | None = None
        self._stop = asyncio.Event()
        self._drain = True
        params = cfg.params(model.engine.max_num_batched_tokens)
        #: prefix caches of the nodes, fed by their heartbeats' cache events (prefix-aware policies only)
        prefix = PrefixIndex(cfg.prefix_block_tokens) if policy.uses_prefix_caches(params) else None
        self.state = RoutingState(prefix, clock)
        self.outcomes = Outcomes(cfg.replica_id, policy.spec, self.m,
                                 publish=lambda subject, msg: publish(self.nc, subject, msg),
                                 put_record=lambda key, value, if_absent=False: kv_put_nowait(
                                     self.nc, S.REQUESTS_BUCKET, key, value, if_absent=if_absent),
                                 log=self.log, clock=clock)
        self.router = Router(cfg, self.state, JobLink(lambda: self.nc, cfg.job_ack_timeout_s, lambda: self._bus),
                             self.outcomes, self.m, policy, model, clock=clock, stop=self._stop)
        self.watch = ClusterWatch(cfg, self.state, self.origin, lambda: self.router.model,
                                  self.router.use_model, self.log)
        self.intake = RequestIntake(lambda: self.nc, self.router, self.outcomes, self.m, self.tel.tracer,
                                    max_concurrency=cfg.max_concurrency, log=self.log, clock=clock)

    # -- what the replica knows (read by tests and tools) -----------------------------------------------
    # the latency model decisions use now (a hot reload replaces it), the routing policy and its
    # parameters (α, β, τ, TTFT SLO); the newest cluster view heard and the watched deflection
    # reservations by key; the requests this replica routed
    model, policy, params = forward_all("router", "model", "policy", "params")
    view, reservations = forward_all("state", "view", "reservations")
    routed = forward("outcomes.routed", "requests this replica routed")

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, declare, subscribe (the requests to route last). Every step opened is closed by :meth:`close`,
        also after a failed or cancelled start."""
        cfg = self.cfg
        await start_metrics_and_connect(self, f"dispatcher:{cfg.replica_id}", self.res, graceful=lambda: self._drain)
        self.watch.nc = self.nc
        self.res.push("kv watchers", self.watch.close)
        await self.watch.declare()
        # routed jobs of every replica (folded into the view until the aggregator has them) and
        # cancels (requests the ingress already answered must not be routed when dequeued later)
        for sub in await self.watch.subscribe():
            self.res.push(f"subscription {sub.subject}", sub.unsubscribe)
        self.res.push("requests in flight", lambda: self.intake.drain(DRAIN_TIMEOUT_S if self._drain else 0.0))
        sub = await self.nc.subscribe(S.ROUTE_SUBJECT, queue=S.DISPATCHER_QUEUE, cb=self.intake.on_request)
        self.res.push(f"subscription {S.ROUTE_SUBJECT}", sub.unsubscribe)
        self._bus = BusWatch(self.nc, self.watch.declare, log=self.log).start()
        self.res.push("bus watch", self._bus.stop)
        self.log.info("dispatcher_started", policy=self.policy.spec, model=self.model.artifact_version,
                      metrics_port=self.metrics_port)

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; ``drain`` waits for in-flight ones (else their ingress sends them again)."""
        self._drain = drain
        self._stop.set()
        await self.res.aclose()


async def run(cfg: DispatcherConfig, stop: asyncio.Event, model: LatencyModel | None = None) -> None:
    """Run one dispatcher replica until ``stop`` is set."""
    await run_service(Dispatcher(cfg, model), stop)
