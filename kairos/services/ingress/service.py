"""Ingress: OpenAI HTTP in, requests onto the JetStream work queue, token stream back out.

Per request: validate (:mod:`kairos.services.ingress.openai_api`), count prompt tokens, assign the id, route
``kairos.out.<id>.*`` to it *before* publishing (so no token can be missed: one ``kairos.out.*.*``
subscription dispatching by id, or with ``out_wildcard=False`` a subscription per request), publish the
:class:`~kairos.contracts.wire.InferenceRequest` with the W3C trace context in the headers, then relay events.
Streaming responses send their HTTP headers only when the first token arrives, so an error before
it still gets a proper 4xx/5xx status. Every accepted request ends with a completion or an
OpenAI-shaped error, promptly:

* dispatcher/agent errors are relayed;
* **node lost**: the ingress follows where each request is (routing events on
  ``kairos.route.decided``, the node of its tokens, the prefill record's handoff node) and hears
  every node's heartbeats itself (``kairos.state.*``, validated like the aggregator does); when that
  node has been silent — no heartbeat and no token — for ``liveness_timeout_s`` (positive evidence
  of death; routing staleness is not enough, and the aggregator is not needed), a request that has
  sent nothing to the client yet is re-submitted to the dispatchers under a new bus id ``<id>-r<n>``
  (at most ``max_resubmits`` times; the old id is cancelled), otherwise it ends with 503
  ``node_lost`` (SSE error event mid-stream) and a cancel to the nodes;
* **bus outage**: tokens carry their index, so lost ones are noticed (``stream_interrupted``: moved
  or ended like a lost node); a routed request silent for ``outage_grace_s`` after NATS comes back
  is too; NATS unreachable for ``bus_outage_timeout_s`` ends every in-flight request with 503
  ``bus_unavailable``;
* a client that closes its connection (streaming or not) is noticed within ``disconnect_poll_s``:
  cancel to the nodes, recorded as 499 ``client_disconnected`` with the tokens delivered;
* silence past ``idle_timeout_s`` or ``request_timeout_s`` becomes 504 (and a cancel).

The rules of a request's life (which attempt is followed, what moves it, when it may be re-submitted
or must end) are the state machine :class:`kairos.services.ingress.lifecycle.RequestLifecycle`; this module does the
I/O it asks for. Out events are accepted only from the node the attempt's job went to (the
sender is the last token of the subject, proven by the bus; :mod:`kairos.services.ingress.senders`);
any other is refused and counted (``kairos_ingress_forged_messages_total{kind="out_event"}``).
Every HTTP error (including aiohttp's own 404/405/413) is an OpenAI-shaped JSON
body (middleware).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import nats.errors
import nats.js.errors
import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.reorder import Reorder
from kairos.services.node_agent.outbox import RESEND_WINDOW_S
from kairos.services.ingress.senders import Senders
from kairos.services.ingress.http import (HardenedRunner, add_retry_after, api_key_middleware, clip, error_response,
                                   load_api_keys)
from kairos.services.ingress import openai_api as oa
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.runtime.bus import close as bus_close
from kairos.runtime.bus import BusWatch, connect_service, ensure_buckets, kv_put_nowait, publish, stream_replicas
from kairos.runtime.claims import ClaimQuorum, read_holder, withdraw
from kairos.core.engine.text import EMULATED_VOCAB_SIZE
from kairos.core.cluster.heartbeat import REJECT_REASONS, HeartbeatGuard, Liveness, accept_heartbeat
from kairos.runtime.lanes import (LanePicker, check_lane_count, claim_buckets, consumer_infos, declare_each,
                          ensure_claim_buckets, ensure_lane, lane_count)
from kairos.core.model.latency import load_profile
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.engines.vllm.api import unsafe_seed
from kairos.services.ingress.lifecycle import Complete, Fail, Ignore, Phase, Relay, RequestLifecycle, Resubmit
from kairos.core.cluster.prefix_index import request_block_hashes
from kairos.services.ingress.records import request_record
from kairos.core.cluster.routing import routable
from kairos.services.state_aggregator.view import newer
from kairos.contracts.wire import (Cancel, ClusterView, DecisionRecord, DecodeTiming, DoneEvent, ErrorEvent, HandoffEvent,
                         InferenceRequest,
                         IngressTiming, NodeState, OutEvent, PrefillTiming, Resend, RoutedEvent, TokenEvent, WireError, decode,
                         encode, now_ms)

#: Content-Encoding values whose request bodies the ingress reads (aiohttp decodes gzip and deflate)
READABLE_ENCODINGS = frozenset({"identity", "gzip", "deflate"})


#: set on a request once its SSE headers are sent (no error response can replace them any more)
STREAM_STARTED = web.RequestKey("kairos_stream_started", bool)
#: set on a completion request once its id is assigned (error logs name it)
REQUEST_ID = web.RequestKey("kairos_request_id", str)
#: bytes reserved for the NATS headers of a request (traceparent, tracestate, Nats-Msg-Id)
BUS_HEADER_ALLOWANCE = 1024
#: the client/liveness watcher woke this much (s) later than due: this process stalled, and the
#: silence of the nodes over that gap is not evidence (Liveness.stalled)
LOOP_STALL_S = 0.25
#: key of the (decision kind, predicted TTFT ms) pair in a request's timing dict (not part of its record)
PREDICTED = "predicted_ttft"


def bus_request(parsed: oa.ParsedRequest, request_id: str, prompt_tokens: int, exact: bool, created_unix_ms: float,
                deadline_unix_ms: float, block_hashes: list[int] | None = None,
                block_tokens: int = 0) -> InferenceRequest:
    """The :class:`InferenceRequest` the ingress publishes for one attempt of ``parsed``, with the
    prompt's prefix-cache ``block_hashes`` of ``block_tokens`` tokens each (kairos/core/cluster/prefix_index.py)."""
    return InferenceRequest(request_id=request_id, model=parsed.model, prompt_tokens=prompt_tokens,
                            max_tokens=parsed.max_tokens, prompt_tokens_exact=exact, prompt_text=parsed.prompt_text,
                            prompt_token_ids=parsed.prompt_token_ids, created_unix_ms=created_unix_ms,
                            deadline_unix_ms=deadline_unix_ms, sampling=parsed.sampling,
                            max_tokens_explicit=parsed.max_tokens_explicit, block_hashes=block_hashes or [],
                            block_hash_tokens=block_tokens if block_hashes else 0)


class _SseResponse(web.StreamResponse):
    """An SSE response whose status line and headers go out with its first event (one write, not
    two). ``_send_headers_immediately`` is aiohttp's (3.14, web_response.py; ``web.Response`` sets
    it False the same way); without it aiohttp sends the headers at ``prepare()``, which is correct too."""

    _send_headers_immediately = False


