"""The ingress's HTTP layer hardening (docs/security.md): API keys, slow-client timeouts, every
error as OpenAI-shaped JSON (aiohttp's own protocol-level errors and HTTP exceptions included, each
with an :class:`~kairos.contracts.errors.ErrorCode`), bounded echoes, ``Retry-After`` on every 503.

aiohttp specifics (aiohttp 3.14, ``aiohttp/web_protocol.py``): a malformed request line or header
never reaches the application — ``RequestHandler.handle_error`` renders it as ``text/plain``; and
the server has no header read timeout of its own (``keepalive_timeout`` is armed at connection
start but also bounds idle kept-alive connections). :class:`HardenedRunner` serves the
application through :class:`_Handler`, a ``RequestHandler`` subclass that renders those errors
as JSON and drops a connection whose request head is not complete within ``header_timeout_s``.
The body read timeout is the handler's (``asyncio.wait_for`` around ``request.read()``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson
from aiohttp import web
from aiohttp.http_exceptions import (BadStatusLine, ContentEncodingError, ContentLengthError, HttpProcessingError,
                                     InvalidHeader, InvalidURLError, LineTooLong, TransferEncodingError)
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from kairos.contracts.errors import PROTOCOL_CODES, ErrorCode, error_type_for
from kairos.runtime.envconfig import ConfigError
from kairos.services.ingress.openai_api.responses import ApiError, error_body

#: error messages are cut to this many characters (a 1 MB model name must not come back as a 1 MB body)
MAX_ERROR_MESSAGE_CHARS = 1024
#: paths served without an API key (vLLM protects only /v1/*; Kairos everything but probes, scrapers
#: and the version, as the vLLM plugin's own middleware: kairos/engines/vllm/plugin/auth.py; and the
#: OpenAPI document, which vLLM serves without a key too)
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})
#: Content-Encoding values whose request bodies the ingress reads (aiohttp decodes gzip and deflate)
READABLE_ENCODINGS = frozenset({"identity", "gzip", "deflate"})
#: set on a request once its SSE headers are sent (no error response can replace them any more)
STREAM_STARTED = web.RequestKey("kairos_stream_started", bool)
#: set on a completion request once its id is assigned (error logs name it)
REQUEST_ID = web.RequestKey("kairos_request_id", str)


def clip(text: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marking the cut (``… [N more characters]``)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def error_response(code: ErrorCode, message: str, param: str | None = None, *, status: int | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-shaped JSON error (``{"error": {message, type, param, code}}``), message clipped.
    ``status``: the HTTP status, ``code.status`` unless given (an error event's own, an HTTP exception's)."""
    status = code.status if status is None else status
    body = error_body(clip(message), error_type_for(status), param, code)
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def api_error_response(exc: ApiError) -> web.Response:
    """The answer to a request that failed validation (:class:`ApiError`)."""
    return error_response(exc.code, exc.message, exc.param, status=exc.status)


def code_for_status(status: int) -> ErrorCode:
    """The catalogue's code for an HTTP status no handler chose a code for (aiohttp's own errors)."""
    if status in PROTOCOL_CODES:
        return PROTOCOL_CODES[status]
    fallback = ErrorCode.INTERNAL_ERROR if status >= 500 else ErrorCode.BAD_REQUEST
    return next((c for c in ErrorCode if c.status == status), fallback)


