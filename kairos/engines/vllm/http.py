"""The vLLM backend's HTTP side: every call the node agent makes to its vLLM OpenAI server.

:class:`EngineClient` holds one aiohttp session to the server (``Authorization: Bearer <key>`` on
every call when the server has a key: kairos/engines/vllm/launch.py ``VllmServer.api_key``) and knows vLLM
0.32.0's answers: ``GET /v1/models`` (readiness and the served model's id), ``GET /health`` (the
probe of a late state stream), ``POST /v1/completions`` as one JSON answer (a keep-path prefill)
or as a server-sent event stream (decodes and deflected prefills; lines parsed by
:func:`kairos.engines.vllm.api.parse_sse_line`), and the background KV release of a decode that failed
before reading its blocks (:func:`kairos.engines.vllm.api.kv_release_body`). The request bodies are built
in :mod:`kairos.engines.vllm.api`; what the answers mean for a request's life is
:class:`kairos.engines.vllm.backend.VllmBackend`'s business.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import structlog

from kairos.engines.vllm.api import EngineApiError, StreamDelta, engine_error, kv_release_body, parse_sse_line

log = structlog.get_logger("kairos.node_agent.vllm")

#: longest wait (s) for the decode server to answer a KV release (:meth:`EngineClient.release_kv`)
KV_RELEASE_TIMEOUT_S = 10.0
#: seconds between two readiness checks while the server is loading (:meth:`EngineClient.wait_served_model`)
READY_POLL_S = 0.5


class EngineClient:
    """HTTP client of one vLLM server.

    Args:
        url: the server's base URL (``http://127.0.0.1:8100``).
        api_key: the key the server requires (its ``VLLM_API_KEY``); None: no ``Authorization`` header.
    """

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.releases: set[asyncio.Task] = set()  #: KV releases in flight (:meth:`release_kv`)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout: a long decode streams for minutes; the ingress deadline cancels
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                                  headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def wait_served_model(self, stop: asyncio.Event) -> str | None:
        """Poll ``GET /v1/models`` every :data:`READY_POLL_S` s until the server lists a model (it
        may still be loading); returns its id, or None once ``stop`` is set."""
        warned = False
        while not stop.is_set():
            why = "no model listed yet"
            try:
                async with self.session().get(f"{self.url}/v1/models") as resp:
                    if resp.status == 200:
                        data = (await resp.json()).get("data") or []
                        if data:
                            return data[0]["id"]
                    else:
                        why = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as exc:  # still loading: asked again
                why = repr(exc)
            if not warned:
                log.info("waiting_for_engine", url=self.url, why=why)
                warned = True
            with contextlib.suppress(asyncio.TimeoutError):  # the poll period passed without a stop
                await asyncio.wait_for(stop.wait(), READY_POLL_S)
        return None

    async def healthy(self, timeout_s: float) -> bool:
        """Whether ``GET /health`` answers 200 within ``timeout_s`` seconds."""
        try:
            async with self.session().get(f"{self.url}/health",
                                          timeout=aiohttp.ClientTimeout(total=max(timeout_s, 0.01))) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` (not streamed); the JSON answer.

        Raises:
            EngineHttpError: a non-200 answer (vLLM's status and message).
            EngineApiError: a 200 answer that is not JSON.
            aiohttp.ClientError: the connection failed.
        """
        async with self.session().post(f"{self.url}/v1/completions", json=body) as resp:
            return await _json_or_raise(resp)

    async def tokenize(self, model: str, text: str) -> list[int]:
        """``POST /tokenize`` (vLLM's): ``text``'s token ids as this server tokenizes a completion
        prompt (special tokens added as ``/v1/completions`` adds them).

        Raises:
            EngineHttpError: a non-200 answer. EngineApiError: an answer without ``tokens``.
            aiohttp.ClientError: the connection failed.
        """
        async with self.session().post(f"{self.url}/tokenize", json={"model": model, "prompt": text}) as resp:
            out = await _json_or_raise(resp)
        tokens = out.get("tokens")
        if not isinstance(tokens, list):
            raise EngineApiError(f"/tokenize answered without tokens: {str(out)[:200]}")
        return [int(t) for t in tokens]

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[StreamDelta]:
        """``POST /v1/completions`` with ``"stream": true`` in ``body``: each event of the answer as a
        :class:`~kairos.engines.vllm.api.StreamDelta` (comments, blank lines and ``[DONE]`` skipped).

        Raises:
            EngineHttpError: a non-200 answer, or an error object inside the stream.
            aiohttp.ClientError: the connection failed or broke.
        """
        async with self.session().post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                await _json_or_raise(resp)
            async for raw in resp.content:
                d = parse_sse_line(raw.decode("utf-8", "replace"))
                if d is not None:
                    yield d

    def release_kv(self, rid: str, kv_params: dict[str, Any]) -> None:
        """Free the prefill node's KV blocks of a decode that failed before reading them, now rather
        than at the end of their NIXL lease (:func:`kairos.engines.vllm.api.kv_release_body`; a background
        task in :attr:`releases`, never raises)."""
        async def release() -> None:
            try:
                async with self.session().post(f"{self.url}/v1/completions", json=kv_release_body(kv_params),
                                               timeout=aiohttp.ClientTimeout(total=KV_RELEASE_TIMEOUT_S)) as resp:
                    await resp.read()
                    log.info("remote_kv_released", request_id=rid, status=resp.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the lease frees them later
                log.warning("remote_kv_release_failed", request_id=rid, error=repr(exc))
        task = asyncio.get_running_loop().create_task(release(), name=f"vllm-release:{rid}")
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)


async def _json_or_raise(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    """The JSON body of a 200 answer.

    Raises:
        EngineHttpError: any other status (with vLLM's error message).
        EngineApiError: the body is not JSON.
    """
    text = await resp.text()
    if resp.status != 200:
        raise engine_error(resp.status, text)
    try:
        return json.loads(text)
    except ValueError:
        raise EngineApiError(f"not JSON: {text[:200]!r}") from None
