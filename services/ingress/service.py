"""Ingress: OpenAI HTTP in, requests onto the JetStream work queue, token stream back out.

Per request: validate (:mod:`shared.openai_api`), count prompt tokens, assign the id, subscribe to
``kairos.out.<id>`` *before* publishing (so no token can be missed), publish the
:class:`~shared.wire.InferenceRequest` with the W3C trace context in the headers, then relay events.
Streaming responses send their HTTP headers only when the first token arrives, so an error before
it still gets a proper 4xx/5xx status. Every accepted request ends with a completion or an
OpenAI-shaped error, promptly:

* dispatcher/agent errors are relayed;
* **node lost**: the ingress follows where each request is (routing events on
  ``kairos.route.decided``, the node of its tokens, the prefill record's handoff node) and watches
  the cluster view; when that node goes stale or leaves the view, a request that has sent nothing
  to the client yet is re-submitted to the dispatchers under a new bus id ``<id>-r<n>`` (at most
  ``max_resubmits`` times; the old id is cancelled), otherwise it ends with 503 ``node_lost``
  (SSE error event mid-stream) and a cancel to the nodes;
* a client that closes its connection (streaming or not) is noticed within ``disconnect_poll_s``:
  cancel to the nodes, recorded as 499 ``client_disconnected`` with the tokens delivered;
* silence past ``idle_timeout_s`` or ``request_timeout_s`` becomes 504 (and a cancel).

Every HTTP error (including aiohttp's own 404/405/413) is an OpenAI-shaped JSON body (middleware).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
import uuid
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
import orjson
from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from services.ingress.config import IngressConfig
from services.ingress.http import (HardenedRunner, add_retry_after, api_key_middleware, clip, error_response,
                                   load_api_keys)
from shared import openai_api as oa
from shared import subjects as S
from shared import telemetry
from shared.bus import close as bus_close
from shared.bus import connect_service, ensure_buckets, publish
from shared.emulated_text import EMULATED_VOCAB_SIZE
from shared.latency import load_profile
from shared.records import request_record
from shared.routing import routable
from shared.wire import (Cancel, ClusterView, DecisionRecord, DecodeTiming, DoneEvent, ErrorEvent, InferenceRequest, IngressTiming,
                         OutEvent, PrefillTiming, RoutedEvent, TokenEvent, WireError, decode, encode, now_ms)


#: set on a request once its SSE headers are sent (no error response can replace them any more)
STREAM_STARTED = web.RequestKey("kairos_stream_started", bool)
#: set on a completion request once its id is assigned (error logs name it)
REQUEST_ID = web.RequestKey("kairos_request_id", str)
#: bytes reserved for the NATS headers of a request (traceparent, tracestate, Nats-Msg-Id)
BUS_HEADER_ALLOWANCE = 1024


def bus_request(parsed: oa.ParsedRequest, request_id: str, prompt_tokens: int, exact: bool, created_unix_ms: float,
                deadline_unix_ms: float) -> InferenceRequest:
    """The :class:`InferenceRequest` the ingress publishes for one attempt of ``parsed``."""
    return InferenceRequest(request_id=request_id, model=parsed.model, prompt_tokens=prompt_tokens,
                            max_tokens=parsed.max_tokens, prompt_tokens_exact=exact, prompt_text=parsed.prompt_text,
                            prompt_token_ids=parsed.prompt_token_ids, created_unix_ms=created_unix_ms,
                            deadline_unix_ms=deadline_unix_ms, sampling=parsed.sampling,
                            max_tokens_explicit=parsed.max_tokens_explicit)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _err(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    return error_response(status, message, code, param)


def _api_err(exc: oa.ApiError) -> web.Response:
    return error_response(exc.status, exc.message, exc.code, exc.param)


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
        for outcome in ("resubmitted", "failed"):
            self.node_lost.labels(outcome)
        self.auth_failures = Counter("kairos_ingress_auth_failures_total",
                                     "Requests refused with 401 (API key missing or invalid)", ("reason",),
                                     registry=reg)
        self.slow_clients = Counter("kairos_ingress_slow_clients_dropped_total",
                                    "Connections closed because their request head did not arrive within "
                                    "header_timeout_s", registry=reg)


@dataclass
class _NodeLost:
    """Queue item: a node the request depends on went stale or left the view."""

    node: str
    attempt_id: str


class _ClientGone:
    """Queue item: the HTTP client closed its connection."""


class _Shutdown:
    """Queue item: this ingress is stopping; end the request with an explicit error now."""


@dataclass
class _Flight:
    """Where one in-flight request is, as far as the ingress knows (keyed by its current bus id)."""

    rid: str  #: the id the client sees
    attempt_id: str  #: the id on the bus for the current attempt (rid, then rid-r1, rid-r2)
    queue: asyncio.Queue
    request: web.Request
    kind: str | None = None  #: "prefill" (keep) or "deflect", from the routing event
    node: str | None = None  #: node that accepted the job
    handoff_node: str | None = None  #: keep path: decode node that took the KV (prefill record)
    token_node: str | None = None  #: node the tokens come from
    lost: bool = False  #: a _NodeLost was queued for this attempt
    client_gone: bool = False
    checking: bool = False  #: a prefill-record lookup is running

    def reset(self, attempt_id: str) -> None:
        self.attempt_id, self.kind, self.node, self.handoff_node, self.token_node = attempt_id, None, None, None, None
        self.lost = False


def predicted_ttft_ms(rec: DecisionRecord) -> float | None:
    """The decision's TTFT estimate for the path it took (None if the policy made none)."""
    d = rec.decision
    if d.deflected:
        return d.ttft_decode_est_ms.get(d.node)
    return d.ttft_prefill_est_ms


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
        self.port: int | None = None
        self.nc = None
        self._runner = None
        self._tasks: set[asyncio.Task] = set()
        self.view: ClusterView | None = None
        self._view_rx: float | None = None  # time.monotonic() when the last view arrived
        self._view_task: asyncio.Task | None = None
        self._seen_nodes: set[str] = set()
        self._roles: dict[str, str] = {}
        self.dead_nodes: set[str] = set()  #: nodes stale in, or gone from, the current view
        self._flights: dict[str, _Flight] = {}
        self._subs: list = []
        self._poll_task: asyncio.Task | None = None
        self._disp: dict | None = None  # cached dispatcher-consumer check
        self._disp_at = 0.0
        self._disp_lock = asyncio.Lock()
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
        self.buckets = await ensure_buckets(self.js)
        self._view_watcher = await self.buckets.view.watch(S.VIEW_KEY)
        self._view_task = asyncio.create_task(self._watch_view(self._view_watcher))
        self._subs.append(await self.nc.subscribe(S.ROUTED_SUBJECT, cb=self._on_routed))
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

    async def close(self) -> None:
        """Stop: every request still in flight ends now with an explicit 503 ``ingress_shutdown``
        (normally none: ``kairos up`` stops dispatchers and agents first, whose errors are relayed),
        then the HTTP server waits for those handlers to send their answers."""
        for f in list(self._flights.values()):
            f.queue.put_nowait(_Shutdown())
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
        await bus_close(self.nc, graceful=True)
        self.tel.shutdown()

    def _bg(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- errors ---------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error response is OpenAI-shaped JSON, aiohttp's own 404/405/413 included."""
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
            msg, code = (f"request body is too large: the limit is {self.cfg.max_body_bytes} bytes"
                         f"{f' (got {request.content_length})' if request.content_length else ''}"), "request_too_large"
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
        try:
            info = await self.js.consumer_info(S.REQUEST_STREAM, S.DISPATCHER_CONSUMER, timeout=1.0)
        except nats.js.errors.NotFoundError:
            return {"consuming": False, "detail": f"consumer {S.DISPATCHER_CONSUMER!r} on stream "
                                                  f"{S.REQUEST_STREAM!r} does not exist: no dispatcher ever started"}
        except Exception as exc:
            self.log.warning("consumer_info_failed", error=repr(exc))  # the body names no exception
            return {"consuming": False, "detail": "the consumer state could not be read from JetStream"}
        waiting = info.num_waiting or 0
        last = info.delivered.last_active if info.delivered is not None else None
        since = None
        if last is not None:
            since = round((datetime.datetime.now(datetime.timezone.utc) - last).total_seconds(), 3)
        consuming = waiting > 0 or (since is not None and since <= self.cfg.dispatcher_active_window_s)
        detail = ("ok" if consuming else
                  f"no pull request waiting and no delivery in the last {self.cfg.dispatcher_active_window_s:g} s")
        return {"consuming": consuming, "detail": detail, "num_waiting": waiting, "last_delivery_s_ago": since,
                "num_pending": info.num_pending, "num_ack_pending": info.num_ack_pending}

    async def _watch_view(self, watcher) -> None:
        async for e in watcher:
            if e is None or not e.value or e.operation is not None:
                continue
            try:
                view = decode(e.value, ClusterView)
            except WireError:
                continue
            self.view, self._view_rx = view, time.monotonic()
            try:
                self._on_view(view)
            except Exception as exc:  # never let the watcher die
                self.log.error("view_check_failed", error=repr(exc))

    # -- where requests are, and nodes that die under them --------------------------------------
    def _on_view(self, view: ClusterView) -> None:
        present = {n.node for n in view.nodes}
        self._seen_nodes |= present
        self._roles.update((n.node, n.role) for n in view.nodes)
        dead = {n.node for n in view.nodes if n.stale} | (self._seen_nodes - present)
        newly = dead - self.dead_nodes
        if newly:
            self.log.warning("nodes_lost", nodes=sorted(newly), in_flight=len(self._flights))
        self.dead_nodes = dead
        if dead:
            decode_died = any(self._roles.get(n) == "decode" for n in newly)
            for f in list(self._flights.values()):
                self._check_flight(f, decode_died)

    async def _on_routed(self, msg) -> None:
        try:
            ev = decode(msg.data, RoutedEvent)
        except WireError:
            return
        f = self._flights.get(ev.request_id)
        if f is None:
            return
        f.kind, f.node = ev.kind, ev.node
        if self.dead_nodes:
            self._check_flight(f, True)

    def _check_flight(self, f: _Flight, decode_may_have_died: bool) -> None:
        """Queue a _NodeLost for ``f`` if a node it depends on is dead. Keep path before the first
        token: the prefill node, or — after the handoff — the decode node that took the KV (read
        from the prefill record; the decision's decode node alone does not count, the prefill
        agent tries the other candidates)."""
        if f.lost or f.client_gone:
            return
        dead = self.dead_nodes
        if f.token_node is not None:
            if f.token_node in dead:
                self._lost(f, f.token_node)
            return
        if f.kind == "deflect":
            if f.node in dead:
                self._lost(f, f.node)
            return
        if f.kind == "prefill":
            if f.handoff_node is not None:
                if f.handoff_node in dead:
                    self._lost(f, f.handoff_node)
            elif (f.node in dead or decode_may_have_died) and not f.checking:
                f.checking = True
                self._bg(self._check_handoff(f, f.attempt_id))

    async def _check_handoff(self, f: _Flight, attempt_id: str) -> None:
        try:
            try:
                e = await self.buckets.requests.get(S.record_key(attempt_id, "prefill"))
                rec = decode(e.value, PrefillTiming) if e.value else None
            except (nats.js.errors.KeyNotFoundError, WireError):
                rec = None
            except Exception as exc:
                self.log.warning("prefill_record_read_failed", request_id=attempt_id, error=repr(exc))
                rec = None
        finally:
            f.checking = False
        if f.attempt_id != attempt_id or f.lost or f.client_gone or f.token_node is not None:
            return
        if rec is not None and rec.handoff_node:
            f.handoff_node = rec.handoff_node
            if f.handoff_node in self.dead_nodes:
                self._lost(f, f.handoff_node)
        elif f.node in self.dead_nodes:
            self._lost(f, f.node)

    def _lost(self, f: _Flight, node: str) -> None:
        f.lost = True
        f.queue.put_nowait(_NodeLost(node=node, attempt_id=f.attempt_id))

    async def _watch_clients(self) -> None:
        """Notice clients that closed their connection (aiohttp does not cancel the handler)."""
        while True:
            await asyncio.sleep(self.cfg.disconnect_poll_s)
            for f in list(self._flights.values()):
                t = f.request.transport
                if not f.client_gone and (t is None or t.is_closing()):
                    f.client_gone = True
                    f.queue.put_nowait(_ClientGone())

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

        async def get(key_rid: str, part: str, typ):
            try:
                e = await self.buckets.requests.get(S.record_key(key_rid, part))
                return decode(e.value, typ) if e.value else None
            except (nats.js.errors.KeyNotFoundError, WireError):
                return None

        parts["ingress"] = await get(rid, "ingress", IngressTiming)
        # re-submitted after a node was lost: the routing/node records of the attempt that served it
        served_by = parts["ingress"].resubmitted_as[-1] if parts["ingress"] and parts["ingress"].resubmitted_as else rid
        for part, typ in (("decision", DecisionRecord), ("prefill", PrefillTiming), ("decode", DecodeTiming)):
            parts[part] = await get(served_by, part, typ)
        if all(v is None for v in parts.values()):
            return _err(404, f"no record of request {rid!r} (unknown, or older than the record TTL)", "not_found")
        return _json(request_record(rid, parts["decision"], parts["prefill"], parts["decode"], parts["ingress"]))

    # -- completions ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def _complete(self, request: web.Request, endpoint: oa.Endpoint) -> web.StreamResponse:
        received = now_ms()
        try:
            body = orjson.loads(await asyncio.wait_for(request.read(), self.cfg.body_timeout_s))
        except web.HTTPRequestEntityTooLarge as exc:
            self.m.requests.labels(endpoint, "413").inc()
            return self._http_error(request, exc)
        except asyncio.TimeoutError:
            self.m.requests.labels(endpoint, "408").inc()
            out = _err(408, f"the request body was not received within {self.cfg.body_timeout_s:g} s",
                       "request_timeout")
            out.force_close()
            return out
        except orjson.JSONDecodeError as exc:
            self.m.requests.labels(endpoint, "400").inc()
            return _err(400, f"request body is not valid JSON: {exc}", "invalid_json")
        try:
            parsed, prompt_tokens, exact = oa.prepare_request(
                endpoint, body, [self.cfg.served_model], self.counter, self.max_model_len,
                self.cfg.default_max_tokens, self.vocab_size, self.chat_template)
            self._check_bus_payload(parsed, prompt_tokens, exact, endpoint)
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
                if resp is not None and not resp.prepared and trace_id:
                    resp.headers["X-Trace-Id"] = trace_id
                self.m.inflight.dec()
                self.m.requests.labels(endpoint, str(status)).inc()
                timing["status"] = status
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
        probe = bus_request(parsed, "x" * 48, prompt_tokens, exact, 0.0, 0.0)
        size = len(encode(probe)) + BUS_HEADER_ALLOWANCE
        if size > limit:
            field = "prompt" if endpoint == "completions" else "messages"
            raise oa.ApiError(400, f"The {field} is too large to route: the request takes {size} bytes on the message "
                                   f"bus, whose limit (NATS max_payload) is {limit} bytes. Shorten the {field}.",
                              param=field, code="prompt_too_large")

    async def _run(self, request, parsed: oa.ParsedRequest, rid: str, created: int, prompt_tokens: int, exact: bool,
                   received: float, timing: dict, log, trace_id: str | None) -> tuple[web.StreamResponse, int]:
        cfg = self.cfg
        queue: asyncio.Queue = asyncio.Queue()
        flight = _Flight(rid=rid, attempt_id=rid, queue=queue, request=request)
        deadline = received + cfg.request_timeout_s * 1000.0
        sub = None

        async def on_out(msg) -> None:
            try:
                ev = decode(msg.data, OutEvent)  # type: ignore[arg-type]
            except WireError as exc:
                log.warning("bad_out_event", error=str(exc))
                return
            if ev.request_id != flight.attempt_id:  # late event of an abandoned attempt
                return
            if isinstance(ev, TokenEvent) and flight.token_node != ev.node:
                flight.token_node = ev.node
                if ev.node in self.dead_nodes:
                    self._check_flight(flight, False)
            queue.put_nowait(ev)

        async def submit(attempt_id: str) -> Exception | None:
            """(Re-)subscribe for ``attempt_id``'s events, then publish it onto the work queue."""
            nonlocal sub
            self._flights.pop(flight.attempt_id, None)
            flight.reset(attempt_id)
            self._flights[attempt_id] = flight
            old = sub
            try:
                sub = await self.nc.subscribe(S.out_subject(attempt_id), cb=on_out)
                if old is not None:
                    await old.unsubscribe()
                ireq = bus_request(parsed, attempt_id, prompt_tokens, exact, received, deadline)
                # JetStream de-duplicates on Nats-Msg-Id: every attempt has its own id
                headers = telemetry.inject_headers(headers={"Nats-Msg-Id": attempt_id})
                await self.nc.flush()
                await self.js.publish(S.REQUEST_SUBJECT, encode(ireq), headers=headers, stream=S.REQUEST_STREAM)
            except Exception as exc:
                log.error("enqueue_failed", error=repr(exc), attempt_id=attempt_id)
                return exc
            return None

        async def next_event():
            left = min(cfg.idle_timeout_s, (deadline - now_ms()) / 1000.0)
            if left <= 0:
                return None
            try:
                return await asyncio.wait_for(queue.get(), left)
            except asyncio.TimeoutError:
                return None

        text_parts: list[str] = []
        completion = 0  # tokens received for the current attempt
        sent = 0  # tokens delivered to the client (streaming)
        finish = "length"
        cached = 0  # prompt tokens the engine served from its prefix cache (DoneEvent)
        resp: web.StreamResponse | None = None
        first = True
        last_token_ms = 0.0
        resubmits = 0

        async def fail(status: int, code: str, message: str) -> tuple[web.StreamResponse, int]:
            timing["error"] = code
            timing["completion_tokens"] = sent if parsed.stream else 0
            if resp is None:
                return _err(status, message, code), status
            await self._sse(resp, oa.error_body(clip(message), oa.error_type_for(status), None, code))
            await self._sse_done(resp)
            return resp, status

        try:
            exc = await submit(rid)
            if exc is not None:
                timing["error"] = "enqueue_failed"
                return _err(503, "could not enqueue the request (the message bus is unavailable); retry",
                            "enqueue_failed"), 503
            while True:
                ev = await next_event()
                if ev is None:
                    await self._cancel(flight.attempt_id, "timeout")
                    if first:
                        log.warning("request_timeout_before_first_token")
                        return await fail(504, "timeout", f"request {rid} timed out before its first token")
                    log.warning("request_timeout_mid_stream", completion_tokens=completion)
                    return await fail(504, "timeout", f"request {rid} timed out waiting for tokens")
                if isinstance(ev, _ClientGone):
                    return await self._client_gone(flight.attempt_id, resp, timing, log, parsed, sent)
                if isinstance(ev, _Shutdown):
                    await self._cancel(flight.attempt_id, "ingress_shutdown")
                    log.warning("request_ended_by_shutdown", tokens_sent=sent)
                    return await fail(503, "ingress_shutdown", f"the ingress serving request {rid} is shutting "
                                                               "down; retry the request")
                if isinstance(ev, _NodeLost):
                    if ev.attempt_id != flight.attempt_id:
                        continue
                    old_id = flight.attempt_id
                    # nothing reached the client yet (a non-streaming answer is sent only at the end)
                    if resp is None and resubmits < cfg.max_resubmits and deadline > now_ms():
                        resubmits += 1
                        new_id = f"{rid}-r{resubmits}"
                        await self._cancel(old_id, "node_lost")  # frees whatever other nodes hold for it
                        self.m.node_lost.labels("resubmitted").inc()
                        log.warning("node_lost_resubmitting", node=ev.node, lost_attempt=old_id, attempt_id=new_id,
                                    discarded_tokens=completion)
                        timing.setdefault("resubmitted_as", []).append(new_id)
                        text_parts.clear()
                        completion, first = 0, True
                        timing.pop("first_token_unix_ms", None)
                        exc = await submit(new_id)
                        if exc is not None:
                            timing["error"] = "enqueue_failed"
                            return _err(503, f"node {ev.node} was lost and the request could not be re-submitted "
                                             "(the message bus is unavailable); retry", "enqueue_failed"), 503
                        continue
                    self.m.node_lost.labels("failed").inc()
                    await self._cancel(old_id, "node_lost")
                    why = ("tokens were already streamed" if resp is not None else
                           f"re-submitted {resubmits} time(s) already" if resubmits else "no time left")
                    log.warning("node_lost_failed", node=ev.node, attempt_id=old_id, why=why, tokens_sent=sent)
                    return await fail(503, "node_lost", f"node {ev.node} serving request {rid} was lost (no "
                                                        f"heartbeat; it may have crashed) and the request cannot be "
                                                        f"moved: {why}")
                if isinstance(ev, TokenEvent):
                    t = now_ms()
                    if first:
                        timing["first_token_unix_ms"] = t
                        self.m.ttft.observe(telemetry.seconds(t - received))
                    else:  # TBT per token: a k-token event spreads its gap over k tokens
                        gap = telemetry.seconds(t - last_token_ms) / max(1, ev.count)
                        for _ in range(max(1, ev.count)):
                            self.m.tbt.observe(gap)
                    last_token_ms = t
                    completion += ev.count
                    if parsed.stream:
                        if resp is None:
                            headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Request-Id": rid}
                            if trace_id:
                                headers["X-Trace-Id"] = trace_id
                            resp = web.StreamResponse(headers=headers)
                            request[STREAM_STARTED] = True
                            await resp.prepare(request)
                        if not await self._sse(resp, oa.stream_chunk(parsed, rid, created, ev.text, None, first)):
                            return await self._client_gone(flight.attempt_id, resp, timing, log, parsed, sent)
                        sent += ev.count
                    else:
                        text_parts.append(ev.text)
                    first = False
                elif isinstance(ev, DoneEvent):
                    finish = ev.finish_reason
                    cached = ev.cached_tokens
                    timing["finish_reason"] = finish
                    break
                elif isinstance(ev, ErrorEvent):
                    log.warning("request_failed" if resp is None else "request_failed_mid_stream", code=ev.code,
                                message=ev.message, source=ev.source)
                    return await fail(ev.status, ev.code, ev.message)
            timing["finished_unix_ms"] = now_ms()
            timing["completion_tokens"] = completion
            self.m.e2e.observe(telemetry.seconds(timing["finished_unix_ms"] - received))
            if not parsed.stream:
                out = _json(oa.full_response(parsed, rid, created, "".join(text_parts), finish, prompt_tokens,
                                             completion, cached))
                out.headers["X-Request-Id"] = rid
                return out, 200
            assert resp is not None
            await self._sse(resp, oa.stream_chunk(parsed, rid, created, None if parsed.endpoint == "chat" else "",
                                                  finish))
            if parsed.include_usage:
                await self._sse(resp, oa.usage_chunk(parsed, rid, created, prompt_tokens, completion, cached))
            await self._sse_done(resp)
            return resp, 200
        finally:
            self._flights.pop(flight.attempt_id, None)
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
        if resp is None:  # nobody will read it; the status is for the log, metrics and record
            return _err(499, "client closed the connection", "client_disconnected"), 499
        return resp, 499

    async def _sse(self, resp: web.StreamResponse, obj: dict) -> bool:
        try:
            await resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")
            return True
        except (ConnectionResetError, RuntimeError):
            return False

    async def _sse_done(self, resp: web.StreamResponse) -> None:
        try:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass

    async def _cancel(self, rid: str, reason: str) -> None:
        try:
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=rid, reason=reason))
        except Exception:
            pass

    async def _write_timing(self, rid: str, t: dict) -> None:
        rec = msgspec.convert({k: v for k, v in t.items() if k != "finish_reason"}, IngressTiming)
        try:
            await self.buckets.requests.put(S.record_key(rid, "ingress"), encode(rec))
        except Exception as exc:
            self.log.warning("record_write_failed", request_id=rid, error=repr(exc))
        if t.get("status") == 200 and rec.first_token_unix_ms is not None:
            await self._observe_prediction(rid, rec.first_token_unix_ms - rec.received_unix_ms)

    async def _observe_prediction(self, rid: str, ttft_ms: float) -> None:
        """Predicted vs measured TTFT: the dispatcher wrote its estimate into the decision record
        (long before the first token); compare it with what the client saw."""
        try:
            e = await self.buckets.requests.get(S.record_key(rid, "decision"))
            rec = decode(e.value, DecisionRecord) if e.value else None
        except (nats.js.errors.KeyNotFoundError, WireError, nats.errors.Error, asyncio.TimeoutError):
            rec = None
        if rec is None:
            self.log.info("no_decision_record", request_id=rid)
            return
        pred = predicted_ttft_ms(rec)
        if pred is None:
            return
        kind = rec.decision.decision
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