def http_error(request: web.Request, exc: web.HTTPException, max_body_bytes: int) -> web.Response:
    """An aiohttp HTTP exception (its own 404/405/413, or one a handler raised) as an OpenAI-shaped
    error of the same status, naming the endpoints (404), the allowed methods (405, with ``Allow``) or
    the body limit ``max_body_bytes`` (413)."""
    if isinstance(exc, web.HTTPNotFound):
        msg, code = (f"Unknown path {clip(request.path, 200)!r}. Endpoints: POST /v1/completions, POST "
                     f"/v1/chat/completions, GET /v1/models, GET /v1/requests/{{id}}, POST /tokenize, POST "
                     f"/detokenize, GET /version, GET /health, GET /metrics, GET /openapi.json, POST "
                     f"/v1/admin/nodes/{{node}}/drain, GET /v1/admin/workload",
                     ErrorCode.NOT_FOUND)
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        msg = (f"Method {request.method} is not allowed for {request.path}; use "
               f"{' or '.join(sorted(exc.allowed_methods))}")
        code = ErrorCode.METHOD_NOT_ALLOWED
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        # a compressed body is limited after decompression: its Content-Length is not the size that counted
        encoded = request.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
        got = (f" (got more than that after decoding the {clip(request.headers['Content-Encoding'], 20)} "
               f"body of {request.content_length} bytes)" if encoded and request.content_length
               else f" (got {request.content_length})" if request.content_length else "")
        msg, code = f"request body is too large: the limit is {max_body_bytes} bytes{got}", ErrorCode.REQUEST_TOO_LARGE
    else:
        msg, code = exc.text or exc.reason, code_for_status(exc.status)
    out = error_response(code, msg, status=exc.status)
    for h in ("Allow", "Retry-After"):
        if h in exc.headers:
            out.headers[h] = exc.headers[h]
    return out


class ApiKeyError(ConfigError):
    """The API key file cannot be read."""


