"""An API key on every route of a vLLM server that only its node agent may use (issue 16 §5).

vLLM 0.32.0 checks ``--api-key`` / ``$VLLM_API_KEY`` only on paths starting with ``/v1``, ``/v2``,
``/inference`` or ``/cohere`` (``GUARDED_PREFIX``, ``vllm/entrypoints/serve/middleware/authenticate.py``
line 11). Other routes it serves run the model without a key: ``POST /invocations`` (SageMaker,
``vllm/entrypoints/serve/sagemaker/api_router.py`` line 99) takes a completion or chat body —
``kv_transfer_params`` and ``seed`` included, so a client on the machine could kill the engine
through it — and ``/tokenize``, ``/detokenize``, ``/pooling``, ``/score`` … also answer anyone.

:class:`RequireApiKey` is loaded by ``--middleware kairos.engines.vllm.plugin.auth.RequireApiKey`` (vLLM adds a
class with ``app.add_middleware``, ``vllm/entrypoints/serve/middleware/register.py`` line 65) and
refuses every request but :data:`OPEN_PATHS` without ``Authorization: Bearer $VLLM_API_KEY``: 401,
vLLM's own body ``{"error": "Unauthorized"}``. Keys are compared as SHA-256 digests with
``hmac.compare_digest``, as vLLM does. Pure ASGI (no ``BaseHTTPMiddleware``): a streamed
completion passes through untouched, and the client disconnect that makes vLLM abort a request
still reaches it. Without ``$VLLM_API_KEY`` it lets everything through.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Awaitable, Callable

#: answered without a key: liveness probes (``/health``, SageMaker's ``/ping``), Prometheus's
#: ``/metrics`` (``kairos up`` lists every server's in its scrape targets) and ``/version``; none
#: of them runs the model
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
#: the environment variable holding the key (the one vLLM's own middleware reads)
KEY_ENV = "VLLM_API_KEY"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class RequireApiKey:
    """ASGI middleware: every HTTP or websocket request outside :data:`OPEN_PATHS` (and not an
    ``OPTIONS`` preflight) must carry ``Authorization: Bearer <key>``, the key being ``key`` or,
    when None, ``$VLLM_API_KEY`` read once at construction; otherwise 401. No key at all: a no-op."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV)
        self._digest = _digest(key) if key else None

    def allowed(self, scope: Scope) -> bool:
        """Whether the request ``scope`` (ASGI) may pass."""
        if self._digest is None or scope.get("type") not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return True
        if scope["path"].removeprefix(scope.get("root_path", "")) in OPEN_PATHS:
            return True
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
