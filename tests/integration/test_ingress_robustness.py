"""The ingress never leaves a request silent: dead nodes, client disconnects, /health, HTTP errors.

Real nats-server and the in-process stack (conftest); nodes are crashed with ``Stack.kill_agent``
(connection dropped, no drain). Waits are on conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import aiohttp
import pytest

from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress
from tests.integration.conftest import fast_model, get_record, poll_health, reset_bus, stack, wait_until

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


async def read_sse(resp: aiohttp.ClientResponse, n: int | None = None) -> list[str]:
    """SSE data payloads: the first ``n`` of them, or all until the stream ends."""
    out: list[str] = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            out.append(line[6:].decode())
            if n is not None and len(out) >= n:
                break
    return out


def holder(st, rid: str, role: str) -> str | None:
    """The node of ``role`` whose agent currently holds request ``rid``."""
    return next((n for n, a in st.agents.items() if a.cfg.role == role and n not in st.dead and rid in a.reqs), None)


@contextlib.asynccontextmanager
async def long_decode_stream(st):
    """A streaming completion (2,000 tokens: it outlives the test's faults), once a decode node
    streams it: yields (the response, its first three SSE payloads, the request id, that node)."""
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "stream": True}
    async with st.http.post(st.base + "/v1/completions", json=body) as r:
        assert r.status == 200
        head = await read_sse(r, 3)
        rid = json.loads(head[0])["id"]
        node = await wait_until(lambda: holder(st, rid, "decode"), 5, "the decode node streaming it")
        yield r, head, rid, node


def counter(c) -> float:
    return c._value.get()


# -- 1. a decode node dies under a streaming request ------------------------------------------------

async def test_with_migration_off_a_decode_node_killed_mid_stream_ends_with_node_lost_error_fast(nats_url):
    # idle timeout 30 s: the error must come from node-loss detection, not from the timeout; migration off
    # (max_migrations 0): with it on the stream moves instead (tests/integration/test_migration.py)
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"max_migrations": 0}) as st:
        async with long_decode_stream(st) as (r, head, rid, node):
            t0 = time.monotonic()
            await st.kill_agent(node)
            rest = await asyncio.wait_for(read_sse(r), 10)
            elapsed = time.monotonic() - t0
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "node_lost" and node in err["message"] and err["type"] == "service_unavailable", err
        assert elapsed < 5, elapsed
        streamed = sum(1 for e in head + rest[:-2] if json.loads(e).get("choices"))
        assert counter(st.ingress.m.node_lost.labels("failed")) == 1
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None)
        ing = rec["records"]["ingress"]
        assert ing["status"] == 503 and ing["error"] == "node_lost"
        assert ing["completion_tokens"] >= streamed > 0  # tokens really sent, not 0


async def test_an_ingress_that_stalled_longer_than_the_liveness_timeout_does_not_call_live_nodes_lost(nats_url):
    # the whole process (ingress and the nodes it watches) stops running for 2.5 liveness timeouts,
    # as a starved machine does; afterwards the nodes' heartbeats are still queued, unread: the
    # stream must go on, not end with node_lost
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0}) as st:
        body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 300, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            head = await read_sse(r, 3)
            time.sleep(2.5)  # the fault: a blocked event loop (not synchronisation)
            rest = await asyncio.wait_for(read_sse(r), 30)
        assert rest[-1] == "[DONE]"
        events = [json.loads(e) for e in head + rest[:-1]]
        assert not [e for e in events if "error" in e], [e for e in events if "error" in e]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert counter(st.ingress.m.node_lost.labels("failed")) == 0


async def test_non_streaming_request_on_a_dead_decode_node_is_resubmitted(nats_url):
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        req = asyncio.ensure_future(st.complete("hello", max_tokens=250))
        rid = await wait_until(lambda: next((r for a in st.agents.values() if a.cfg.role == "decode"
                                             for r, q in a.reqs.items() if q.tokens > 3), None), 10, "decoding")
        node = holder(st, rid, "decode")
        t0 = time.monotonic()
        await st.kill_agent(node)
        status, body = await asyncio.wait_for(req, 20)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 250  # the partial output was discarded, not mixed
        assert counter(st.ingress.m.node_lost.labels("resubmitted")) == 1
        assert time.monotonic() - t0 < 10
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None and x["records"]["decode"])
        assert rec["records"]["ingress"]["resubmitted_as"] == [f"{rid}-r1"]
        assert rec["records"]["decode"]["node"] != node  # the record of the attempt that served it


# -- 2. a prefill node dies with requests queued on it -----------------------------------------------

async def test_requests_queued_on_a_killed_prefill_node_are_resubmitted(nats_url):
    async with stack(nats_url, prefill=2, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        tasks = [asyncio.ensure_future(st.complete([1] * 16000, max_tokens=2)) for _ in range(8)]
        victim = st.agents["prefill-1"]
        await wait_until(lambda: sum(1 for r in victim.reqs.values() if r.handoff_node is None) >= 3, 10,
                         "requests queued on prefill-1")
        stranded = [rid for rid, r in victim.reqs.items() if r.handoff_node is None]
        t0 = time.monotonic()
        await st.kill_agent("prefill-1")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(s == 200 for s, _ in results), results
        assert time.monotonic() - t0 < 15
        assert counter(st.ingress.m.node_lost.labels("resubmitted")) >= len(stranded)
        assert counter(st.ingress.m.node_lost.labels("failed")) == 0
        for rid in stranded:
            rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None and x["node"] is not None)
            assert rec["records"]["ingress"]["resubmitted_as"] == [f"{rid}-r1"]
            assert rec["node"] == "prefill-0"


# -- 3. a non-streaming client goes away ----------------------------------------------------------

async def test_non_streaming_client_disconnect_cancels_the_request(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        dec = st.agents["decode-0"]

        async def client():
            async with aiohttp.ClientSession() as s:
                async with s.post(st.base + "/v1/completions",
                                  json={"model": MODEL, "prompt": "x", "max_tokens": 2000}) as r:
                    await r.read()

        task = asyncio.ensure_future(client())
        rid = await wait_until(lambda: next((r for r, q in dec.reqs.items() if q.tokens > 0), None), 10, "decoding")
        task.cancel()  # the client hangs up (connection closed), like curl -m
        await asyncio.gather(task, return_exceptions=True)
        t0 = time.monotonic()
        await wait_until(lambda: rid not in dec.reqs and dec.backend.phase(rid) is None, 3,
                         "the decode engine dropped the request")
        assert time.monotonic() - t0 < 3
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None)
        ing = rec["records"]["ingress"]
        assert ing["status"] == 499 and ing["error"] == "client_disconnected" and ing["completion_tokens"] == 0
        assert counter(st.ingress.m.disconnects.labels("completions", "false")) == 1


async def test_streaming_disconnect_records_the_tokens_sent(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        dec = st.agents["decode-0"]
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(st.base + "/v1/completions", json=body) as r:
                got = await read_sse(r, 9)
                rid = json.loads(got[0])["id"]
                r.close()
        await wait_until(lambda: rid not in dec.reqs, 3, "the decode node dropped the request")
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None)
        ing = rec["records"]["ingress"]
        assert ing["status"] == 499 and ing["error"] == "client_disconnected"
        assert 9 <= ing["completion_tokens"] < 2000


async def test_disconnect_while_the_stream_headers_are_written_is_a_499_with_its_stages(nats_url, monkeypatch):
    """aiohttp raises ClientConnectionResetError from prepare() when the client left just as the
    first token's headers go out: a 499 like any other disconnect, never a 500 with a traceback, and
    the stages that ran are in the request's record (issue 11)."""
    from aiohttp import ClientConnectionResetError, web

    real_prepare = web.StreamResponse.prepare

    async def prepare(self, request):
        if self.headers.get("Content-Type") == "text/event-stream":
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await real_prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare)
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        body = {"model": MODEL, "prompt": "x y z", "max_tokens": 50, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 499, await r.text()  # (a real client is gone; this one reads the record's status)
        assert counter(st.ingress.m.disconnects.labels("completions", "true")) == 1
        [rid] = st.agents["prefill-0"].jobs_received  # the one request this stack served
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None
                               and x["records"]["decode"] is not None and x["records"]["prefill"] is not None)
        ing, dec = rec["records"]["ingress"], rec["records"]["decode"]
        assert ing["status"] == 499 and ing["error"] == "client_disconnected"
        assert dec["kv_arrived_unix_ms"] is not None and dec["first_token_unix_ms"] is not None  # those stages ran
        assert dec["error"] and "client_disconnected" in dec["error"]
        assert rec["measured"]["kv_transfer_ms"] is not None