def load_api_keys(keys: Iterable[str], key_file: str | None) -> frozenset[str]:
    """The accepted API keys: ``keys`` plus one per line of ``key_file`` (blank lines and lines
    starting with ``#`` ignored).

    Raises:
        ApiKeyError: the file cannot be read, or names no key.
    """
    out = set(keys)
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ApiKeyError(f"KAIROS_API_KEY_FILE={key_file}: {exc.strerror}") from None
        found = {ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")}
        if not found:
            raise ApiKeyError(f"KAIROS_API_KEY_FILE={key_file} contains no key")
        out |= found
    return frozenset(out)


def api_key_middleware(keys: frozenset[str], on_reject: Callable[[web.Request, str], None] | None = None):
    """Require ``Authorization: Bearer <key>`` with a key of ``keys`` on every path but
    :data:`OPEN_PATHS`; else 401 with an OpenAI-shaped body (``type`` ``invalid_request_error``,
    ``code`` ``invalid_api_key``, as api.openai.com answers; vLLM's own middleware,
    ``vllm/entrypoints/serve/middleware/authenticate.py``, answers ``{"error": "Unauthorized"}``)
    and ``WWW-Authenticate: Bearer`` (RFC 6750). Keys are compared as SHA-256 digests with
    ``hmac.compare_digest`` (as vLLM does); a presented key is never echoed, and one that is not
    UTF-8 (``\\xff``) is just an invalid key (401).
    ``on_reject(request, reason)`` is called for each refusal (``missing`` / ``invalid``)."""
    hashed = [hashlib.sha256(k.encode()).digest() for k in keys]  # equal lengths: nothing leaks by timing

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            reason, msg = "missing", ("You didn't provide an API key. Send it in an Authorization header using "
                                      "Bearer auth (Authorization: Bearer YOUR_KEY).")
        else:
            # the header's raw bytes (aiohttp keeps a non-UTF-8 byte as a surrogate escape, which a
            # plain encode() refuses: that was a 500); a key that is not valid UTF-8 matches no key
            presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
            match = False
            for k in hashed:  # every key compared (no early exit revealing which one matched)
                match |= hmac.compare_digest(presented, k)
            if match:
                return await handler(request)
            reason, msg = "invalid", "Incorrect API key provided."
        if on_reject is not None:
            on_reject(request, reason)
        return error_response(ErrorCode.INVALID_API_KEY, msg, headers={"WWW-Authenticate": "Bearer"})

    return check


async def add_retry_after(request: web.Request, response: web.StreamResponse, seconds: int = 1) -> None:
    """``on_response_prepare`` hook: every 503 carries ``Retry-After`` (RFC 9110 §10.2.3)."""
    if response.status == 503 and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = str(seconds)


class _Handler(RequestHandler):
    """aiohttp's connection handler with a header read timeout and JSON protocol errors."""

    def __init__(self, *args: Any, header_timeout_s: float, on_slow_client: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hdr_timeout = header_timeout_s
        self._hdr_handle: asyncio.TimerHandle | None = None
        self._hdr_count = 0
        self._on_slow = on_slow_client

    def _arm(self) -> None:
        self._hdr_count = self._request_count
        self._hdr_handle = self._loop.call_later(self._hdr_timeout, self._header_deadline)

    def _disarm(self) -> None:
        if self._hdr_handle is not None:
            self._hdr_handle.cancel()
            self._hdr_handle = None

    def _header_deadline(self) -> None:
        self._hdr_handle = None
        if self._request_count == self._hdr_count and not self._request_in_progress:
            if self._on_slow is not None:
                self._on_slow()
            self.force_close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()  # the first request head must arrive within the timeout

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A client's malformed request (aiohttp's ``HttpProcessingError``: a bad header, a broken
        gzip body …) is one warning line naming the error class and status: aiohttp's own record
        is an error with a traceback that quotes the offending bytes — an ``Authorization`` header
        and its token included. Anything else is logged as aiohttp does."""
        exc = kw.get("exc_info")
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):  # the latter: a body that is not its
            # Content-Encoding, answered by the handler, met again by the lingering close that reads the rest
            self.logger.warning("malformed HTTP request refused: %s (HTTP %s)", type(exc).__name__,
                                getattr(exc, "code", 400))
            return
        super().log_exception(*args, **kw)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count != self._hdr_count:
            self._disarm()  # a request head is complete
            self._hdr_count = self._request_count
        elif self._hdr_handle is None and not self._request_in_progress:
            self._arm()  # the next request on a kept-alive connection started arriving

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """Like aiohttp's, but an OpenAI-shaped JSON body, never a traceback or exception name."""
        self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if isinstance(exc, ContentEncodingError):  # e.g. br: the parser has no decoder for it
            resp = error_response(ErrorCode.UNSUPPORTED_CONTENT_ENCODING, "unsupported Content-Encoding: the "
                                  "ingress reads request bodies sent as identity, gzip or deflate")
            resp.force_close()
            return resp
        if status >= 500:
            text = "internal server error" if status == 500 else "the request handler timed out"
        else:
            text = "malformed HTTP request: " + next((what for kind, what in _MALFORMED if isinstance(exc, kind)),
                                                     "not valid HTTP/1.1")
        resp = error_response(code_for_status(status), text, status=status)
        resp.force_close()
        return resp


#: what the answer to a malformed request says, by aiohttp's parser error (most specific first): never
#: the bytes it quotes, which may be an ``Authorization`` header and its key (docs/security.md)
_MALFORMED = ((LineTooLong, "a request line or header over 8,190 bytes"),
              (InvalidHeader, "a header that is not valid HTTP"),
              (InvalidURLError, "a request target that is not a valid URL"),
              (BadStatusLine, "a request line that is not valid HTTP"),
              ((ContentLengthError, TransferEncodingError), "a body whose length framing is broken"))


class _Server(web.Server):
    def __init__(self, *args: Any, header_timeout_s: float, on_slow_client=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hdr = {"header_timeout_s": header_timeout_s, "on_slow_client": on_slow_client}

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._hdr, **self._kwargs)


class HardenedRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`_Handler` (header timeout, JSON errors).

    ``header_timeout_s``: seconds a client has to send a complete request head after connecting
    (or after starting the next request on a kept-alive connection); ``on_slow_client()`` is called
    for each connection dropped for it. Other keyword arguments go to aiohttp's RequestHandler
    (``keepalive_timeout``, ``max_line_size``, ``max_field_size``, ...)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, on_slow_client=None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._hdr = {"header_timeout_s": header_timeout_s, "on_slow_client": on_slow_client}

    async def _make_server(self) -> web.Server:
        srv = await super()._make_server()
        return _Server(srv.request_handler, request_factory=srv.request_factory,
                       handler_cancellation=srv.handler_cancellation, loop=srv._loop, **self._hdr, **srv._kwargs)
