"""The ingress's HTTP application: routes, the error middleware, and the small endpoints.

=============================  =====================================================================
``POST /v1/completions``       :class:`~.completions.Completions` (admission, validation, the relay)
``POST /v1/chat/completions``  the same, chat
``GET /v1/models``             the served model (with vLLM's ``max_model_len``)
``GET /v1/requests/{id}``      the request's records merged (:func:`~.records.lookup`)
``POST /tokenize``             vLLM's: the prompt's tokens (:class:`~.tokenize.Tokenization`)
``POST /detokenize``           vLLM's: the text of token ids
``GET /version``               vLLM's: ``{"version"}`` (Kairos')
``GET /health``                readiness (:class:`~.readiness.Readiness`)
``POST /v1/admin/nodes/{node}/drain``  an operator's drain of a node (``kairos drain``, issue 33)
``GET /v1/admin/workload``             the recent requests' arrivals and token counts (``kairos plan --from-live``)
``GET /metrics``               Prometheus
``GET /openapi.json``          the OpenAPI 3.1 document of these routes, generated from the models
                               (:func:`~.openai_api.openapi.openapi_document`)
=============================  =====================================================================

Every HTTP error is an OpenAI-shaped JSON body with an :class:`~kairos.contracts.errors.ErrorCode`
(the middleware here; aiohttp's own protocol-level errors in :mod:`.http`): aiohttp's 404/405/413
included, a body declared larger than the limit refused before it is read, and an unexpected
exception a 500 naming an error id found in the log, never the exception. With API keys configured,
every path but ``/health``, ``/metrics``, ``/version`` and ``/openapi.json`` needs one (:func:`~.http.api_key_middleware`).
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import orjson
from aiohttp import web

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime import telemetry
from kairos.services.ingress.completions import Completions
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.http import (REQUEST_ID, STREAM_STARTED, add_retry_after, api_key_middleware, clip,
                                          error_response, http_error)
from kairos.services.ingress.ignored_params import add_ignored_params_header
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.openai_api.openapi import openapi_document
from kairos.services.ingress.openai_api.responses import models_response
from kairos.services.ingress.ports import IngressBus
from kairos.services.ingress.readiness import Readiness
from kairos.services.ingress.records import lookup
from kairos.services.ingress.tokenize import Tokenization, kairos_version

#: a plain decimal number (no ``_``, ``inf``, ``nan`` or hex that :func:`float` also takes)
DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?")
#: ``GET /v1/admin/workload``: the longest window (s) and the most record writes read for it
MAX_WORKLOAD_WINDOW_S = 86_400.0
MAX_WORKLOAD_RECORDS = 500_000
#: the completion endpoints by path (their 413s before the handler are counted as the handler counts its own)
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class IngressApp:
    """The routes and the error middleware of one ingress (module docstring).

    Args:
        cfg: the ingress's configuration (body limit, served model).
        completions, readiness: the completion endpoints and ``/health``.
        tokenization: ``/tokenize``, ``/detokenize`` and ``/version``.
        bus: where the records of ``GET /v1/requests/{id}`` are read.
        metrics, registry: the ingress's metrics and their Prometheus registry.
        api_keys: accepted API keys (empty: the API is open).
        max_model_len: the served model's context length (``GET /v1/models``).
        log: the service's structured logger.
        clock: where ``GET /v1/admin/workload``'s window ends.
    """

    def __init__(self, cfg: IngressConfig, completions: Completions, readiness: Readiness, bus: IngressBus,
                 metrics: IngressMetrics, registry: Any, api_keys: frozenset[str], max_model_len: int,
                 log: Any, tokenization: Tokenization, clock: Clock = SYSTEM_CLOCK) -> None:
        self.cfg, self.completions, self.readiness, self.bus, self.clock = cfg, completions, readiness, bus, clock
        self.tokenization = tokenization
        self.m, self.registry, self.api_keys, self.max_model_len, self.log = (metrics, registry, api_keys,
                                                                              max_model_len, log)

    def build(self) -> web.Application:
        """The aiohttp application (routes bound now: a handler patched on the class before counts)."""
        middlewares = [self.errors]
        if self.api_keys:
            middlewares.append(api_key_middleware(self.api_keys, self.rejected))
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=middlewares)
        app.on_response_prepare.append(add_retry_after)
        app.on_response_prepare.append(add_ignored_params_header)  # X-Kairos-Ignored-Params
        app.router.add_post("/v1/completions", self.completions.completions)
        app.router.add_post("/v1/chat/completions", self.completions.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/requests/{rid}", self.request_info)
        app.router.add_post("/tokenize", self.tokenization.tokenize)
        app.router.add_post("/detokenize", self.tokenization.detokenize)
        app.router.add_get("/version", self.tokenization.version)
        app.router.add_get("/health", self.readiness.health)
        app.router.add_post("/v1/admin/nodes/{node}/drain", self.drain)
        app.router.add_get("/v1/admin/workload", self.workload)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error response is OpenAI-shaped JSON, aiohttp's own 404/405/413 included. A body
        declared larger than the limit (``Content-Length``, not encoded) is refused with 413 before it
        is read, instead of waiting for bytes that may never come."""
        declared = request.content_length
        if declared is not None and declared > self.cfg.max_body_bytes and \
                request.headers.get("Content-Encoding", "identity").lower() in ("", "identity"):
            out = http_error(request, web.HTTPRequestEntityTooLarge(self.cfg.max_body_bytes, declared),
                             self.cfg.max_body_bytes)
            endpoint = ENDPOINTS.get(request.path)
            if endpoint is not None and request.method == "POST":  # counted as the handler counts its own 413
                self.m.requests.labels(endpoint, "413").inc()
            out.force_close()  # the body is never read: the connection cannot be reused
            return out
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return http_error(request, exc, self.cfg.max_body_bytes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # logged with an error id; the client gets that id, not the exception
            if request.get(STREAM_STARTED):
                raise  # headers are out; nothing better to send
            error_id = "err-" + uuid.uuid4().hex[:16]  # the body names no exception; the log has it
            self.log.error("unhandled_error", path=request.path, method=request.method, error=repr(exc),
                           error_id=error_id, request_id=request.get(REQUEST_ID), exc_info=exc)
            return error_response(ErrorCode.INTERNAL_ERROR, f"internal error in the ingress (error id {error_id})")

    def rejected(self, request: web.Request, reason: str) -> None:
        """An API key was missing or wrong (counted, logged without the key)."""
        self.m.auth_failures.labels(reason).inc()
        self.log.info("api_key_rejected", reason=reason, path=request.path, client=request.remote)

    async def models(self, _req: web.Request) -> web.Response:
        return _json(models_response([self.cfg.served_model], self.max_model_len))

    async def openapi(self, _req: web.Request) -> web.Response:
        """``GET /openapi.json``: the document of every route (public, as vLLM's: what it describes is no secret)."""
        return _json(openapi_document(kairos_version(), self.cfg.served_model, bool(self.api_keys),
                                      self.completions.vocab_size))

    async def metrics(self, _req: web.Request) -> web.Response:
        body, ctype = telemetry.metrics_body(self.registry)
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def request_info(self, request: web.Request) -> web.Response:
        """``GET /v1/requests/{id}``: what happened to a request (kairos/services/ingress/records.py)."""
        rid = request.match_info["rid"]
        try:
            S.check_token(rid, "request id")
        except ValueError as exc:
            return error_response(ErrorCode.INVALID_REQUEST_ID, str(exc))
        record = await lookup(rid, self.bus)
        if record is None:
            return error_response(ErrorCode.NOT_FOUND,
                                  f"no record of request {rid!r} (unknown, or older than the record TTL)")
        return _json(record)


    async def drain(self, request: web.Request) -> web.Response:
        """``POST /v1/admin/nodes/{node}/drain``: ask a node of the cluster view to drain — take nothing
        new, finish what it runs (``KAIROS_DRAIN_TIMEOUT_S``), move the rest, exit (kairos/services/
        node_agent/drain.py). 202 once the request went out; 404 ``not_found`` for a node the view does
        not have; 503 ``bus_unavailable`` when NATS did not take it. Needs an API key when keys are set."""
        node = request.match_info["node"]
        view = self.readiness.ready
        known = {n.node: n for n in view.nodes if not n.stale} if view is not None else {}
        if node not in known:
            silent = {n.node for n in view.nodes if n.stale} if view is not None else set()
            why = "is silent (no heartbeat: stopped or gone), nothing to drain" if node in silent else \
                "is not in the cluster view"
            return error_response(ErrorCode.NOT_FOUND, f"node {clip(node, 140)!r} {why} (live nodes: "
                                                        f"{', '.join(sorted(known)) or 'none yet'})")
        try:
            await self.bus.drain(node, f"operator via {self.cfg.replica_id}")
        except Exception as exc:  # logged; asking again is harmless (a drain under way goes on)
            self.log.warning("drain_request_failed", node=node, error=repr(exc))
            return error_response(ErrorCode.BUS_UNAVAILABLE, f"the message bus did not confirm the drain request "
                                                             f"to node {node} in time: it may still arrive; GET "
                                                             f"/health lists the draining nodes, asking again is "
                                                             f"harmless")
        self.log.info("drain_requested", node=node, client=request.remote)
        return _json({"node": node, "draining": True, "was_draining": known[node].draining,
                      "drain_timeout_note": "the node finishes its running requests for up to its "
                                            "KAIROS_DRAIN_TIMEOUT_S, moves the rest to other nodes, then exits"},
                     status=202)


    async def workload(self, request: web.Request) -> web.Response:
        """``GET /v1/admin/workload?window_s=600``: the requests that ended in the last ``window_s``
        seconds (1 to :data:`MAX_WORKLOAD_WINDOW_S`) as the workload they made: per request its arrival
        (``arrival_unix_ms``), ``prompt_tokens`` and ``output_tokens`` (delivered) and ``status``, from
        the ingress records of every ingress in the requests bucket (kairos/plan/live.py reads it).
        400 ``invalid_value`` (param ``window_s``) for a bad window; 503 ``bus_unavailable`` when the
        bucket does not answer. Needs an API key when keys are set."""
        from kairos.services.ingress.workload import workload_body

        given = request.query.getall("window_s", ["600"])
        raw = given[0] if len(given) == 1 else ",".join(given)
        window_s = float(raw) if len(given) == 1 and DECIMAL.fullmatch(raw.strip()) else float("nan")
        if not 1 <= window_s <= MAX_WORKLOAD_WINDOW_S:
            return error_response(ErrorCode.INVALID_VALUE, f"window_s must be a number of seconds from 1 to "
                                                           f"{MAX_WORKLOAD_WINDOW_S:g}, got {clip(raw, 40)!r}", "window_s")
        now = self.clock.now_ms()
        try:
            records, truncated = await self.bus.recent_records("ingress", now - window_s * 1000.0, MAX_WORKLOAD_RECORDS)
        except Exception as exc:  # logged; the operator may ask again
            self.log.warning("workload_read_failed", error=repr(exc))
            return error_response(ErrorCode.BUS_UNAVAILABLE, "the requests bucket did not answer; ask again")
        return _json(workload_body(records, now, window_s, truncated))


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