def sse_event(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``data: {…}`` and the blank line)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _err(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    return error_response(status, message, code, param)


def _api_err(exc: oa.ApiError) -> web.Response:
    return error_response(exc.status, exc.message, exc.code, exc.param)


#: reasons of ``kairos_ingress_dropped_events_total`` (kairos.services.ingress.lifecycle's drops worth counting)
DROP_REASONS = ("old_attempt", "foreign_node", "duplicate", "routed_elsewhere")
#: with several request lanes, a publish to one waits this long (s) for JetStream's acknowledgement
#: before the next lane is tried (the acknowledgement takes milliseconds while the lane's member lives)
LANE_PUBLISH_TIMEOUT_S = 1.0
#: an enqueue waits this long (s) for a lost connection to come back (a failover to another member
#: of a NATS cluster takes milliseconds); a longer outage answers 503 ``enqueue_failed`` at once
RECONNECT_WAIT_S = 2.0

class _Metrics:
    """The ingress's Prometheus metrics (docs/observability.md has the table)."""

    def __init__(self, reg) -> None:
        T = telemetry
        self.requests = Counter("kairos_ingress_requests_total", "HTTP completion requests by endpoint and status",
                                ("endpoint", "status"), registry=reg)
        self.ttft = Histogram("kairos_ingress_ttft_seconds", "Time to first token as the client sees it",
                              registry=reg, buckets=T.TTFT_BUCKETS)
        self.tbt = Histogram("kairos_ingress_tbt_seconds", "Time between consecutive output tokens (per token)",
                             registry=reg, buckets=T.TBT_BUCKETS)
        self.e2e = Histogram("kairos_ingress_request_duration_seconds", "Request received to last token sent",
                             registry=reg, buckets=T.E2E_BUCKETS)
        self.inflight = Gauge("kairos_ingress_requests_in_flight", "Completion requests being served",
                              registry=reg)
        self.ttft_pred = Histogram("kairos_ingress_ttft_predicted_seconds",
                                   "The decision's TTFT estimate for the path taken (keep: Eq. 1 TTFT_pf; "
                                   "deflect: Eq. 6 TTFT_dec of the chosen node)", ("decision",), registry=reg,
                                   buckets=T.TTFT_BUCKETS)
        self.ttft_meas = Histogram("kairos_ingress_ttft_measured_seconds",
                                   "Measured TTFT of requests whose decision carried an estimate", ("decision",),
                                   registry=reg, buckets=T.TTFT_BUCKETS)
        self.ttft_err = Histogram("kairos_ingress_ttft_prediction_error_seconds",
                                  "Measured minus predicted TTFT (signed)", ("decision",), registry=reg,
                                  buckets=T.ERROR_SECONDS_BUCKETS)
        self.node_lost = Counter("kairos_ingress_node_lost_total",
                                 "In-flight requests whose node went stale or left the view, by outcome "
                                 "(resubmitted to the dispatchers, or failed with 503 node_lost)", ("outcome",),
                                 registry=reg)
        self.disconnects = Counter("kairos_ingress_client_disconnects_total",
                                   "Requests whose client closed the connection before the end (499)",
                                   ("endpoint", "stream"), registry=reg)
        self.interrupted = Counter("kairos_ingress_stream_interrupted_total",
                                   "In-flight requests whose token stream lost events (a bus outage), by outcome",
                                   ("outcome",), registry=reg)
        self.dropped = Counter("kairos_ingress_dropped_events_total",
                               "Out events not relayed, by reason (old_attempt, foreign_node: tokens of another "
                               "execution; duplicate; routed_elsewhere: a dispatcher's error for a copy of an "
                               "attempt a node had accepted)", ("reason",), registry=reg)
        self.hb_rejected = Counter("kairos_ingress_heartbeats_rejected_total",
                                   "Heartbeats refused by the liveness tracker, by reason", ("reason",), registry=reg)
        self.bus_down = Counter("kairos_ingress_bus_unavailable_total",
                                "Requests ended because NATS stayed unreachable", registry=reg)
        self.shed = Counter("kairos_ingress_overload_shed_total",
                            "Requests refused with 429 overloaded (max_in_flight reached)", registry=reg)
        self.enqueue_retries = Counter("kairos_ingress_enqueue_retries_total",
                                       "Enqueues re-sent because JetStream gave no acknowledgement", registry=reg)
        self.lane_moves = Counter("kairos_ingress_lane_moves_total",
                                  "Queued requests enqueued again on another request lane (theirs stalled: its "
                                  "NATS member died)", registry=reg)
        for outcome in ("resubmitted", "failed"):
            self.node_lost.labels(outcome)
            self.interrupted.labels(outcome)
        for r in DROP_REASONS:
            self.dropped.labels(r)
        for r in REJECT_REASONS:
            self.hb_rejected.labels(r)
        self.auth_failures = Counter("kairos_ingress_auth_failures_total",
                                     "Requests refused with 401 (API key missing or invalid)", ("reason",),
                                     registry=reg)
        self.slow_clients = Counter("kairos_ingress_slow_clients_dropped_total",
                                    "Connections closed because their request head did not arrive within "
                                    "header_timeout_s", registry=reg)


@dataclass
class _NodeLost:
    """Queue item: a node the request depends on is dead (liveness timeout)."""

    node: str
    attempt_id: str


@dataclass
class _Interrupted:
    """Queue item: the attempt's stream lost events (silent after a bus outage)."""

    attempt_id: str
    detail: str


@dataclass
class _BusDown:
    """Queue item: NATS has been unreachable for ``outage_s``."""

    outage_s: float


class _ClientGone:
    """Queue item: the HTTP client closed its connection."""


class _Shutdown:
    """Queue item: this ingress is stopping; end the request with an explicit error now."""


@dataclass
class _Flight:
    """One in-flight request: its lifecycle (:mod:`kairos.services.ingress.lifecycle`, where it is and what it may
    do) plus the I/O bits (keyed in ``Ingress._flights`` by its current bus id)."""

    lc: RequestLifecycle
    queue: asyncio.Queue
    request: web.Request
    lost: bool = False  #: a _NodeLost/_Interrupted was queued for the current attempt
    client_gone: bool = False
    bus_down: bool = False  #: a _BusDown was queued
    checking: bool = False  #: a prefill-record / claim lookup is running
    quiet_deadline: float | None = None  #: monotonic s: after a reconnect, an event must arrive by then
    #: node -> its incarnation when this request first depended on it (a newer one = restarted, lost)
    dep_epochs: dict[str, float] = field(default_factory=dict)
    #: (decision kind, its TTFT estimate in ms) from the routing event of the current attempt
    predicted: tuple[str, float] | None = None
    #: whose out events the current attempt accepts (the node its job went to, ...)
    senders: Senders = field(default_factory=lambda: Senders(""))
    #: the request lane the current attempt was last enqueued on (kairos/runtime/lanes.py), when, what was
    #: published (attempt id, bytes, headers: a stalled lane's requests are enqueued again elsewhere,
    #: the same bytes and bus id), and every lane holding a copy of it (none is used twice)
    lane: int | None = None
    enqueued_at: float = 0.0
    enqueued: tuple[str, bytes, dict[str, str]] | None = None
    lanes_used: set[int] = field(default_factory=set)
    moving: bool = False

    @property
    def attempt_id(self) -> str:
        return self.lc.attempt_id


class Ingress:
    def __init__(self, cfg: IngressConfig) -> None:
        self.cfg = cfg
        self.model = load_profile(cfg.profile)
        self.max_model_len = self.model.engine.max_model_len
        self.counter, self.vocab_size = (oa.load_tokenizer(cfg.tokenizer_path) if cfg.tokenizer_path
                                         else (None, EMULATED_VOCAB_SIZE))
        self.chat_template = (oa.load_chat_template(os.path.dirname(os.path.abspath(cfg.tokenizer_path)))
                              if cfg.tokenizer_path else None)
        self.tel = telemetry.setup("ingress", cfg.replica_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log
        self.m = _Metrics(self.tel.registry)
        self._admitted = 0  #: completion requests admitted and not finished (cfg.max_in_flight)
        self.origin = OriginGuard(forged_counter("ingress", self.tel.registry), self.log)
        self.port: int | None = None
        self.nc = None
        self._runner = None
        self._tasks: set[asyncio.Task] = set()
        self.view: ClusterView | None = None
        self._view_rx: float | None = None  # time.monotonic() when the last view arrived
        self._view_task: asyncio.Task | None = None
        self._roles: dict[str, str] = {}
        self.guard = HeartbeatGuard(max_future_ms=cfg.heartbeat_max_future_ms)
        self.liveness = Liveness(timeout_ms=cfg.liveness_timeout_s * 1000.0)
        self.dead_nodes: set[str] = set()  #: nodes silent past the liveness timeout
        self._bus: BusWatch | None = None
        self._flights: dict[str, _Flight] = {}
        self._subs: list = []
        self._poll_task: asyncio.Task | None = None
        self._disp: dict | None = None  # cached dispatcher-consumer check
        self._disp_at = 0.0
        self._disp_lock = asyncio.Lock()
        self.lanes = LanePicker(lane_count(cfg))  #: request lanes, one per NATS member (kairos/runtime/lanes.py)
        self.claims: ClaimQuorum | None = None
        self.api_keys = load_api_keys(cfg.api_keys, cfg.api_key_file)

    def app(self) -> web.Application:
        middlewares = [self._errors]
        if self.api_keys:
            middlewares.append(api_key_middleware(self.api_keys, self._rejected))
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=middlewares)
        app.on_response_prepare.append(add_retry_after)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/requests/{rid}", self.request_info)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        self.nc = await connect_service(self.cfg, f"ingress:{self.cfg.replica_id}", self.log)
        self.js = self.nc.jetstream()
        self.claims = ClaimQuorum(claim_buckets(self.js, self.lanes.lanes))
        await check_lane_count(self.nc.jetstream(timeout=2.0), self.lanes.lanes)
        self._view_watcher = None
        await self._declare()
        self._bus = BusWatch(self.nc, self._resume, self._on_bus_lost, log=self.log,
                             on_connected=self._ask_resend).start()
        self._subs.append(await self.nc.subscribe(S.ROUTED_SUBJECT, cb=self._on_routed))
        self._subs.append(await self.nc.subscribe(S.VIEW_SUBJECT, cb=self._on_view_msg))
        self._subs.append(await self.nc.subscribe(S.STATE_WILDCARD, cb=self._on_state))
        if self.cfg.out_wildcard:  # every token stream, dispatched to its flight by request id
            self._subs.append(await self.nc.subscribe(S.OUT_WILDCARD, cb=self._on_out))
        self._poll_task = asyncio.create_task(self._watch_clients())
        if not self.api_keys:
            self.log.warning("api_open", message="no API key configured (KAIROS_API_KEYS / KAIROS_API_KEY_FILE / "
                                                 "kairos up --api-key): every client may use the API")
        self._runner = HardenedRunner(self.app(), access_log=None, header_timeout_s=self.cfg.header_timeout_s,
                                      keepalive_timeout=self.cfg.keepalive_timeout_s,
                                      on_slow_client=self.m.slow_clients.inc)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.log.info("ingress_started", host=self.cfg.host, port=self.port, model=self.cfg.served_model,
                      tokenizer=self.cfg.tokenizer_path or "estimate(ceil(bytes/4))", vocab_size=self.vocab_size,
                      chat_template="model" if self.chat_template else "fixed")

    async def _declare(self) -> None:
        """Declare the request lanes (requests wait there for a dispatcher), the claim buckets and
        the other buckets, and (re)start the view watcher: at start and after every reconnect. A
        lane whose member is down is logged and left to the dispatchers to declare again."""
        n = self.lanes.lanes
        await declare_each("request_lane", n, lambda i: ensure_lane(self.js, i, n), self.log)
        await ensure_claim_buckets(self.js, n, self.log)
        self.buckets = await ensure_buckets(self.js, replicas=stream_replicas(self.cfg))
        old_w, old_t = self._view_watcher, self._view_task
        self._view_watcher = await self.buckets.view.watch(S.VIEW_KEY)
        self._view_task = asyncio.create_task(self._watch_view(self._view_watcher))
        if old_t is not None:
            old_t.cancel()
        if old_w is not None:
            try:
                await old_w.stop()
            except Exception:
                pass

    async def _ask_resend(self) -> None:
        """Reconnected (BusWatch ``on_connected``, before the re-declare): the server this ingress
        was on may have held token events for it — every node agent publishes again what it sent
        since shortly before the loss (``Resend``; dropped here by token index if already had)."""
        b = self._bus
        if not self._flights or b is None or b.reconnected_at is None:
            return
        window = time.monotonic() - b.reconnected_at + (b.outage_s or 0.0) + RESEND_WINDOW_S
        await publish(self.nc, S.RESEND_SUBJECT, Resend(window_s=window, sent_unix_ms=now_ms()))
        self.log.info("resend_requested", window_s=round(window, 3), in_flight=len(self._flights))

    async def _on_bus_lost(self) -> None:
        self.liveness.pause()  # we hear nobody now; that is not the nodes' fault
        self.log.warning("bus_lost", in_flight=len(self._flights))

    async def _resume(self) -> None:
        """NATS is back: re-declare, restart every node's liveness clock, and give each in-flight
        request ``outage_grace_s`` to show its stream is still alive."""
        await self._declare()
        self.liveness.resume(time.monotonic() * 1000.0)
        grace = time.monotonic() + self.cfg.outage_grace_s
        for f in self._flights.values():
            f.quiet_deadline = grace

    async def close(self) -> None:
        """Stop: every request still in flight ends now with an explicit 503 ``ingress_shutdown``
        (normally none: ``kairos up`` stops dispatchers and agents first, whose errors are relayed),
        then the HTTP server waits for those handlers to send their answers."""
        for f in list(self._flights.values()):
            f.queue.put_nowait(_Shutdown())
        if self._bus is not None:
            await self._bus.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._view_task is not None:
            self._view_task.cancel()
            try:
                await self._view_watcher.stop()
            except Exception:
                pass
        if self._poll_task is not None:
            self._poll_task.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
            for t in list(self._tasks):  # e.g. a tombstone still waiting for the bus: the connection goes now
                t.cancel()
        await bus_close(self.nc, graceful=True)
        self.tel.shutdown()

    def _bg(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- errors ---------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error response is OpenAI-shaped JSON, aiohttp's own 404/405/413 included. A body
        declared larger than the limit (``Content-Length``, not encoded) is refused with 413 before it
        is read, instead of waiting for bytes that may never come."""
        declared = request.content_length
        if declared is not None and declared > self.cfg.max_body_bytes and \
                request.headers.get("Content-Encoding", "identity").lower() in ("", "identity"):
            out = self._http_error(request, web.HTTPRequestEntityTooLarge(self.cfg.max_body_bytes, declared))
            endpoint = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(request.path)
            if endpoint is not None and request.method == "POST":  # counted as the handler counts its own 413
                self.m.requests.labels(endpoint, "413").inc()
            out.force_close()  # the body is never read: the connection cannot be reused
            return out
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._http_error(request, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if request.get(STREAM_STARTED):
                raise  # headers are out; nothing better to send
            error_id = "err-" + uuid.uuid4().hex[:16]  # the body names no exception; the log has it
            self.log.error("unhandled_error", path=request.path, method=request.method, error=repr(exc),
                           error_id=error_id, request_id=request.get(REQUEST_ID), exc_info=exc)
            return _err(500, f"internal error in the ingress (error id {error_id})", "internal_error")

    def _rejected(self, request: web.Request, reason: str) -> None:
        self.m.auth_failures.labels(reason).inc()
        self.log.info("api_key_rejected", reason=reason, path=request.path, client=request.remote)

    def _http_error(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        status = exc.status
        if isinstance(exc, web.HTTPNotFound):
            msg, code = (f"Unknown path {clip(request.path, 200)!r}. Endpoints: POST /v1/completions, POST /v1/chat/completions, "
                         f"GET /v1/models, GET /v1/requests/{{id}}, GET /health, GET /metrics"), "not_found"
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            msg = (f"Method {request.method} is not allowed for {request.path}; use "
                   f"{' or '.join(sorted(exc.allowed_methods))}")
            code = "method_not_allowed"
        elif isinstance(exc, web.HTTPRequestEntityTooLarge):
            # a compressed body is limited after decompression: its Content-Length is not the size that counted
            encoded = request.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
            got = (f" (got more than that after decoding the {clip(request.headers['Content-Encoding'], 20)} "
                   f"body of {request.content_length} bytes)" if encoded and request.content_length
                   else f" (got {request.content_length})" if request.content_length else "")
            msg, code = (f"request body is too large: the limit is {self.cfg.max_body_bytes} bytes{got}",
                         "request_too_large")
        else:
            msg, code = exc.text or exc.reason, exc.reason.lower().replace(" ", "_")
        out = _err(status, msg, code)
        for h in ("Allow", "Retry-After"):
            if h in exc.headers:
                out.headers[h] = exc.headers[h]
        return out

    # -- simple endpoints ---------------------------------------------------------------------
    async def health(self, _req: web.Request) -> web.Response:
        """Readiness (docs/services.md): 200 only when everything a request needs is there —
        NATS connected, a fresh cluster view (the aggregator is alive) with at least one routable
        prefill and decode node, and a dispatcher consuming the request stream; otherwise 503 with
        every reason listed."""
        connected = self.nc is not None and self.nc.is_connected
        reasons: list[dict[str, str]] = []
        if not connected:
            reasons.append({"code": "nats_disconnected", "message": "the ingress is not connected to NATS"})
        view_age = None if self._view_rx is None else round((time.monotonic() - self._view_rx) * 1000.0, 1)
        limit = self._view_stale_after_ms()
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
        disp = await self._dispatcher_check() if connected else {"consuming": False, "detail": "not connected"}
        if connected and not disp["consuming"]:
            reasons.append({"code": "no_dispatcher",
                            "message": f"no dispatcher is consuming the request stream ({disp['detail']})"})
        status = reasons[0]["code"] if reasons else "ok"
        return _json({"status": status, "reasons": reasons,
                      "routable": {"prefill": [n.node for n in pfs], "decode": [n.node for n in dcs]},
                      "view_age_ms": view_age, "dispatchers": disp}, 503 if reasons else 200)

    def _view_stale_after_ms(self) -> float:
        if self.cfg.view_stale_after_ms > 0:
            return self.cfg.view_stale_after_ms
        return self.view.stale_after_ms if self.view is not None else 0.0

    async def _dispatcher_check(self) -> dict:
        """Is some dispatcher consuming the work queue? Cached ``dispatcher_check_interval_s``.

        Rule: the shared consumer has a pull request waiting (``num_waiting`` > 0; an idle
        dispatcher always has one outstanding) or delivered a message within
        ``dispatcher_active_window_s`` (a busy one). A zero ``num_waiting`` is re-read once after
        100 ms, as a dispatcher renews its pull request every second.
        """
        if self._disp is not None and time.monotonic() - self._disp_at < self.cfg.dispatcher_check_interval_s:
            return self._disp
        async with self._disp_lock:
            if self._disp is not None and time.monotonic() - self._disp_at < self.cfg.dispatcher_check_interval_s:
                return self._disp
            out = await self._consumer_state()
            if not out["consuming"] and out.get("num_waiting") == 0:
                await asyncio.sleep(0.1)
                out = await self._consumer_state()
            self._disp, self._disp_at = out, time.monotonic()
            return out

    async def _consumer_state(self) -> dict:
        """The dispatchers' consumers on every request lane, read at once; a lane that does not
        answer (its member is down) is left out while another answers."""
        infos = await consumer_infos(self.js, self.lanes.lanes, 1.0)
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
        consuming = waiting > 0 or (since is not None and since <= self.cfg.dispatcher_active_window_s)
        detail = ("ok" if consuming else
                  f"no pull request waiting and no delivery in the last {self.cfg.dispatcher_active_window_s:g} s")
        return {"consuming": consuming, "detail": detail, "num_waiting": waiting, "last_delivery_s_ago": since,
                "num_pending": sum(i.num_pending or 0 for i in ok),
                "num_ack_pending": sum(i.num_ack_pending or 0 for i in ok), "lanes_answering": len(ok)}

    async def _watch_view(self, watcher) -> None:
        async for e in watcher:
            if e is None or not e.value or e.operation is not None:
                continue
            self._take_view(e.value)

    async def _on_view_msg(self, msg) -> None:
        """A view as the aggregator built it (core NATS, ``kairos.view``): the bucket's watch may lag
        seconds behind while a NATS cluster elects the bucket's leader (/health would say
        ``cluster_view_stale`` meanwhile)."""
        self._take_view(msg.data)

    def _take_view(self, data: bytes) -> None:
        try:
            view = decode(data, ClusterView)
        except WireError:
            return
        if not newer(view, self.view):  # each view comes twice (subject and bucket)
            return
        self.view, self._view_rx = view, time.monotonic()
        try:
            self._on_view(view)
        except Exception as exc:  # never let the watcher die
            self.log.error("view_check_failed", error=repr(exc))

    # -- where requests are, and nodes that die under them --------------------------------------
    def _on_view(self, view: ClusterView) -> None:
        """The view is for routing and /health only: a stale node or one missing from the view
        (e.g. a restarted aggregator's first views) is *not* dead for in-flight requests."""
        self._roles.update((n.node, n.role) for n in view.nodes)

    async def _on_state(self, msg) -> None:
        """A heartbeat: validated (epoch/seq/future, like the aggregator), then it is a sign of life."""
        try:
            st = decode(msg.data, NodeState)
        except WireError:
            return
        if not self.origin.check(msg, "heartbeat", S.subject_node(msg.subject, S.state_subject), st.node):
            return  # another node's heartbeat could declare it restarted or alive (kairos/contracts/origin.py)
        why = accept_heartbeat(self.guard, self.liveness, st, now_ms(), time.monotonic() * 1000.0)
        if why is not None:  # refused: no sign of life (kairos/core/cluster/heartbeat.py accept_heartbeat)
            self.m.hb_rejected.labels(why).inc()
            return
        self._roles[st.node] = st.role

    async def _on_out(self, msg) -> None:
        """An out event (``kairos.out.<attempt id>.<sender>``): to the queue of the request whose
        current attempt it belongs to, if its sender is accepted (:class:`Senders`); events of
        finished or superseded attempts are dropped here."""
        where = S.out_origin(msg.subject)
        f = self._flights.get(where[0]) if where is not None else None
        if f is None:
            return
        try:
            ev = decode(msg.data, OutEvent)  # type: ignore[arg-type]
        except WireError as exc:
            self.log.warning("bad_out_event", subject=msg.subject, error=str(exc))
            return
        if not self.origin.check(msg, "out_event", where[1], None, request_id=where[0]):
            return  # a JetStream delivery (kairos/contracts/origin.py)
        why = f.senders.judge(msg.subject, where[1], ev)
        if why == "held":
            return
        if why is not None:
            self._refuse_out(msg.subject, why, where[1], ev)
            return
        self._deliver(f, ev)
        if isinstance(ev, HandoffEvent):
            self._release(f)
        elif isinstance(ev, TokenEvent):  # it streams from its node: nothing held can be accepted any more
            self._refuse_held(f)

    def _deliver(self, f: _Flight, ev: OutEvent) -> None:
        if isinstance(ev, HandoffEvent):  # who may send tokens (Senders), nothing for the client
            return
        if isinstance(ev, TokenEvent):  # a token is a sign of life of its node
            self.liveness.heard(ev.node, time.monotonic() * 1000.0)
        if ev.request_id == f.attempt_id:
            f.quiet_deadline = None
        f.queue.put_nowait(ev)

    def _release(self, f: _Flight) -> None:
        """Deliver the held events whose sender is accepted now (a routing or handoff event came)."""
        ok, refused = f.senders.release()
        for h, why in refused:
            self._refuse_out(h.subject, why, h.node, h.event)
        for ev in ok:
            self._deliver(f, ev)

    def _refuse_held(self, f: _Flight) -> None:
        for h in f.senders.refuse_held():
            self._refuse_out(h.subject, "not_the_jobs_node", h.node, h.event)

    def _refuse_out(self, subject: str, why: str, sender: str | None, ev: OutEvent) -> None:
        claimed = ev.source if isinstance(ev, ErrorEvent) else ev.node
        self.origin.refuse(subject, "out_event", why, sender, claimed, request_id=ev.request_id,
                           event_type=type(ev).__name__)

    async def _on_routed(self, msg) -> None:
        try:
            ev = decode(msg.data, RoutedEvent)
        except WireError:
            return
        f = self._flights.get(ev.request_id)
        if f is None:
            return
        f.lc.on_routed(ev.request_id, ev.kind, ev.node)
        lane = ev.lane if ev.lane is not None and 0 <= ev.lane < self.lanes.lanes else f.lane
        if lane is not None:  # the lane the routed copy came from delivers (not the one it may have moved to)
            self.lanes.delivered(lane)
        if ev.request_id == f.attempt_id:
            f.predicted = (None if ev.predicted_ttft_ms is None
                           else (ev.kind, ev.predicted_ttft_ms))
            f.senders.routed(ev.node, ev.kind)  # only dispatchers may publish routing events
            self._release(f)
        self.liveness.watch(ev.node, time.monotonic() * 1000.0)

    def _check_liveness(self) -> None:
        """Every ``disconnect_poll_s``: queue a _NodeLost for each request whose node is dead.
        Keep path before the first token: the prefill node's death, or any decode node's, is first
        checked against the prefill record (was the KV handed off, and to whom?) — the decision's
        decode node alone does not count, the prefill agent tries the other candidates."""
        mono = time.monotonic() * 1000.0
        dead = self.liveness.dead_nodes(mono)
        newly = dead - self.dead_nodes
        if newly:
            self.log.warning("nodes_lost", nodes=sorted(newly), in_flight=len(self._flights),
                             liveness_timeout_s=self.cfg.liveness_timeout_s)
        self.dead_nodes = dead
        decode_died = any(self._roles.get(n) == "decode" for n in newly)
        for f in list(self._flights.values()):
            lc = f.lc
            if f.lost or f.client_gone or lc.ended:
                continue
            if lc.phase is Phase.ROUTED and lc.kind == "keep" and lc.handoff_node is None:
                if (lc.node in dead or decode_died or self._restarted(f, lc.node)) and not f.checking:
                    f.checking = True
                    self._bg(self._check_handoff(f, f.attempt_id))
                continue
            node = lc.depends_on()
            if node is not None and (node in dead or self._restarted(f, node)):
                self._lost(f, node)

    def _restarted(self, f: _Flight, node: str) -> bool:
        """``node`` has a newer incarnation than when ``f`` started depending on it: the agent
        restarted (within the liveness timeout) and lost the request."""
        epoch = self.liveness.epoch(node)
        if epoch is None:
            return False
        return f.dep_epochs.setdefault(node, epoch) != epoch

    async def _check_handoff(self, f: _Flight, attempt_id: str) -> None:
        try:
            try:  # the record of the prefill node the routing event named (only it can write that key)
                prefill_node = f.lc.node
                e = await self.buckets.requests.get(S.record_key(attempt_id, "prefill", prefill_node)) \
                    if prefill_node else None
                rec = decode(e.value, PrefillTiming) if e is not None and e.value else None
            except (nats.js.errors.KeyNotFoundError, WireError):
                rec = None
            except Exception as exc:
                self.log.warning("prefill_record_read_failed", request_id=attempt_id, error=repr(exc))
                rec = None
        finally:
            f.checking = False
        lc = f.lc
        if lc.attempt_id != attempt_id or f.lost or f.client_gone or lc.phase is not Phase.ROUTED:
            return
        if rec is not None and rec.handoff_node:
            lc.on_handoff(attempt_id, rec.handoff_node)
        node = lc.depends_on()
        if node is not None and (node in self.dead_nodes or self._restarted(f, node)):
            self._lost(f, node)

    def _lost(self, f: _Flight, node: str) -> None:
        f.lost = True
        f.queue.put_nowait(_NodeLost(node=node, attempt_id=f.attempt_id))

    def _check_quiet(self) -> None:
        """After a reconnect: a request that heard nothing within ``outage_grace_s`` lost its
        stream if it was routed (known, or its execution claim exists); a request still on the
        work queue (file-backed, it survived) keeps waiting."""
        now = time.monotonic()
        for f in list(self._flights.values()):
            if f.quiet_deadline is None or now < f.quiet_deadline or f.lost or f.client_gone or f.lc.ended:
                continue
            f.quiet_deadline = None
            if f.lc.phase is not Phase.QUEUED:
                f.lost = True
                f.queue.put_nowait(_Interrupted(f.attempt_id, f"no event for {self.cfg.outage_grace_s:g} s after "
                                                              f"the bus came back"))
            elif not f.checking:
                f.checking = True
                self._bg(self._check_claim(f, f.attempt_id))

    def _check_lanes(self) -> None:
        """Queued requests whose lane stalled (its member died: :meth:`LanePicker.stalled`) are
        enqueued again on another lane (:meth:`_move`)."""
        now = time.monotonic()
        for f in list(self._flights.values()):
            if (f.lane is not None and not f.moving and f.enqueued is not None and f.enqueued[0] == f.attempt_id
                    and f.lc.phase is Phase.QUEUED and not (f.lost or f.client_gone or f.lc.ended)
                    and len(f.lanes_used) < self.lanes.lanes and self.lanes.stalled(f.lane, f.enqueued_at, now)):
                f.moving = True
                self._bg(self._move(f, f.attempt_id))

    async def _move(self, f: _Flight, attempt_id: str) -> None:
        """Publish attempt ``attempt_id`` again on another lane, the same bytes and bus id: the
        first copy a dispatcher routes runs, the other meets its claim (``claimed``) and is
        only acknowledged. Never raises; a lane that fails too is tried again on the next check."""
        assert f.enqueued is not None and f.lane is not None
        _, body, headers = f.enqueued
        try:
            for lane in self.lanes.others(f.lane):
                if lane in f.lanes_used:
                    continue
                if f.attempt_id != attempt_id or f.lc.phase is not Phase.QUEUED:
                    return
                try:
                    await self.js.publish(S.request_subject(lane), body, headers=headers,
                                          stream=S.request_stream(lane), timeout=LANE_PUBLISH_TIMEOUT_S)
                except Exception:
                    self.lanes.down(lane)
                    continue
                if f.attempt_id != attempt_id:  # re-submitted meanwhile: its own lane stays
                    return
                self.log.info("request_moved_lane", request_id=attempt_id, from_lane=f.lane, to_lane=lane)
                self.m.lane_moves.inc()
                f.lane = lane
                f.lanes_used.add(lane)
                return
        finally:
            if f.attempt_id == attempt_id:
                f.enqueued_at = time.monotonic()
            f.moving = False

    async def _check_claim(self, f: _Flight, attempt_id: str) -> None:
        try:
            claim = await read_holder(self.claims, attempt_id) if self.claims is not None else None
        finally:
            f.checking = False
        if claim is None or f.attempt_id != attempt_id or f.lost or f.client_gone or f.lc.ended:
            return
        f.lc.on_routed(attempt_id, claim.kind, claim.node)
        f.lost = True
        f.queue.put_nowait(_Interrupted(attempt_id, f"node {claim.node} took it and nothing arrived for "
                                                    f"{self.cfg.outage_grace_s:g} s after the bus came back"))

    async def _watch_clients(self) -> None:
        """Every ``disconnect_poll_s``: clients that closed their connection (aiohttp does not
        cancel the handler), dead nodes, streams silent after a reconnect, a bus down too long."""
        due = time.monotonic() + self.cfg.disconnect_poll_s
        while True:
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            late_s = time.monotonic() - due
            due = time.monotonic() + self.cfg.disconnect_poll_s
            if late_s > LOOP_STALL_S:  # this process did not run: the nodes were not silent, we were deaf
                self.liveness.stalled(late_s * 1000.0)
                self.log.warning("ingress_loop_stalled", stalled_s=round(late_s, 3))
            for f in list(self._flights.values()):
                t = f.request.transport
                if not f.client_gone and (t is None or t.is_closing()):
                    f.client_gone = True
                    f.queue.put_nowait(_ClientGone())
            try:
                self._check_liveness()
                self._check_quiet()
                self._check_lanes()
                since = self._bus.disconnected_since if self._bus is not None else None
                if since is not None and time.monotonic() - since > self.cfg.bus_outage_timeout_s:
                    for f in list(self._flights.values()):
                        if not f.bus_down:
                            f.bus_down = True
                            f.queue.put_nowait(_BusDown(time.monotonic() - since))
            except Exception as exc:  # never let the watcher die
                self.log.error("flight_check_failed", error=repr(exc))

    async def models(self, _req: web.Request) -> web.Response:
        return _json(oa.models_response([self.cfg.served_model], self.max_model_len))

    async def metrics(self, _req: web.Request) -> web.Response:
        body, ctype = telemetry.metrics_body(self.tel.registry)
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def request_info(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        try:
            S.check_token(rid, "request id")
        except ValueError as exc:
            return _err(400, str(exc), "invalid_request_id")
        parts: dict = {}

        async def get(key: str, typ):
            try:
                e = await self.buckets.requests.get(key)
                return decode(e.value, typ) if e.value else None
            except (nats.js.errors.KeyNotFoundError, WireError):
                return None

        parts["ingress"] = await get(S.record_key(rid, "ingress"), IngressTiming)
        # re-submitted after a node was lost: the routing/node records of the attempt that served it
        served_by = parts["ingress"].resubmitted_as[-1] if parts["ingress"] and parts["ingress"].resubmitted_as else rid
        parts["decision"] = await get(S.record_key(served_by, "decision"), DecisionRecord)
        # the node records of the nodes that ran it (each node writes only keys with its own id):
        # the claim names the executing node, else the decision does
        claim = await read_holder(self.claims, served_by) if self.claims is not None else None
        d = parts["decision"]
        node = claim.node if claim is not None else (d.node if d is not None else "")
        keep = claim.kind == "keep" if claim is not None else (d is not None and not d.decision.deflected)
        parts["prefill"] = await get(S.record_key(served_by, "prefill", node), PrefillTiming) if node and keep else None
        dec_node = ((parts["prefill"].handoff_node if parts["prefill"] else None)
                    or (claim.decode_node if claim is not None else (d.decode_node if d is not None else "")))
        dec_node = dec_node if keep else node
        parts["decode"] = await get(S.record_key(served_by, "decode", dec_node), DecodeTiming) if dec_node else None
        if all(v is None for v in parts.values()):
            return _err(404, f"no record of request {rid!r} (unknown, or older than the record TTL)", "not_found")
        return _json(request_record(rid, parts["decision"], parts["prefill"], parts["decode"], parts["ingress"]))

    # -- completions ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def _complete(self, request: web.Request, endpoint: oa.Endpoint) -> web.StreamResponse:
        """Admission, then :meth:`_serve`: with ``cfg.max_in_flight`` requests already in flight
        at this replica (streams count until their last chunk), answer 429 ``overloaded`` with
        ``Retry-After`` at once, before reading the body — overload is shed here, explicitly, so
        what is admitted keeps being served (issue 17: without it the bus's 2 s publish timeout
        turned overload into 503 ``enqueue_failed`` for nearly everyone)."""
        limit = self.cfg.max_in_flight
        if limit and self._admitted >= limit:
            self.m.requests.labels(endpoint, "429").inc()
            self.m.shed.inc()
            after = self.cfg.overload_retry_after_s
            return error_response(429, f"the server is overloaded ({limit} requests in flight at this ingress); "
                                       f"retry after {after} s", "overloaded", headers={"Retry-After": str(after)})
        self._admitted += 1
        try:
            return await self._serve(request, endpoint)
        finally:
            self._admitted -= 1

    async def _serve(self, request: web.Request, endpoint: oa.Endpoint) -> web.StreamResponse:
        received = now_ms()
        encodings = request.headers.getall("Content-Encoding", [])
        if any(e.strip().lower() not in READABLE_ENCODINGS for e in encodings) or len(encodings) > 1:
            # aiohttp decodes exactly one gzip or deflate; anything else would be read as it is
            self.m.requests.labels(endpoint, "415").inc()
            out = _err(415, f"unsupported Content-Encoding {clip(', '.join(encodings), 60)!r}: the ingress reads "
                            "request bodies sent as identity, gzip or deflate (one encoding)",
                       "unsupported_content_encoding")
            out.force_close()  # the body is unread
            return out
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):  # no task per request (wait_for makes one)
                raw = await request.read()
            body = orjson.loads(raw)
        except web.HTTPRequestEntityTooLarge as exc:
            self.m.requests.labels(endpoint, "413").inc()
            return self._http_error(request, exc)
        except asyncio.TimeoutError:
            self.m.requests.labels(endpoint, "408").inc()
            out = _err(408, f"the request body was not received within {self.cfg.body_timeout_s:g} s",
                       "request_timeout")
            out.force_close()
            return out
        except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip on a body that is not gzip
            self.m.requests.labels(endpoint, "400").inc()
            enc = clip(request.headers.get("Content-Encoding", "identity"), 20)
            out = _err(400, f"the request body could not be read as its Content-Encoding ({enc}) says: "
                            f"{clip(str(exc).splitlines()[-1].strip(), 200)}", "invalid_content_encoding")
            out.force_close()  # the rest of the body is unread
            return out
        except orjson.JSONDecodeError as exc:
            self.m.requests.labels(endpoint, "400").inc()
            return _err(400, f"request body is not valid JSON: {exc}", "invalid_json")
        try:
            parsed, prompt_tokens, exact = oa.prepare_request(
                endpoint, body, [self.cfg.served_model], self.counter, self.max_model_len,
                self.cfg.default_max_tokens, self.vocab_size, self.chat_template)
            self._check_bus_payload(parsed, prompt_tokens, exact, endpoint)
            if self.cfg.engine_kind == "vllm-cpu" and (why := unsafe_seed(parsed.sampling)) is not None:
                raise oa.ApiError(400, why, param="seed", code="unsupported_value")  # before any engine sees it
        except oa.ApiError as exc:
            self.m.requests.labels(endpoint, str(exc.status)).inc()
            return _api_err(exc)
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
        request[REQUEST_ID] = rid
        created = int(received / 1000)
        self.m.inflight.inc()
        timing = {"received_unix_ms": received, "prompt_tokens": prompt_tokens}
        T = telemetry
        # HTTP server span: continues the client's trace if it sent a W3C traceparent
        with self.tel.tracer.start_as_current_span(
                "ingress.request", context=T.extract_context(request.headers), kind=SpanKind.SERVER,
                start_time=int(received * 1e6), attributes={
                    T.REQUEST_ID: rid, "http.request.method": request.method, "http.route": request.path,
                    "url.path": request.path, "url.scheme": request.scheme, "server.port": self.port or 0,
                    "client.address": request.remote or "", "user_agent.original": request.headers.get("User-Agent", ""),
                    T.GEN_AI_OPERATION_NAME: "text_completion" if endpoint == "completions" else "chat",
                    T.GEN_AI_REQUEST_MODEL: parsed.model, T.GEN_AI_REQUEST_MAX_TOKENS: parsed.max_tokens,
                    T.GEN_AI_REQUEST_STREAM: parsed.stream, T.GEN_AI_RESPONSE_ID: rid,
                    T.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens, "kairos.prompt_tokens_exact": exact}) as span:
            trace_id = T.trace_id_of(span)
            log = self.log.bind(request_id=rid, **T.trace_fields(span))
            status = 500
            resp: web.StreamResponse | None = None
            try:
                resp, status = await self._run(request, parsed, rid, created, prompt_tokens, exact, received, timing,
                                               log, trace_id)
                return resp
            finally:
                span.set_attribute("http.response.status_code", status)
                if "completion_tokens" in timing:
                    span.set_attribute(T.GEN_AI_USAGE_OUTPUT_TOKENS, timing["completion_tokens"])
                    span.set_attribute(T.GEN_AI_RESPONSE_MODEL, parsed.model)
                if "finish_reason" in timing:
                    span.set_attribute(T.GEN_AI_RESPONSE_FINISH_REASONS, [timing["finish_reason"]])
                if "first_token_unix_ms" in timing:
                    ttft = timing["first_token_unix_ms"] - received
                    span.set_attribute(T.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, T.seconds(ttft))
                    span.set_attribute("kairos.ttft_ms", round(ttft, 3))
                if status >= 400:
                    span.set_attribute("error.type", str(timing.get("error") or status))
                    span.set_status(Status(StatusCode.ERROR, str(timing.get("error"))))
                if resp is not None and not resp.prepared:  # error answers too: GET /v1/requests/<id> explains them
                    resp.headers["X-Request-Id"] = rid
                    if trace_id:
                        resp.headers["X-Trace-Id"] = trace_id
                self.m.inflight.dec()
                self.m.requests.labels(endpoint, str(status)).inc()
                timing["status"] = status
                timing.setdefault("finished_unix_ms", now_ms())  # an error answer finishes the request too
                first, done = timing.get("first_token_unix_ms"), timing.get("finished_unix_ms")
                log.info("request_finished", status=status, endpoint=endpoint, prompt_tokens=prompt_tokens,
                         completion_tokens=timing.get("completion_tokens"), error=timing.get("error"),
                         ttft_ms=None if first is None else round(first - received, 3),
                         e2e_ms=round((done or now_ms()) - received, 3))
                self._bg(self._write_timing(rid, timing))

    def _check_bus_payload(self, parsed: oa.ParsedRequest, prompt_tokens: int, exact: bool, endpoint: str) -> None:
        """The request must fit one NATS message (the server's ``max_payload``, 1 MiB by default).

        Raises:
            oa.ApiError: 400 ``prompt_too_large`` naming both sizes.
        """
        limit = getattr(self.nc, "max_payload", 0) if self.nc is not None else 0
        if not limit:
            return
        bt = self.cfg.prefix_block_tokens
        n_hashes = 0 if bt <= 0 else (len(parsed.prompt_token_ids) // bt if parsed.prompt_token_ids is not None
                                      else len((parsed.prompt_text or "").encode()) // (4 * bt))
        probe = bus_request(parsed, "x" * 48, prompt_tokens, exact, 0.0, 0.0, [2 ** 63 - 1] * n_hashes, bt)
        size = len(encode(probe)) + BUS_HEADER_ALLOWANCE
        if size > limit:
            field = "prompt" if endpoint == "completions" else "messages"
            raise oa.ApiError(400, f"The {field} is too large to route: the request takes {size} bytes on the message "
                                   f"bus, whose limit (NATS max_payload) is {limit} bytes. Shorten the {field}.",
                              param=field, code="prompt_too_large")

    async def _run(self, request, parsed: oa.ParsedRequest, rid: str, created: int, prompt_tokens: int, exact: bool,
                   received: float, timing: dict, log, trace_id: str | None) -> tuple[web.StreamResponse, int]:
        """Serve one request: submit it, then carry out what its :class:`RequestLifecycle` says
        about every event until it completes or ends with an explicit error."""
        cfg = self.cfg
        queue: asyncio.Queue = asyncio.Queue()
        lc = RequestLifecycle(rid=rid, max_resubmits=cfg.max_resubmits)
        flight = _Flight(lc=lc, queue=queue, request=request)
        deadline = received + cfg.request_timeout_s * 1000.0
        sub = None
        hashes = request_block_hashes(parsed.prompt_token_ids, parsed.prompt_text, cfg.prefix_block_tokens)
        published: set[str] = set()  #: attempts whose publish was issued (it may be stored even if it failed)

        async def submit(attempt_id: str) -> Exception | None:
            """Route ``attempt_id``'s events to this flight (the wildcard subscription, or a
            per-request one), then publish it onto the work queue. No flush in between: NATS
            processes one connection's SUB before its later PUB, so no token can be missed."""
            nonlocal sub
            for k in [k for k, f in self._flights.items() if f is flight]:
                del self._flights[k]
            self._flights[attempt_id] = flight
            flight.lost = flight.checking = False
            flight.quiet_deadline = None
            flight.dep_epochs.clear()
            flight.predicted = None
            self._refuse_held(flight)  # held for the attempt given up: its job's node never vouched for them
            flight.senders = Senders(attempt_id)
            old = sub
            try:
                if not cfg.out_wildcard:
                    sub = await self.nc.subscribe(S.out_wildcard(attempt_id), cb=self._on_out)
                    if old is not None:
                        await old.unsubscribe()
                ireq = bus_request(parsed, attempt_id, prompt_tokens, exact, received, deadline, hashes,
                                   cfg.prefix_block_tokens)
                # JetStream de-duplicates on Nats-Msg-Id: every attempt has its own id
                headers = telemetry.inject_headers(headers={"Nats-Msg-Id": attempt_id})
                published.add(attempt_id)
                body = encode(ireq)
                flight.lane, flight.enqueued = None, None  # nothing of the previous attempt is moved
                flight.lanes_used.clear()
                lane = await self._enqueue(body, headers)
                if flight.attempt_id == attempt_id:
                    flight.lane, flight.enqueued, flight.enqueued_at = lane, (attempt_id, body, headers), time.monotonic()
                    flight.lanes_used.add(lane)
            except Exception as exc:
                log.error("enqueue_failed", error=repr(exc), attempt_id=attempt_id)
                return exc
            return None

        reorder = Reorder()  # events ahead of a gap wait for it a moment (kairos/services/ingress/reorder.py)

        async def next_event():
            while True:
                if (held := reorder.ready(lc.received)) is not None:
                    return held
                if not queue.empty():  # already here (a burst of token events): no timer, no task
                    return queue.get_nowait()
                left = min(cfg.idle_timeout_s, (deadline - now_ms()) / 1000.0)
                if left <= 0:
                    return None
                hold_left = reorder.time_left()
                try:  # not wait_for: no task and no extra loop turn per event
                    async with asyncio.timeout(left if hold_left is None else min(left, hold_left + 0.001)):
                        return await queue.get()
                except TimeoutError:
                    if hold_left is None or hold_left >= left:
                        return None
                    # the gap's wait ran out: the next round hands the held events on

        text_parts: list[str] = []
        sent = 0  # tokens delivered to the client (streaming)
        finish = "length"
        cached = 0  # prompt tokens the engine served from its prefix cache (DoneEvent)
        resp: web.StreamResponse | None = None
        last_token_ms = 0.0
        #: SSE chunks relayed but not written yet, and their tokens: written when no further event is
        #: already waiting (one socket write per burst; never held back while the queue is empty)
        unsent: list[bytes] = []
        unsent_tokens = 0

        async def fail(status: int, code: str, message: str) -> tuple[web.StreamResponse, int]:
            timing["error"], timing["error_message"] = code, clip(message)
            timing["completion_tokens"] = sent + unsent_tokens if parsed.stream else 0  # unsent: written below
            if resp is None:
                return _err(status, message, code), status
            await self._sse_done(resp, oa.error_body(clip(message), oa.error_type_for(status), None, code),
                                 before=b"".join(unsent))
            return resp, status

        try:
            exc = await submit(rid)
            if exc is not None:
                timing["error"] = "enqueue_failed"
                timing["error_message"] = "could not enqueue the request (the message bus is unavailable)"
                # a publish that timed out may still be stored (the server was slow, not gone): the
                # cancel and the attempt's tombstone claim follow it on this connection, so no node
                # runs it (kairos/runtime/claims.py), and the client's retry is the only execution
                await self._refused(rid, "enqueue_failed", deadline, rid in published)
                return _err(503, "could not enqueue the request (the message bus is unavailable); retry",
                            "enqueue_failed"), 503
            while True:
                ev = await next_event()
                time_left = deadline > now_ms()
                first = lc.received == 0
                if ev is None:
                    action = lc.on_timeout(before_first_token=first)
                    log.warning("request_timeout_before_first_token" if first else "request_timeout_mid_stream",
                                completion_tokens=lc.received)
                elif isinstance(ev, _ClientGone):
                    lc.on_client_gone()
                    return await self._client_gone(flight.attempt_id, resp, timing, log, parsed, sent)
                elif isinstance(ev, _Shutdown):
                    action = lc.on_shutdown()
                    log.warning("request_ended_by_shutdown", tokens_sent=sent)
                elif isinstance(ev, _BusDown):
                    action = lc.on_bus_unavailable(ev.outage_s)
                    self.m.bus_down.inc()
                    log.warning("request_ended_bus_unavailable", outage_s=round(ev.outage_s, 3), tokens_sent=sent)
                elif isinstance(ev, _NodeLost):
                    if ev.attempt_id != lc.attempt_id:
                        continue
                    action = lc.on_node_dead(ev.node, time_left)
                    if isinstance(action, Ignore):
                        flight.lost = False  # it moved on meanwhile (e.g. the handoff node took over)
                        continue
                    self.m.node_lost.labels("resubmitted" if isinstance(action, Resubmit) else "failed").inc()
                elif isinstance(ev, _Interrupted):
                    if ev.attempt_id != lc.attempt_id:
                        continue
                    action = lc.interrupted(ev.detail, time_left)
                elif reorder.hold(ev, lc.attempt_id, lc.received):
                    continue
                elif isinstance(ev, TokenEvent):
                    action = lc.on_token(ev, time_left)
                elif isinstance(ev, DoneEvent):
                    action = lc.on_done(ev, time_left)
                else:
                    action = lc.on_error(ev)
                if isinstance(action, Resubmit) and action.why.startswith("stream_interrupted"):
                    self.m.interrupted.labels("resubmitted").inc()
                elif isinstance(action, Fail) and action.code == "stream_interrupted":
                    self.m.interrupted.labels("failed").inc()

                if isinstance(action, Ignore):
                    if action.reason in DROP_REASONS:
                        self.m.dropped.labels(action.reason).inc()
                        if action.reason == "foreign_node":
                            log.warning("foreign_node_event_dropped", node=getattr(ev, "node", None))
                        elif action.reason == "routed_elsewhere":
                            log.info("duplicate_routing_error_dropped", code=getattr(ev, "code", None),
                                     source=getattr(ev, "source", None))
                    continue
                if isinstance(action, Resubmit):
                    await self._cancel(action.old_attempt_id, "resubmitted")  # frees what other nodes hold for it
                    log.warning("request_resubmitted", why=action.why, lost_attempt=action.old_attempt_id,
                                attempt_id=action.new_attempt_id, discarded_tokens=len(text_parts))
                    timing.setdefault("resubmitted_as", []).append(action.new_attempt_id)
                    text_parts.clear()
                    reorder.clear()
                    timing.pop("first_token_unix_ms", None)
                    exc = await submit(action.new_attempt_id)
                    if exc is not None:
                        timing["error"] = "enqueue_failed"
                        await self._refused(action.new_attempt_id, "enqueue_failed", deadline,
                                           action.new_attempt_id in published)
                        return _err(503, f"request {rid} lost its node or stream ({action.why}) and could not be "
                                         "re-submitted (the message bus is unavailable); retry", "enqueue_failed"), 503
                    continue
                if isinstance(action, Fail):
                    if action.cancel:
                        await self._cancel(action.attempt_id, action.code)
                    if action.code in ("node_lost", "stream_interrupted"):
                        log.warning("request_lost", code=action.code, message=action.message, tokens_sent=sent)
                    elif isinstance(ev, ErrorEvent):
                        log.warning("request_failed" if resp is None else "request_failed_mid_stream", code=ev.code,
                                    message=ev.message, source=ev.source)
                    return await fail(action.status, action.code, action.message)
                if isinstance(action, Complete):
                    finish = action.finish_reason
                    cached = action.cached_tokens
                    timing["finish_reason"] = finish
                    break
                assert isinstance(action, Relay)
                tok = action.event
                t = now_ms()
                if first:
                    timing["first_token_unix_ms"] = t
                    self.m.ttft.observe(telemetry.seconds(t - received))
                else:  # TBT per token: a k-token event spreads its gap over k tokens
                    gap = telemetry.seconds(t - last_token_ms) / max(1, tok.count)
                    for _ in range(max(1, tok.count)):
                        self.m.tbt.observe(gap)
                last_token_ms = t
                if parsed.stream:
                    if resp is None:
                        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                   "X-Request-Id": rid}
                        if trace_id:
                            headers["X-Trace-Id"] = trace_id
                        resp = _SseResponse(headers=headers)
                        request[STREAM_STARTED] = True
                        lc.committed_to_client()
                        try:
                            await resp.prepare(request)
                        except (ConnectionResetError, RuntimeError):  # gone while the headers were written
                            lc.on_client_gone()
                            return await self._client_gone(flight.attempt_id, resp, timing, log, parsed, sent)
                    if first and parsed.endpoint == "chat":  # the role alone first, as OpenAI and vLLM send it
                        unsent.append(sse_event(oa.stream_chunk(parsed, rid, created, "", None, first=True)))
                    unsent.append(sse_event(oa.stream_chunk(parsed, rid, created, tok.text, None)))
                    unsent_tokens += tok.count
                    if queue.empty():
                        ok = await self._sse_write(resp, b"".join(unsent))
                        unsent.clear()
                        if not ok:
                            lc.on_client_gone()
                            return await self._client_gone(flight.attempt_id, resp, timing, log, parsed, sent)
                        sent += unsent_tokens
                        unsent_tokens = 0
                else:
                    text_parts.append(tok.text)
            completion = lc.received
            timing["finished_unix_ms"] = now_ms()
            timing["completion_tokens"] = completion
            self.m.e2e.observe(telemetry.seconds(timing["finished_unix_ms"] - received))
            if not parsed.stream:
                lc.committed_to_client()
                out = _json(oa.full_response(parsed, rid, created, "".join(text_parts), finish, prompt_tokens,
                                             completion, cached))
                out.headers["X-Request-Id"] = rid
                return out, 200
            assert resp is not None
            await self._sse_done(resp, oa.stream_chunk(parsed, rid, created, None if parsed.endpoint == "chat" else "",
                                                       finish),
                                 *([oa.usage_chunk(parsed, rid, created, prompt_tokens, completion, cached)]
                                   if parsed.include_usage else []), before=b"".join(unsent))
            return resp, 200
        finally:
            if flight.predicted is not None:
                timing[PREDICTED] = flight.predicted
            self._refuse_held(flight)
            for k in [k for k, f in self._flights.items() if f is flight]:
                del self._flights[k]
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass

    async def _client_gone(self, attempt_id: str, resp, timing: dict, log, parsed: oa.ParsedRequest, sent: int):
        """The client closed its connection: cancel on the nodes, record 499 and the tokens it got."""
        timing["error"] = "client_disconnected"
        timing["completion_tokens"] = sent
        self.m.disconnects.labels(parsed.endpoint, str(parsed.stream).lower()).inc()
        log.info("client_disconnected", tokens_sent=sent, stream=parsed.stream)
        await self._cancel(attempt_id, "client_disconnected")
        if resp is None or not resp.prepared:  # nobody will read it; the status is for the log, metrics and record
            return _err(499, "client closed the connection", "client_disconnected"), 499
        return resp, 499

    async def _sse_write(self, resp: web.StreamResponse, data: bytes) -> bool:
        """Write SSE bytes (one or more events); False if the client is gone."""
        try:
            await resp.write(data)
            return True
        except (ConnectionResetError, RuntimeError):
            return False

    async def _sse_done(self, resp: web.StreamResponse, *last: dict, before: bytes = b"") -> None:
        """End the stream: ``before`` (events relayed but not written yet), the ``last`` events,
        ``data: [DONE]`` and the chunked-encoding end in one write (one syscall instead of several)."""
        try:
            await resp.write_eof(before + b"".join(sse_event(o) for o in last) + b"data: [DONE]\n\n")
        except (ConnectionResetError, RuntimeError):
            pass

    async def _refused(self, attempt_id: str, code: str, deadline_unix_ms: float, published: bool) -> None:
        """Attempt ``attempt_id`` was answered with error ``code`` before any node took it: cancel
        it and, if its publish was issued (``published``: it may be stored although it failed),
        create its tombstone claim in the background (:func:`kairos.runtime.claims.withdraw`, retried until
        the bus answers, at most until the attempt's deadline ``deadline_unix_ms``, wall clock ms),
        which every node's claim finds — in whatever order the nodes get the request and the cancel."""
        await self._cancel(attempt_id, code)
        if published:
            self._bg(self._withdraw(attempt_id, code, deadline_unix_ms))

    async def _withdraw(self, attempt_id: str, code: str, deadline_unix_ms: float) -> None:
        if self.claims is None:
            return
        outcome, claim = await withdraw(self.claims, attempt_id, code, deadline_unix_ms)
        if outcome == "withdrawn":
            self.log.info("attempt_withdrawn", request_id=attempt_id, code=code)
        elif outcome == "ran":
            self.log.warning("withdrawn_attempt_ran", request_id=attempt_id, code=code,
                             node=claim.node if claim else None)
        else:
            self.log.warning("attempt_withdrawal_expired", request_id=attempt_id, code=code)

    async def _enqueue(self, body: bytes, headers: dict[str, str]) -> int:
        """Publish one request to a request lane (kairos/runtime/lanes.py), acknowledged by JetStream;
        returns the lane. Lanes are tried in turn (:meth:`LanePicker.order`); one that finds no
        stream (its member is down: no responders) or gives no acknowledgement within
        :data:`LANE_PUBLISH_TIMEOUT_S` (2 s with a single lane) is marked down and the next is
        tried at once, with the same ``Nats-Msg-Id`` (a lane keeps one copy within its 120 s
        duplicate window; copies on two lanes meet one execution claim). With every lane failing
        it starts over every 0.1 s until ``cfg.enqueue_timeout_s`` has passed; while the
        connection is down (nats-py reconnecting to another member) it waits for it, polling every
        50 ms — an outage older than :data:`RECONNECT_WAIT_S` is not a failover: that raises at once.
        Then the last error is raised (the caller answers 503 ``enqueue_failed``); a closed
        connection raises at once.

        Raises:
            ConnectionError: not connected to NATS when the time was up.
            nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.Error: the
                last try's error.
        """
        deadline = time.monotonic() + self.cfg.enqueue_timeout_s
        per_try = LANE_PUBLISH_TIMEOUT_S if self.lanes.lanes > 1 else 2.0
        while True:
            while not self.nc.is_connected and not self.nc.is_closed and time.monotonic() < deadline:
                since = self._bus.disconnected_since if self._bus is not None else None
                if since is not None and time.monotonic() - since > RECONNECT_WAIT_S:
                    break
                await asyncio.sleep(0.05)
            if not self.nc.is_connected:
                raise ConnectionError("the ingress is not connected to NATS")
            for lane in self.lanes.order():
                try:
                    await self.js.publish(S.request_subject(lane), body, headers=headers, stream=S.request_stream(lane),
                                          timeout=min(per_try, max(0.1, deadline - time.monotonic())))
                    return lane
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                        nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError):
                    self.lanes.down(lane)
                    if self.nc.is_closed or time.monotonic() + 0.1 >= deadline:
                        raise
                    self.m.enqueue_retries.inc()
            await asyncio.sleep(0.1)

    async def _cancel(self, rid: str, reason: str) -> None:
        try:
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason=reason))
        except Exception:
            pass

    async def _write_timing(self, rid: str, t: dict) -> None:
        rec = msgspec.convert({k: v for k, v in t.items() if k not in ("finish_reason", PREDICTED)}, IngressTiming)
        if t.get("status") == 200 and rec.first_token_unix_ms is not None and t.get(PREDICTED) is not None:
            self._observe_prediction(*t[PREDICTED], rec.first_token_unix_ms - rec.received_unix_ms)
        try:
            await kv_put_nowait(self.nc, S.REQUESTS_BUCKET, S.record_key(rid, "ingress"), encode(rec))
        except Exception as exc:
            self.log.warning("record_write_failed", request_id=rid, error=repr(exc))

    def _observe_prediction(self, kind: str, pred: float, ttft_ms: float) -> None:
        """Predicted vs measured TTFT: the dispatcher's estimate for the path taken (``pred`` ms,
        decision ``kind``, carried by the routing event of the attempt that served the request)
        against the TTFT the client saw (``ttft_ms``)."""
        self.m.ttft_pred.labels(kind).observe(telemetry.seconds(pred))
        self.m.ttft_meas.labels(kind).observe(telemetry.seconds(ttft_ms))
        self.m.ttft_err.labels(kind).observe(telemetry.seconds(ttft_ms - pred))


async def run(cfg: IngressConfig, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set."""
    ing = Ingress(cfg)
    await ing.start()
    try:
        await stop.wait()
    finally:
        await ing.close()
