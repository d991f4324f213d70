"""Ingress: OpenAI HTTP in, requests onto the JetStream work queue, token stream back out.

Per request: validate (:mod:`shared.openai_api`), count prompt tokens, assign the id, subscribe to
``kairos.out.<id>`` *before* publishing (so no token can be missed), publish the
:class:`~shared.wire.InferenceRequest` with the W3C trace context in the headers, then relay events.
Streaming responses send their HTTP headers only when the first token arrives, so an error before
it still gets a proper 4xx/5xx status. Every accepted request ends with a completion or an
OpenAI-shaped error: dispatcher/agent errors are relayed, silence past ``idle_timeout_s`` or
``request_timeout_s`` becomes 504 (and a cancel to the nodes).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import nats.errors
import nats.js.errors
import orjson
from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Gauge, Histogram

from services.ingress.config import IngressConfig
from shared import openai_api as oa
from shared import subjects as S
from shared import telemetry
from shared.bus import close as bus_close
from shared.bus import connect, ensure_buckets, publish
from shared.latency import load_profile
from shared.records import request_record
from shared.routing import routable
from shared.wire import (Cancel, ClusterView, DecisionRecord, DecodeTiming, DoneEvent, ErrorEvent, InferenceRequest, IngressTiming,
                         OutEvent, PrefillTiming, TokenEvent, WireError, decode, encode, now_ms)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _err(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    return _json(oa.error_body(message, oa.error_type_for(status), param, code), status)


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
        self.counter = oa.tokenizer_counter(cfg.tokenizer_path) if cfg.tokenizer_path else None
        self.tel = telemetry.setup("ingress", cfg.replica_id, cfg.trace_file, cfg.log_level, cfg.log_format)
        self.log = self.tel.log
        self.m = _Metrics(self.tel.registry)
        self.port: int | None = None
        self.nc = None
        self._runner = None
        self._tasks: set[asyncio.Task] = set()
        self.view: ClusterView | None = None
        self._view_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/requests/{rid}", self.request_info)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        self.nc = await connect(self.cfg.nats_url, f"ingress:{self.cfg.replica_id}", self.log)
        self.js = self.nc.jetstream()
        self.buckets = await ensure_buckets(self.js)
        self._view_watcher = await self.buckets.view.watch(S.VIEW_KEY)
        self._view_task = asyncio.create_task(self._watch_view(self._view_watcher))
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.log.info("ingress_started", host=self.cfg.host, port=self.port, model=self.cfg.served_model,
                      tokenizer=self.cfg.tokenizer_path or "estimate(ceil(bytes/4))")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._view_task is not None:
            self._view_task.cancel()
            try:
                await self._view_watcher.stop()
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

    # -- simple endpoints ---------------------------------------------------------------------
    async def health(self, _req: web.Request) -> web.Response:
        """Readiness: 200 when connected to NATS and the cluster view has at least one fresh
        prefill and one fresh decode node; the body says what is missing otherwise."""
        connected = self.nc is not None and self.nc.is_connected
        pfs, dcs = routable(self.view)
        age = None if self.view is None else round(now_ms() - self.view.built_unix_ms, 1)
        ok = connected and bool(pfs) and bool(dcs)
        status = "ok" if ok else "nats_disconnected" if not connected else "no_routable_nodes"
        return _json({"status": status, "routable": {"prefill": [n.node for n in pfs], "decode": [n.node for n in dcs]},
                      "view_age_ms": age}, 200 if ok else 503)

    async def _watch_view(self, watcher) -> None:
        async for e in watcher:
            if e is None or not e.value or e.operation is not None:
                continue
            try:
                self.view = decode(e.value, ClusterView)
            except WireError:
                continue

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
        parts = {}
        for part, typ in (("decision", DecisionRecord), ("prefill", PrefillTiming), ("decode", DecodeTiming),
                          ("ingress", IngressTiming)):
            try:
                e = await self.buckets.requests.get(S.record_key(rid, part))
                parts[part] = decode(e.value, typ) if e.value else None
            except (nats.js.errors.KeyNotFoundError, WireError):
                parts[part] = None
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
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            self.m.requests.labels(endpoint, "400").inc()
            return _err(400, f"request body is not valid JSON: {exc}", "invalid_json")
        try:
            parsed = oa.parse_request(endpoint, body, [self.cfg.served_model], self.cfg.default_max_tokens)
            prompt_tokens, exact = oa.count_prompt_tokens(parsed, self.counter)
            oa.check_context(prompt_tokens, parsed.max_tokens, self.max_model_len)
        except oa.ApiError as exc:
            self.m.requests.labels(endpoint, str(exc.status)).inc()
            return _json(exc.body(), exc.status)
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
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

    async def _run(self, request, parsed: oa.ParsedRequest, rid: str, created: int, prompt_tokens: int, exact: bool,
                   received: float, timing: dict, log, trace_id: str | None) -> tuple[web.StreamResponse, int]:
        cfg = self.cfg
        queue: asyncio.Queue[OutEvent] = asyncio.Queue()

        async def on_out(msg) -> None:
            try:
                queue.put_nowait(decode(msg.data, OutEvent))  # type: ignore[arg-type]
            except WireError as exc:
                log.warning("bad_out_event", error=str(exc))

        sub = await self.nc.subscribe(S.out_subject(rid), cb=on_out)
        try:
            deadline = received + cfg.request_timeout_s * 1000.0
            ireq = InferenceRequest(request_id=rid, model=parsed.model, prompt_tokens=prompt_tokens,
                                    max_tokens=parsed.max_tokens, prompt_tokens_exact=exact,
                                    prompt_text=parsed.prompt_text, prompt_token_ids=parsed.prompt_token_ids,
                                    created_unix_ms=received, deadline_unix_ms=deadline)
            headers = telemetry.inject_headers(headers={"Nats-Msg-Id": rid})
            try:
                await self.nc.flush()
                await self.js.publish(S.REQUEST_SUBJECT, encode(ireq), headers=headers, stream=S.REQUEST_STREAM)
            except Exception as exc:
                log.error("enqueue_failed", error=repr(exc))
                timing["error"] = "enqueue_failed"
                return _err(503, f"could not enqueue the request: {exc!r}", "enqueue_failed"), 503

            async def next_event() -> OutEvent | None:
                left = min(cfg.idle_timeout_s, (deadline - now_ms()) / 1000.0)
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    return None

            ev = await next_event()
            if ev is None or isinstance(ev, ErrorEvent):
                return await self._fail_before_first(rid, ev, timing, log)
            text_parts: list[str] = []
            completion = 0
            finish = "length"
            resp: web.StreamResponse | None = None
            first = True
            last_token_ms = 0.0
            while True:
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
                            await resp.prepare(request)
                        if not await self._sse(resp, oa.stream_chunk(parsed, rid, created, ev.text, None, first)):
                            return await self._client_gone(rid, resp, timing, log)
                    else:
                        text_parts.append(ev.text)
                    first = False
                elif isinstance(ev, DoneEvent):
                    finish = ev.finish_reason
                    timing["finish_reason"] = finish
                    break
                elif isinstance(ev, ErrorEvent):
                    timing["error"] = ev.code
                    timing["completion_tokens"] = completion
                    log.warning("request_failed_mid_stream", code=ev.code, message=ev.message)
                    if resp is None:
                        return _err(ev.status, ev.message, ev.code), ev.status
                    await self._sse(resp, oa.error_body(ev.message, oa.error_type_for(ev.status), None, ev.code))
                    await self._sse_done(resp)
                    return resp, ev.status
                ev = await next_event()
                if ev is None:
                    timing["error"] = "timeout"
                    await self._cancel(rid, "timeout")
                    msg = f"request {rid} timed out waiting for tokens"
                    if resp is None:
                        return _err(504, msg, "timeout"), 504
                    await self._sse(resp, oa.error_body(msg, "server_error", None, "timeout"))
                    await self._sse_done(resp)
                    return resp, 504
            timing["finished_unix_ms"] = now_ms()
            timing["completion_tokens"] = completion
            self.m.e2e.observe(telemetry.seconds(timing["finished_unix_ms"] - received))
            if not parsed.stream:
                out = _json(oa.full_response(parsed, rid, created, "".join(text_parts), finish, prompt_tokens,
                                             completion))
                out.headers["X-Request-Id"] = rid
                return out, 200
            assert resp is not None
            await self._sse(resp, oa.stream_chunk(parsed, rid, created, None if parsed.endpoint == "chat" else "",
                                                  finish))
            if parsed.include_usage:
                await self._sse(resp, oa.usage_chunk(parsed, rid, created, prompt_tokens, completion))
            await self._sse_done(resp)
            return resp, 200
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def _fail_before_first(self, rid: str, ev: ErrorEvent | None, timing: dict, log):
        if ev is None:
            timing["error"] = "timeout"
            await self._cancel(rid, "timeout")
            log.warning("request_timeout_before_first_token")
            return _err(504, f"request {rid} timed out before its first token", "timeout"), 504
        timing["error"] = ev.code
        log.warning("request_failed", code=ev.code, message=ev.message, source=ev.source)
        return _err(ev.status, ev.message, ev.code), ev.status

    async def _client_gone(self, rid: str, resp, timing: dict, log):
        timing["error"] = "client_disconnected"
        log.info("client_disconnected")
        await self._cancel(rid, "client_disconnected")
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
