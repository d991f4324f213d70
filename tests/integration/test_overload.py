"""Overload is shed explicitly at the ingress (issue 17, part 2): with ``max_in_flight`` requests in
flight, more get 429 ``overloaded`` with ``Retry-After`` at once (an OpenAI-shaped error), what was
admitted completes exactly, and the moment the load drops a new request is served."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.integration.conftest import stack

pytestmark = pytest.mark.integration

LIMIT = 6
BURST = 30


async def one(st, max_tokens: int) -> tuple[int, dict, dict, float]:
    t0 = time.monotonic()
    body = {"model": "kairos-emulated", "prompt": "overload " * 8, "max_tokens": max_tokens}
    async with st.http.post(st.base + "/v1/completions", json=body) as r:
        return r.status, dict(r.headers), await r.json(content_type=None), time.monotonic() - t0


async def test_overload_is_shed_with_429_and_recovers(nats_url):
    async with stack(nats_url, ingress_overrides={"max_in_flight": LIMIT}) as st:
        # a burst far over the limit: long requests, so the admitted ones are still running when the rest arrive
        outs = await asyncio.gather(*(one(st, max_tokens=120) for _ in range(BURST)))
        ok = [o for o in outs if o[0] == 200]
        shed = [o for o in outs if o[0] == 429]
        assert len(ok) + len(shed) == BURST, [(o[0], o[2]) for o in outs if o[0] not in (200, 429)]
        assert LIMIT <= len(ok) < BURST and shed, (len(ok), len(shed))
        for status, headers, body, elapsed in shed:
            assert headers.get("Retry-After") == "1", headers
            err = body["error"]
            assert err["code"] == "overloaded" and err["type"] == "rate_limit_error" and "overloaded" in err["message"]
            assert elapsed < 1.0, elapsed  # refused at once, not after a bus timeout
        assert all(o[2]["usage"]["completion_tokens"] == 120 for o in ok)
        # the load is gone: the very next request is admitted and served
        status, _, body, elapsed = await one(st, max_tokens=4)
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        assert st.ingress.completions.admitted == 0
        text = await (await st.http.get(st.base + "/metrics")).text()
        line = next(ln for ln in text.splitlines() if ln.startswith("kairos_ingress_overload_shed_total "))
        assert float(line.split()[-1]) == len(shed)
