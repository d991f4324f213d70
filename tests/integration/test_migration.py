"""Request migration and graceful drain (issue 33) on the in-process stack with a real nats-server.

The truth every test checks against is independent of the ingress: the emulated engine's output of
the request computed on its own (:func:`kairos.core.engine_model.text.emulated_completion`, the
function the nodes use), token by token. A node is crashed with ``Stack.kill_agent`` (connection
dropped, nothing announced) or drained with ``NodeAgent.drain``. Waits poll conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kairos.contracts.wire import SamplingParams
from kairos.core.engine_model.text import emulated_completion
from tests.integration.conftest import get_record, stack, wait_until
from tests.integration.test_ingress_robustness import holder, read_sse

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


def expected(prompt: str, max_tokens: int, **sampling) -> str:
    """The emulated engine's whole output for a text prompt (the nodes' own function)."""
    return emulated_completion(SamplingParams(**sampling), max_tokens, prompt, None).full_text()


def texts(events: list[str], index: int | None = None) -> str:
    """The concatenated text of the SSE chunks (of choice ``index`` when given)."""
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        for ch in json.loads(e).get("choices", []):
            if index is None or ch["index"] == index:
                out.append(ch.get("text") or "")
    return "".join(out)


async def test_a_decode_node_crashed_mid_stream_is_migrated_and_the_client_gets_the_whole_text(nats_url):
    """The keep path's decode node dies after tokens reached the client: the stream goes on from another
    decode node, no error, no token repeated or missing, usage counting every token, two attempts in
    the request's record, one ``node_lost`` migration counted."""
    prompt, n = "a long story, please", 400
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0}) as st:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True,
                "stream_options": {"include_usage": True}}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            head = await read_sse(r, 20)
            rid = json.loads(head[0])["id"]
            node = await wait_until(lambda: holder(st, rid, "decode"), 5, "the decode node streaming it")
            t0 = time.monotonic()
            await st.kill_agent(node)
            rest = await asyncio.wait_for(read_sse(r), 30)
        events = head + rest
        assert rest[-1] == "[DONE]" and not any("error" in json.loads(e) for e in rest[:-1]), rest[-3:]
        assert texts(events) == expected(prompt, n), "the client's text differs from the uninterrupted output"
        usage = json.loads(rest[-2])["usage"]
        assert usage["completion_tokens"] == n and usage["prompt_tokens"] > 0, usage
        assert json.loads(rest[-3])["choices"][0]["finish_reason"] == "length"
        assert st.ingress.m.migrations["node_lost"]._value.get() == 1
        rec = await get_record(st, rid, lambda x: x["records"]["ingress"] is not None)
        attempts = rec["attempts"]
        assert [a["attempt_id"] for a in attempts] == [rid, f"{rid}-m1"], attempts
        assert attempts[0]["node"] == node and attempts[0]["moved"] == f"node_lost:{node}", attempts
        assert attempts[1]["node"] not in (None, node) and attempts[1]["moved"] is None, attempts
        assert sum(a["output_tokens"] for a in attempts) == n
        assert time.monotonic() - t0 < 15


async def test_a_deflected_request_migrates_and_each_choice_of_n_moves_on_its_own(nats_url):
    """Deflect path (every prompt below 10^6 tokens deflected), ``n`` = 2 on two decode nodes: the
    node of choice 0 dies; choice 0 continues elsewhere, choice 1 is untouched; both texts exact."""
    prompt, n = "tell me two stories", 300
    async with stack(nats_url, prefill=1, decode=3, dispatchers=1, policy="sl:1000000", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0}) as st:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "n": 2, "seed": 11, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            subs = r.headers["X-Kairos-Sub-Request-Ids"].split(",")
            head = await read_sse(r, 10)
            nodes = [await wait_until(lambda s=s: holder(st, s, "decode"), 5, f"the decode node of {s}") for s in subs]
            await st.kill_agent(nodes[0])
            rest = await asyncio.wait_for(read_sse(r), 30)
        events = head + rest
        assert rest[-1] == "[DONE]" and not any("error" in json.loads(e) for e in rest[:-1]), rest[-3:]
        # n > 1 with a seed: choice i is sampled with seed + i, as vLLM's n does (kairos/services/ingress/fanout.py)
        for i in range(2):
            assert texts(events, i) == expected(prompt, n, seed=11 + i), f"choice {i}"
        assert st.ingress.m.migrations["node_lost"]._value.get() == 1


