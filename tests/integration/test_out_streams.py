"""The ingress's token-stream routing (``kairos.out.<id>`` → the request's HTTP response): one
``kairos.out.*`` subscription dispatched by request id (the default) or one subscription per
request (``out_wildcard=False``). Concurrent requests with different lengths must each get exactly
their own tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.conftest import stack

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("wildcard", [True, False], ids=["wildcard", "per_request"])
async def test_concurrent_streams_get_their_own_tokens(nats_url, wildcard):
    async with stack(nats_url, ingress_overrides={"out_wildcard": wildcard}) as st:
        subs_before = len(st.ingress.nc._subs)

        async def one(k: int) -> tuple[int, str, list[dict]]:
            url = st.base + "/v1/completions"
            body = {"model": "kairos-emulated", "prompt": f"request number {k} " * k, "max_tokens": k,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with st.http.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                rid = r.headers["X-Request-Id"]
                payloads = [line.strip()[6:].decode() async for line in r.content if line.startswith(b"data: ")]
            assert payloads[-1] == "[DONE]"
            return k, rid, [json.loads(p) for p in payloads[:-1]]

        results = await asyncio.gather(*(one(k) for k in range(1, 13)))
        for k, rid, chunks in results:
            texts = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
            assert len(texts) == k, (k, texts)  # no token of another request, none lost
            assert {c["id"] for c in chunks} == {rid}
            assert chunks[-1]["usage"]["completion_tokens"] == k
        # per-request subscriptions are gone once their requests ended; the wildcard one stays
        assert len(st.ingress.nc._subs) == subs_before
        assert not st.ingress.flights
