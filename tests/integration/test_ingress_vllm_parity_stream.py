"""The ingress's streams and request ids as vLLM 0.32's server has them (issue 20), through the whole
stack: real nats-server, dispatchers, emulated node agents, keep and deflect paths.

* **Stream end** (``vllm/entrypoints/openai/completion/serving.py`` ``completion_stream_generator``,
  ``.../chat_completion/serving.py`` ``chat_completion_stream_generator``): one chunk per engine
  output — with the emulated engine one token each —, the ``finish_reason`` on the last token's
  chunk and on no other, no chunk after it but the usage chunk (``choices: []``,
  ``stream_options.include_usage``), then ``data: [DONE]``. Chat: one more chunk first, the role
  with ``content: ""``.
* **X-Request-Id** (``vllm/entrypoints/serve/engine/serving.py`` ``_base_request_id``): the response
  ``id`` is ``cmpl-<header>`` / ``chatcmpl-<header>``, the header echoed; two requests with the
  same header are still two executions (own internal ids, decisions, records).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.conftest import get_record, stack

MODEL = "kairos-emulated"
N = 7  #: output tokens per request (max_tokens; the emulated engine ends with "length")


async def sse(st, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, list]:
    """POST ``body`` to ``path``; (status, response headers, the SSE data payloads, ``[DONE]`` as is)."""
    async with st.http.post(st.base + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/event-stream"
        events: list = []
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status, r.headers.copy(), events


def check_stream(events: list, chat: bool, include_usage: bool, n: int) -> None:
    """The vLLM 0.32 shape of a stream of ``n`` one-token outputs ending with ``length``."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks.pop() if include_usage else None
    if usage is not None:
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == n
    assert all(c["choices"] for c in chunks), "only the usage chunk has no choice"
    if chat:
        role = chunks.pop(0)["choices"][0]
        assert role["delta"] == {"role": "assistant", "content": ""} and role["finish_reason"] is None
    # as many chunks as tokens: the finish reason rides on the last one, no extra empty chunk
    assert len(chunks) == n, [c["choices"][0] for c in chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (n - 1) + ["length"]
    texts = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
    assert all(t for t in texts), "every chunk carries its token's text (the last one too)"
    ids = {c["id"] for c in events[:-1]}
    assert len(ids) == 1


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_streams_end_with_the_finish_reason_on_the_last_token_chunk(nats_url, policy):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy=policy) as st:
        for chat in (False, True):
            for include_usage in (False, True):
                body: dict = {"model": MODEL, "max_tokens": N, "stream": True}
                if include_usage:
                    body["stream_options"] = {"include_usage": True}
                if chat:
                    body["messages"] = [{"role": "user", "content": "tell me a story"}]
                else:
                    body["prompt"] = "tell me a story"
                path = "/v1/chat/completions" if chat else "/v1/completions"
                _, _, events = await sse(st, path, body)
                check_stream(events, chat, include_usage, N)


async def test_two_requests_with_the_same_x_request_id_are_two_executions_each_answered_with_it(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        hdr = {"X-Request-Id": "client-req:42"}
        body = {"model": MODEL, "prompt": "same id twice", "max_tokens": 3}

        async def plain() -> tuple[dict, dict]:
            async with st.http.post(st.base + "/v1/completions", json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
                return r.headers.copy(), await r.json()

        (h1, b1), (h2, b2) = await asyncio.gather(plain(), plain())
        for h, b in ((h1, b1), (h2, b2)):  # what vLLM answers for the header
            assert b["id"] == "cmpl-client-req:42" and h["X-Request-Id"] == "client-req:42"
        internal = {h1["X-Kairos-Request-Id"], h2["X-Kairos-Request-Id"]}
        assert len(internal) == 2, "each request has its own execution"
        for rid in internal:  # each was routed and served on its own, and its record names the client's id
            rec = await get_record(st, rid, lambda r: r["records"]["ingress"] is not None and r["decision"])
            assert rec["client_request_id"] == "client-req:42" and rec["records"]["ingress"]["status"] == 200

        # streaming, chat: the chunks' id; concurrent again
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        (_, s1, e1), (_, s2, e2) = await asyncio.gather(sse(st, "/v1/chat/completions", chat, hdr),
                                                        sse(st, "/v1/chat/completions", chat, hdr))
        assert {c["id"] for c in e1[:-1] + e2[:-1]} == {"chatcmpl-client-req:42"}
        assert s1["X-Request-Id"] == s2["X-Request-Id"] == "client-req:42"
        assert s1["X-Kairos-Request-Id"] != s2["X-Kairos-Request-Id"]

        # without the header: the id the client sees is the internal one, in both headers
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            out = await r.json()
            assert out["id"] == r.headers["X-Request-Id"] == r.headers["X-Kairos-Request-Id"]

        # a bad header: 400 naming it, before anything is queued
        async with st.http.post(st.base + "/v1/completions", json=body, headers={"X-Request-Id": "a b"}) as r:
            err = await r.json()
            assert r.status == 400 and err["error"]["param"] == "X-Request-Id", err
            assert err["error"]["code"] == "invalid_request_id"