# -- 4. /health tells the truth ---------------------------------------------------------------------

async def test_health_503_when_the_cluster_view_is_stale(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        await poll_health(st.base, st.http, 200, 5)
        await st.aggregator.close()  # the view stops being refreshed
        body = await poll_health(st.base, st.http, 503, 3, "cluster_view_stale")
        assert body["status"] == "cluster_view_stale" and "aggregator" in body["reasons"][0]["message"]


async def test_health_503_when_no_dispatcher_consumes_requests(nats_url):
    """/health says "consuming" while a dispatcher answers its pings, and for
    ``dispatcher_active_window_s`` after the last answer (a dispatcher busy for a moment), then 503
    ``no_dispatcher``: with none subscribed, at once after the window (issue 32: the test waits for
    the window it sets, plus a margin)."""
    window_s = 1.0
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        st.ingress.readiness.cfg = dataclasses.replace(st.ingress.cfg, dispatcher_check_interval_s=0.2,
                                                       dispatcher_active_window_s=window_s)
        body = await poll_health(st.base, st.http, 200, 5)
        assert body["dispatchers"] == {"consuming": True, "detail": "ok"}
        gone = list(st.dispatchers)
        st.dispatchers.clear()
        for d in gone:
            await d.close()
        body = await poll_health(st.base, st.http, 503, window_s + 3.0, "no_dispatcher")
        assert "no dispatcher subscribes" in body["dispatchers"]["detail"], body
        d = Dispatcher(DispatcherConfig(replica_id="dispatcher-back", nats_url=nats_url, policy="pd", metrics_port=-1),
                       model=fast_model())
        await d.start()
        st.dispatchers.append(d)
        await poll_health(st.base, st.http, 200, 5)


# -- 5. every error is OpenAI-shaped JSON -----------------------------------------------------------

@pytest.fixture
async def lone_ingress(nats_url):
    """An ingress alone on the bus (no aggregator, no dispatcher) with a 1 MiB body limit."""
    await reset_bus(nats_url)
    ing = Ingress(IngressConfig(nats_url=nats_url, port=0, max_body_bytes=1024 * 1024,
                                dispatcher_check_interval_s=0.2))
    await ing.start()
    async with aiohttp.ClientSession() as http:
        yield ing, http, f"http://127.0.0.1:{ing.port}"
    await ing.close()


def is_openai_error(body: dict, code: str) -> bool:
    e = body.get("error")
    return isinstance(e, dict) and set(e) == {"message", "type", "param", "code"} and e["code"] == code and e["message"]


async def test_404_405_413_are_openai_json(lone_ingress):
    ing, http, base = lone_ingress
    async with http.get(base + "/v1/nope") as r:
        assert r.status == 404 and r.content_type == "application/json"
        body = await r.json()
        assert is_openai_error(body, "not_found") and "/v1/nope" in body["error"]["message"]
    async with http.get(base + "/v1/completions") as r:
        assert r.status == 405 and r.content_type == "application/json" and r.headers["Allow"] == "POST"
        body = await r.json()
        assert is_openai_error(body, "method_not_allowed") and "POST" in body["error"]["message"]
    async with http.post(base + "/v1/chat/completions", data=b"x" * (1536 * 1024),
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413 and r.content_type == "application/json"
        body = await r.json()
        assert is_openai_error(body, "request_too_large") and str(1024 * 1024) in body["error"]["message"]
    async with http.get(base + "/metrics") as r:
        assert 'kairos_ingress_requests_total{endpoint="chat",status="413"} 1.0' in await r.text()


async def test_health_lists_every_reason_when_nothing_runs(lone_ingress):
    ing, http, base = lone_ingress
    async with http.get(base + "/health") as r:
        body = await r.json()
    assert r.status == 503
    codes = [x["code"] for x in body["reasons"]]
    assert codes == ["no_cluster_view", "no_dispatcher"], body
    assert "no dispatcher subscribes" in body["dispatchers"]["detail"]


@pytest.mark.parametrize("body,param,code,words", [
    ({"prompt": [1.5, 2]}, "prompt", "invalid_type", "must be integers"),
    ({"prompt": "x", "max_tokens": 1e26}, "max_tokens", "invalid_value", "out of range"),
    ({"prompt": [1] * 40000}, "prompt", "context_length_exceeded", "your prompt is 40000 tokens"),
    ({"prompt": [1] * 100, "max_tokens": 40000}, "max_tokens", "context_length_exceeded", "reduce 'max_tokens'"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_type", "must be a number"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "invalid_value", "between 0 and 1"),
    ({"prompt": "x", "stop": [1, 2]}, "stop", "invalid_type", "list of strings"),
    ({"messages": [{"role": "", "content": "hi"}]}, "messages[0].role", "invalid_value", "must not be empty"),
])
async def test_validation_messages_name_the_problem(lone_ingress, body, param, code, words):
    ing, http, base = lone_ingress
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with http.post(base + path, json={"model": MODEL, **body}) as r:
        got = await r.json()
    assert r.status == 400, got
    assert is_openai_error(got, code) and got["error"]["param"] == param and words in got["error"]["message"], got


async def test_ingress_shutdown_ends_unrouted_requests_with_an_explicit_error(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        for d in st.dispatchers:  # nobody routes: the request waits in the ingress until it closes
            await d.close()
        st.dispatchers.clear()
        body = {"model": "kairos-emulated", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        pending = asyncio.ensure_future(st.http.post(f"{st.base}/v1/completions", json=body))
        await wait_until(lambda: len(st.ingress.flights) == 1, 5, "the request is in flight")
        closing = asyncio.ensure_future(st.ingress.close())
        resp = await asyncio.wait_for(pending, 5)
        err = (await resp.json())["error"]  # no token yet: the SSE stream never started
        assert resp.status == 503 and err["code"] == "ingress_shutdown" and err["message"]
        await asyncio.wait_for(closing, 10)