async def test_the_migration_limit_ends_the_request_naming_its_attempts(nats_url):
    """With one migration allowed and three decode nodes, the request's node is killed twice: the
    second loss ends it with 503 ``migration_limit`` (an SSE error event), the message naming both
    attempts."""
    async with stack(nats_url, prefill=1, decode=3, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0, "max_migrations": 1}) as st:
        body = {"model": MODEL, "prompt": "one more story", "max_tokens": 1500, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            head = await read_sse(r, 5)
            rid = json.loads(head[0])["id"]
            first = await wait_until(lambda: holder(st, rid, "decode"), 5, "the first decode node")
            await st.kill_agent(first)
            second = await wait_until(lambda: holder(st, f"{rid}-m1", "decode"), 10, "the continuation's decode node")
            await st.kill_agent(second)
            rest = await asyncio.wait_for(read_sse(r), 30)
        err = json.loads(rest[-2])["error"]
        assert rest[-1] == "[DONE]" and err["code"] == "migration_limit", rest[-3:]
        assert f"attempts: {rid}, {rid}-m1" in err["message"], err


async def test_a_draining_node_finishes_its_streams_and_takes_nothing_new(nats_url):
    """``NodeAgent.drain`` (what SIGTERM and ``kairos drain`` run) under a running stream: the stream
    finishes on the draining node (no migration), a request sent meanwhile goes to the other decode
    node, /health lists the node as draining, the decision record names it."""
    prompt, n = "drain me gently", 300
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0) as st:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            head = await read_sse(r, 5)
            rid = json.loads(head[0])["id"]
            node = await wait_until(lambda: holder(st, rid, "decode"), 5, "the decode node streaming it")
            drain = asyncio.create_task(st.agents[node].drain("test"))
            await wait_until(lambda: any(v.node == node and v.draining for v in st.ingress.readiness.ready.nodes), 5,
                             "the view says it drains")
            async with st.http.get(st.base + "/health") as h:
                assert node in (await h.json())["draining"]
            status, late = await st.complete(prompt="sent while it drains", max_tokens=8)
            assert status == 200, late
            rest = await asyncio.wait_for(read_sse(r), 30)
        report = await asyncio.wait_for(drain, 30)
        assert texts(head + rest) == expected(prompt, n) and rest[-1] == "[DONE]"
        assert report.finished == 1 and not report.moved_unstarted and not report.moved_at_deadline, report
        assert sum(v._value.get() for v in st.ingress.m.migrations.values()) == 0
        late_rec = await get_record(st, late["id"], lambda x: x["decision"] is not None)
        assert late_rec["decode_node"] != node and late_rec["routing"]["excluded_nodes"].get(node) == "draining"


async def test_at_the_drain_deadline_what_is_left_migrates(nats_url):
    """A drain with a 0.5 s deadline under a long stream: at the deadline the stream moves to the
    other decode node (``node_shutdown`` migration) and the client's text is still exact."""
    prompt, n = "a stream longer than the drain", 600
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, agent_overrides={"drain_timeout_s": 0.5}) as st:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            head = await read_sse(r, 5)
            rid = json.loads(head[0])["id"]
            node = await wait_until(lambda: holder(st, rid, "decode"), 5, "the decode node streaming it")
            report = await asyncio.wait_for(st.agents[node].drain("test"), 10)
            rest = await asyncio.wait_for(read_sse(r), 30)
        assert report.moved_at_deadline == [rid] and report.finished == 0, report
        assert texts(head + rest) == expected(prompt, n) and rest[-1] == "[DONE]"
        assert st.ingress.m.migrations["node_shutdown"]._value.get() == 1
