"""The ingress's OpenAI surface: models, health, metrics, OpenAI-shaped errors."""

from __future__ import annotations

import pytest

from tests.integration.conftest import get_record, poll_health, stack

pytestmark = pytest.mark.integration


async def test_models_health_metrics_and_errors(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        async with st.http.get(st.base + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "kairos-emulated"
        # /health is readiness: it may answer 503 for a moment after the stack is up (every node in the
        # views), e.g. ``no_dispatcher`` until the dispatcher's first pull request waits (seen in CI)
        assert (await poll_health(st.base, st.http, 200, 10))["status"] == "ok"
        status, body = await st.complete("x", max_tokens=2)
        assert status == 200
        async with st.http.get(st.base + "/metrics") as r:
            text = await r.text()
            assert 'kairos_ingress_requests_total{endpoint="completions",status="200"} 1.0' in text

        cases = [
            ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
            ({"model": "kairos-emulated"}, 400, "missing_required_parameter"),
            ({"model": "kairos-emulated", "prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
            ({"model": "kairos-emulated", "prompt": "x", "logprobs": 1}, 400, "unsupported_value"),  # emulated engines
            ({"model": "kairos-emulated", "prompt": [1, 2], "max_tokens": 10 ** 6}, 400, "context_length_exceeded"),
        ]
        for body, want_status, want_code in cases:
            async with st.http.post(st.base + "/v1/completions", json=body) as r:
                got = await r.json()
                assert r.status == want_status, (body, got)
                assert got["error"]["code"] == want_code and got["error"]["message"], got
        async with st.http.post(st.base + "/v1/completions", data=b"{not json") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with st.http.get(st.base + "/v1/requests/cmpl-doesnotexist") as r:
            assert r.status == 404 and "error" in await r.json()


async def test_no_nodes_gives_explicit_503(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", no_node_wait_s=0.3) as st:
        await st.kill_agent("decode-0")
        await st.kill_agent("prefill-0")
        async with st.http.post(st.base + "/v1/completions", json={"model": "kairos-emulated", "prompt": "x",
                                                                  "max_tokens": 2}) as r:
            status, body, rid = r.status, await r.json(), r.headers.get("X-Request-Id")
        assert status == 503 and body["error"]["code"] == "no_available_node", body
        # the failed request has an id, and its record says what the client got and when it ended
        assert rid is not None and rid.startswith("cmpl-")
        rec = await get_record(st, rid, lambda r: r["records"]["ingress"] is not None)
        ing = rec["records"]["ingress"]
        assert (ing["status"], ing["error"], ing["error_message"]) == (503, "no_available_node", body["error"]["message"])
        assert ing["finished_unix_ms"] is not None and ing["finished_unix_ms"] >= ing["received_unix_ms"]
