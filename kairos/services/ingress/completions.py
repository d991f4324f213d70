"""``POST /v1/completions`` and ``POST /v1/chat/completions``: admission, the body, validation, then the relay.

Per request, in order (each refusal an OpenAI-shaped error with its :class:`ErrorCode`, counted in
``kairos_ingress_requests_total{endpoint,status}``):

1. **admission**: with ``max_in_flight`` requests in flight at this replica (streams count until
   their last chunk), 429 ``overloaded`` with ``Retry-After`` at once, before reading the body —
   overload is shed here, explicitly, so what is admitted keeps being served (issue 17: without it
   the bus's 2 s publish timeout turned overload into 503 ``enqueue_failed`` for nearly everyone);
2. **the body**: one identity, gzip or deflate ``Content-Encoding`` (else 415), read within
   ``body_timeout_s`` (408), decodable as its encoding says (400), at most ``max_body_bytes`` (413),
   JSON (400);
3. **validation** (:mod:`.openai_api`): parameters (a chat rendered into its prompt), prompt tokens
   counted, context length; the request (each sub-request of a fan-out: :mod:`.fanout`) must fit one
   NATS message (400 ``prompt_too_large``) — a prompt whose bytes alone are over that limit is
   refused before its tokens are counted (:func:`check_bus_payload_uncounted`: the tokenizer's work
   on a prompt that cannot be routed is spent for nothing, 1.7 s for 3.6 MB), so such a prompt gets
   ``prompt_too_large`` even where it is also over the context length; a ``seed`` a vLLM-CPU engine
   would die of is refused up front. A body of :data:`OFFLOAD_BODY_BYTES` or more is validated in a
   worker thread (``asyncio.to_thread``, as vLLM's server tokenizes off its event loop): rendering a chat
   template and tokenizing a long prompt take seconds (3.6 MB: 1.7 s), during which every stream of
   this replica would otherwise stop; the tokenizer releases the GIL meanwhile
   (:func:`~.openai_api.prompt.encode_ids`);
4. **the relay** (:class:`~.relay.RequestRelay`) under an HTTP server span (which continues the
   client's W3C trace), then the ``request_finished`` log line and the ingress record
   (``<id>.ingress``, :func:`~.records.write_ingress_record`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from opentelemetry.trace import SpanKind, Status, StatusCode

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import encode
from kairos.engines.vllm.api import unsafe_seed
from kairos.runtime import telemetry as T
from kairos.services.ingress.http import (READABLE_ENCODINGS, REQUEST_ID, api_error_response, clip, error_response,
                                          http_error)
from kairos.services.ingress.fanout import FANOUT_HEADER, FanOut, Sub, expand, run_all
from kairos.services.ingress.ignored_params import IGNORED_PARAMS
from kairos.services.ingress.openai_api.params import Endpoint, ParsedRequest
from kairos.services.ingress.openai_api.parse import engine_refusal, prepare_request
from kairos.services.ingress.openai_api.prompt import ChatTemplate, TokenCounter
from kairos.services.ingress.openai_api.responses import ApiError
from kairos.services.ingress.records import write_ingress_record
from kairos.services.ingress.attempts import bus_request
from kairos.services.ingress.relay import Admitted, RelayDeps, RequestRelay
from kairos.services.ingress.request_ids import KAIROS_ID_HEADER, RequestIds, client_request_id

#: the span attribute carrying the client's ``X-Request-Id`` (:mod:`.request_ids`)
CLIENT_ID_ATTRIBUTE = "kairos.client_request_id"

#: bytes reserved for the NATS headers of a request (traceparent, tracestate, Nats-Msg-Id)
BUS_HEADER_ALLOWANCE = 1024

#: a request body this large or larger is validated (its chat rendered, its prompt tokenized) in a worker
#: thread, off the event loop; smaller ones in the loop (a thread hop costs more than their validation)
OFFLOAD_BODY_BYTES = 64 * 1024


def bus_size(parsed: ParsedRequest, prompt_tokens: int, exact: bool, block_tokens: int) -> int:
    """Bytes the request takes on the bus: its :class:`InferenceRequest` with the longest ids, with
    its prefix-cache hashes of ``block_tokens`` tokens each, plus :data:`BUS_HEADER_ALLOWANCE`."""
    bt = block_tokens
    n_hashes = 0 if bt <= 0 else (len(parsed.prompt_token_ids) // bt if parsed.prompt_token_ids is not None
                                  else len((parsed.prompt_text or "").encode()) // (4 * bt))
    probe = bus_request(parsed, "x" * 48, prompt_tokens, exact, 0.0, 0.0, [2 ** 63 - 1] * n_hashes, bt)
    return len(encode(probe)) + BUS_HEADER_ALLOWANCE


def _too_large(endpoint: str, size: str, limit: int) -> ApiError:
    field, subject = ("prompt", "The prompt is") if endpoint == "completions" else ("messages", "The messages are")
    return ApiError(ErrorCode.PROMPT_TOO_LARGE, f"{subject} too large to route: the request takes {size} "
                                                f"bytes on the message bus, whose limit (NATS max_payload) is "
                                                f"{limit} bytes. Shorten the {field}.", param=field)


def check_bus_payload(parsed: ParsedRequest, prompt_tokens: int, exact: bool, endpoint: str, limit: int,
                      block_tokens: int) -> None:
    """The request must fit one NATS message (``limit``: the server's ``max_payload``, 1 MiB by
    default; 0: unknown, no check), with its prefix-cache hashes of ``block_tokens`` tokens each.

    Raises:
        ApiError: 400 ``prompt_too_large`` naming both sizes.
    """
    if limit and (size := bus_size(parsed, prompt_tokens, exact, block_tokens)) > limit:
        raise _too_large(endpoint, str(size), limit)


def check_bus_payload_uncounted(parsed: ParsedRequest, endpoint: str, limit: int, block_tokens: int) -> None:
    """:func:`check_bus_payload` before the prompt's tokens are counted (no tokenizer work), on a
    lower bound of the size: the request with 0 prompt tokens, ``exact`` and ``max_tokens`` 0 (the
    count and the resolved ``max_tokens`` only add digits; the prompt, ids and hashes are already
    what they will be). Only a request that cannot fit whatever its count is refused, with the same
    error (the size as "at least").

    Raises:
        ApiError: 400 ``prompt_too_large`` naming both sizes.
    """
    if limit and (size := bus_size(replace(parsed, max_tokens=0), 0, True, block_tokens)) > limit:
        raise _too_large(endpoint, f"at least {size}", limit)


class Completions:
    """The two completion endpoints (module docstring).

    Args:
        deps: what the relays share (configuration, in-flight registry, bus, metrics, clocks).
        tracer: the OpenTelemetry tracer of the server spans.
        log: the service's structured logger.
        counter, vocab_size, chat_template, max_model_len: the served model's tokenizer (None: the
            estimate), vocabulary size, chat template (None: the fixed one) and context length.
    """

    def __init__(self, deps: RelayDeps, tracer: Any, log: Any, counter: TokenCounter | None, vocab_size: int,
                 chat_template: ChatTemplate | None, max_model_len: int) -> None:
        self.d, self.cfg, self.m, self.tracer, self.log = deps, deps.cfg, deps.metrics, tracer, log
        self.counter, self.vocab_size, self.chat_template = counter, vocab_size, chat_template
        self.max_model_len = max_model_len
        self.admitted = 0  #: completion requests admitted and not finished (cfg.max_in_flight)
        self.port: int | None = None  #: the HTTP port (span attribute), once listening

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._admit(request, "chat")

    async def _admit(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Admission (module docstring, 1), then :meth:`_serve`."""
        limit = self.cfg.max_in_flight
        if limit and self.admitted >= limit:
            self.m.requests.labels(endpoint, "429").inc()
            self.m.shed.inc()
            after = self.cfg.overload_retry_after_s
            return error_response(ErrorCode.OVERLOADED, f"the server is overloaded ({limit} requests in flight at this "
                                                        f"ingress); retry after {after} s",
                                  headers={"Retry-After": str(after)})
        self.admitted += 1
        try:
            return await self._serve(request, endpoint)
        finally:
            self.admitted -= 1

    async def _read(self, request: web.Request, endpoint: Endpoint) -> tuple[Any, int] | web.Response:
        """The body as JSON and its size in bytes (module docstring, 2), or the error answer."""
        encodings = request.headers.getall("Content-Encoding", [])
        if any(e.strip().lower() not in READABLE_ENCODINGS for e in encodings) or len(encodings) > 1:
            # aiohttp decodes exactly one gzip or deflate; anything else would be read as it is
            self.m.requests.labels(endpoint, "415").inc()
            out = error_response(ErrorCode.UNSUPPORTED_CONTENT_ENCODING,
                                 f"unsupported Content-Encoding {clip(', '.join(encodings), 60)!r}: the ingress reads "
                                 "request bodies sent as identity, gzip or deflate (one encoding)")
            out.force_close()  # the body is unread
            return out
        try:
            async with asyncio.timeout(self.cfg.body_timeout_s):  # no task per request (wait_for makes one)
                raw = await request.read()
            return orjson.loads(raw), len(raw)
        except web.HTTPRequestEntityTooLarge as exc:
            self.m.requests.labels(endpoint, "413").inc()
            return http_error(request, exc, self.cfg.max_body_bytes)
        except asyncio.TimeoutError:
            self.m.requests.labels(endpoint, "408").inc()
            out = error_response(ErrorCode.REQUEST_TIMEOUT,
                                 f"the request body was not received within {self.cfg.body_timeout_s:g} s")
            out.force_close()
            return out
        except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip on a body that is not gzip
            self.m.requests.labels(endpoint, "400").inc()
            enc = clip(request.headers.get("Content-Encoding", "identity"), 20)
            out = error_response(ErrorCode.INVALID_CONTENT_ENCODING,
                                 f"the request body could not be read as its Content-Encoding ({enc}) says: "
                                 f"{clip(str(exc).splitlines()[-1].strip(), 200)}")
            out.force_close()  # the rest of the body is unread
            return out
        except orjson.JSONDecodeError as exc:
            self.m.requests.labels(endpoint, "400").inc()
            return error_response(ErrorCode.INVALID_JSON, f"request body is not valid JSON: {exc}")
        except ConnectionResetError:  # the client hung up before its body was complete: nobody reads an answer
            self.m.requests.labels(endpoint, "499").inc()
            self.m.disconnects.labels(endpoint, "false").inc()
            self.log.info("client_disconnected_during_body", endpoint=endpoint, client=request.remote)
            out = error_response(ErrorCode.CLIENT_DISCONNECTED, "client closed the connection before the body ended")
            out.force_close()
            return out

    def _validate(self, body: Any, endpoint: Endpoint) -> tuple[ParsedRequest, int, bool]:
        """Module docstring, 3 (:func:`~.openai_api.parse.prepare_request`, the bus limit's lower bound
        checked before the count). Raises: ApiError."""
        limit, bt = self.d.bus.max_payload, self.cfg.prefix_block_tokens

        def each_prompt_fits(parsed: ParsedRequest) -> None:  # before the tokenizer's work
            for text, ids in ((parsed.prompt_text, parsed.prompt_token_ids), *parsed.more_prompts):
                one = replace(parsed, prompt_text=text, prompt_token_ids=ids, more_prompts=())
                check_bus_payload_uncounted(one, endpoint, limit, bt)

        parsed, prompt_tokens, exact = prepare_request(
            endpoint, body, [self.cfg.served_model], self.counter, self.max_model_len, self.cfg.default_max_tokens,
            self.vocab_size, self.chat_template, before_count=each_prompt_fits)
        check_bus_payload(parsed, prompt_tokens, exact, endpoint, limit, bt)
        if self.cfg.engine_kind == "vllm-cpu" and (why := unsafe_seed(parsed.sampling)) is not None:
            raise ApiError(ErrorCode.UNSUPPORTED_VALUE, why, param="seed")  # before any engine sees it
        if (refusal := engine_refusal(parsed, self.cfg.engine_kind)) is not None:  # response_format on emulated
            raise refusal
        return parsed, prompt_tokens, exact

    def _prepare(self, body: Any, endpoint: Endpoint) -> tuple[ParsedRequest, int, bool, list[Sub] | None]:
        """:meth:`_validate`, then the fan-out's sub-requests (None: one request), each its own bus
        message that must fit (a later prompt of a batch, a later choice's seed). Raises: ApiError."""
        parsed, prompt_tokens, exact = self._validate(body, endpoint)
        if parsed.fanout == 1:
            return parsed, prompt_tokens, exact, None
        subs = expand(parsed, prompt_tokens, exact, self.counter, self.max_model_len)
        for s in subs[1:]:
            check_bus_payload(s.parsed, s.prompt_tokens, s.exact, endpoint, self.d.bus.max_payload,
                              self.cfg.prefix_block_tokens)
        return parsed, prompt_tokens, exact, subs

    async def _serve(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        received = self.d.clock.now_ms()
        read = await self._read(request, endpoint)
        if isinstance(read, web.Response):
            return read
        body, size = read
        try:
            client_id = client_request_id(request.headers)
            if size >= OFFLOAD_BODY_BYTES:  # off the event loop (module docstring, 3)
                parsed, prompt_tokens, exact, subs = await asyncio.to_thread(self._prepare, body, endpoint)
            else:
                parsed, prompt_tokens, exact, subs = self._prepare(body, endpoint)
        except ApiError as exc:
            self.m.requests.labels(endpoint, str(exc.status)).inc()
            return api_error_response(exc)
        if subs is not None:
            return await self._serve_fanout(request, endpoint, subs, client_id, received)
        ids = RequestIds.new(endpoint, client_id)
        rid = ids.internal
        request[REQUEST_ID] = rid
        request[IGNORED_PARAMS] = parsed.ignored  # X-Kairos-Ignored-Params (ignored_params.py)
        self.m.inflight.inc()
        timing: dict = {"received_unix_ms": received, "prompt_tokens": prompt_tokens, "client_request_id": client_id}
        # HTTP server span: continues the client's trace if it sent a W3C traceparent
        with self.tracer.start_as_current_span(
                "ingress.request", context=T.extract_context(request.headers), kind=SpanKind.SERVER,
                start_time=int(received * 1e6), attributes={
                    T.REQUEST_ID: rid, "http.request.method": request.method, "http.route": request.path,
                    "url.path": request.path, "url.scheme": request.scheme, "server.port": self.port or 0,
                    "client.address": request.remote or "", "user_agent.original": request.headers.get("User-Agent", ""),
                    T.GEN_AI_OPERATION_NAME: "text_completion" if endpoint == "completions" else "chat",
                    T.GEN_AI_REQUEST_MODEL: parsed.model, T.GEN_AI_REQUEST_MAX_TOKENS: parsed.max_tokens,
                    T.GEN_AI_REQUEST_STREAM: parsed.stream, T.GEN_AI_RESPONSE_ID: ids.response,
                    T.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens, "kairos.prompt_tokens_exact": exact,
                    **({CLIENT_ID_ATTRIBUTE: client_id} if client_id else {})}) as span:
            trace_id = T.trace_id_of(span)
            log = self.log.bind(request_id=rid, **({"client_request_id": client_id} if client_id else {}),
                                **T.trace_fields(span))
            status = 500
            resp: web.StreamResponse | None = None
            admitted = Admitted(request, parsed, ids, int(received / 1000), prompt_tokens, exact, received, timing,
                                log, trace_id)
            try:
                resp, status = await RequestRelay(self.d, admitted).run()
                return resp
            finally:
                self._finished(span, resp, status, endpoint, parsed, admitted.headers(), timing, log)

    async def _serve_fanout(self, request: web.Request, endpoint: Endpoint, subs: list[Sub], client_id: str | None,
                            received: float) -> web.StreamResponse:
        """``n`` > 1 or a batched prompt (:mod:`.fanout`): one relay per sub-request under one server
        span, one merged answer; each sub-request's record and log line, the HTTP request counted once."""
        first = RequestIds.new(endpoint, client_id)
        ids = [first] + [RequestIds(RequestIds.new(endpoint, None).internal, first.response, client_id)
                         for _ in subs[1:]]
        request[REQUEST_ID] = first.internal
        request[IGNORED_PARAMS] = subs[0].parsed.ignored
        headers = {**first.headers(), FANOUT_HEADER: ",".join(i.internal for i in ids)}
        fan = FanOut(request, subs[0].parsed, first.response, int(received / 1000), headers, subs)
        with self.tracer.start_as_current_span(
                "ingress.request", context=T.extract_context(request.headers), kind=SpanKind.SERVER,
                start_time=int(received * 1e6), attributes={
                    T.REQUEST_ID: first.internal, "http.route": request.path, "kairos.fanout": len(subs),
                    T.GEN_AI_REQUEST_MODEL: subs[0].parsed.model, T.GEN_AI_RESPONSE_ID: first.response}) as span:
            relays, admitted = {}, []
            for s, sid in zip(subs, ids):
                self.m.inflight.inc()
                timing = {"received_unix_ms": received, "prompt_tokens": s.prompt_tokens, "client_request_id": client_id}
                log = self.log.bind(request_id=sid.internal, choice_index=s.index, **T.trace_fields(span))
                a = Admitted(request, s.parsed, sid, int(received / 1000), s.prompt_tokens, s.exact, received, timing,
                             log, T.trace_id_of(span))
                admitted.append(a)
                relays[s.index] = RequestRelay(self.d, a, answer=fan.answer(s.index))
            resp, status = fan.failed or (error_response(ErrorCode.INTERNAL_ERROR, "fan-out did not run"), 500)
            try:
                resp, status = await run_all(fan, relays)
                return resp
            finally:
                for s, a in reversed(list(zip(subs, admitted))):  # the first's ids stay in the headers
                    own = fan.statuses.get(s.index, status)  # its relay's: 499 if it was stopped
                    self._finished(span, resp, own, endpoint, a.parsed, a.headers(), a.timing, a.log, count=False)
                if not resp.prepared:
                    resp.headers[FANOUT_HEADER] = headers[FANOUT_HEADER]
                span.set_attribute("http.response.status_code", status)
                self.m.requests.labels(endpoint, str(status)).inc()

    def _finished(self, span: Any, resp: web.StreamResponse | None, status: int, endpoint: Endpoint,
                  parsed: ParsedRequest, id_headers: dict[str, str], timing: dict, log: Any,
                  count: bool = True) -> None:
        """The request ended with ``status``: its span's attributes, metrics, log line and record."""
        received = timing["received_unix_ms"]
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
            resp.headers.update(id_headers)
        self.m.inflight.dec()
        if count:  # a fan-out's sub-requests: the HTTP request is counted once (fanout.py)
            self.m.requests.labels(endpoint, str(status)).inc()
        timing["status"] = status
        now = self.d.clock.now_ms()
        timing.setdefault("finished_unix_ms", now)  # an error answer finishes the request too
        first, done = timing.get("first_token_unix_ms"), timing.get("finished_unix_ms")
        log.info("request_finished", status=status, endpoint=endpoint, prompt_tokens=timing["prompt_tokens"],
                 completion_tokens=timing.get("completion_tokens"), error=timing.get("error"),
                 ttft_ms=None if first is None else round(first - received, 3),
                 e2e_ms=round((done or now) - received, 3))
        rid = id_headers[KAIROS_ID_HEADER]
        self.d.bg.spawn(write_ingress_record(self.d.bus, rid, timing, self.m, log=self.log), "write_ingress_record")
