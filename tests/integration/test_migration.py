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
from click.testing import CliRunner, Result

from kairos.cli.main import main
from kairos.contracts.wire import SamplingParams
from kairos.core.engine_model.text import emulated_completion
from tests.integration.conftest import fast_model, get_record, stack, wait_until
from tests.integration.test_ingress_robustness import holder, read_sse

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


def finished(record: dict) -> bool:
    """The ingress's record written when the request ended (a migration writes one before: its
    ``finished_unix_ms`` is None and it lists the attempts left so far)."""
    return (record["records"]["ingress"] or {}).get("finished_unix_ms") is not None


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
        rec = await get_record(st, rid, finished)  # not the record written at the migration (one attempt)
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
            # while it streams, its record lists the attempt it left (written at the migration)
            live = await get_record(st, rid, lambda x: bool(x["attempts"]))
            assert live["records"]["ingress"]["finished_unix_ms"] is None, live["records"]["ingress"]
            assert [(a["attempt_id"], a["moved"]) for a in live["attempts"]] == [(rid, f"node_lost:{first}")]
            await st.kill_agent(second)
            rest = await asyncio.wait_for(read_sse(r), 30)
        err = json.loads(rest[-2])["error"]
        assert rest[-1] == "[DONE]" and err["code"] == "migration_limit", rest[-3:]
        assert f"attempts: {rid}, {rid}-m1" in err["message"], err
        rec = await get_record(st, rid, finished)
        assert [(a["attempt_id"], a["moved"]) for a in rec["attempts"]] == [
            (rid, f"node_lost:{first}"), (f"{rid}-m1", f"node_lost:{second}")], rec["attempts"]
        # the TTFT is explained by the attempt that sent the first token, not by a continuation: its
        # decode node died before it wrote a record, so the breakdown is unknown, not mixed
        assert rec["records"]["decode"] is None and rec["measured"]["other_ms"] is None, rec
        assert rec["decode_node"] == first and rec["measured"]["ttft_ms"] > 0, rec


async def test_a_stream_whose_only_decode_node_is_gone_for_a_while_waits_for_it_and_goes_on(nats_url):
    """1P1D: the only decode node dies mid-stream and a new incarnation starts well after the
    dispatcher's ``no_node_wait_s`` for new requests: the continuation waits for a decode node
    (``migration_node_wait_s``) instead of ending the client's stream with ``no_available_node``
    (issue 33's trial, a 5 s SIGSTOP of the only decode node)."""
    prompt, n, no_node_wait_s = "only one decode node", 300, 0.3
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0},
                     no_node_wait_s=no_node_wait_s) as st:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            head = await read_sse(r, 10)
            await st.kill_agent("decode-0")
            migrated = st.ingress.m.migrations["node_lost"]
            await wait_until(lambda: migrated._value.get() == 1, 10, "the stream's migration")
            # what is tested is how long the continuation waits: the node stays away 5× no_node_wait_s
            await asyncio.sleep(5 * no_node_wait_s)
            await st.restart_agent("decode-0")
            rest = await asyncio.wait_for(read_sse(r), 30)
        assert not any("error" in json.loads(e) for e in rest[:-1]), rest[-3:]
        assert texts(head + rest) == expected(prompt, n) and rest[-1] == "[DONE]"


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
            # asked again (kairos drain twice; SIGTERM after a preStop hook's drain): it waits for this drain
            again = asyncio.create_task(st.agents[node].drain("again"))
            status, late = await st.complete(prompt="sent while it drains", max_tokens=8)
            assert status == 200, late
            more = await read_sse(r, 5)
            assert not again.done(), "a second drain returned while the first still had a stream to finish"
            rest = more + await asyncio.wait_for(read_sse(r), 30)
        report = await asyncio.wait_for(drain, 30)
        assert await asyncio.wait_for(again, 5) is report
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


def kairos_drain(*args: str) -> Result:
    """``kairos drain ARGS`` (the CLI, in-process; run in a thread: it waits on the ingress of this loop)."""
    return CliRunner().invoke(main, ["drain", *args])


async def test_kairos_drain_reaches_the_node_and_a_silent_node_is_neither_drained_nor_listed(nats_url):
    """``kairos drain`` through the ingress (its URL given as an OpenAI client's, ending in /v1): the
    node drains, /health lists it, a second call says it was draining already. Once its agent is
    gone, /health no longer lists it and a drain of it is refused 404 (it used to say "draining" for
    ever). A name that cannot be a node id is a usage error, not a traceback."""
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0) as st:
        node = "decode-1"
        res = await asyncio.to_thread(kairos_drain, node, "--url", st.base + "/v1")
        assert res.exit_code == 0 and f"node {node} is draining:" in res.output, res.output
        await wait_until(lambda: st.agents[node].drainer.report is not None, 5, "the agent got the drain")
        await wait_until(lambda: any(v.node == node and v.draining for v in st.ingress.readiness.ready.nodes),
                         5, "the view says it drains")
        async with st.http.get(st.base + "/health") as h:
            assert (await h.json())["draining"] == [node]
        res = await asyncio.to_thread(kairos_drain, node, "--url", st.base)
        assert res.exit_code == 0 and "(it was draining already)" in res.output, res.output
        await st.kill_agent(node)
        await wait_until(lambda: any(v.node == node and v.stale for v in st.ingress.readiness.ready.nodes), 10,
                         "the view says it is silent")
        async with st.http.get(st.base + "/health") as h:
            assert (await h.json())["draining"] == []
        res = await asyncio.to_thread(kairos_drain, node, "--url", st.base)
        assert res.exit_code == 1 and "HTTP 404" in res.output and "is silent" in res.output, res.output
    for bad in ("a b", "d\u00e9code", "decode.*"):  # refused before any request: no ingress runs now
        res = kairos_drain(bad)
        assert res.exit_code == 2 and "node id" in res.output, (bad, res.output, res.exception)


async def test_a_prefill_whose_only_decode_candidate_drained_meanwhile_is_submitted_again(nats_url):
    """The rolling-restart race (the faults tier's churn case found it): a keep-path job named the
    only routable decode node as its candidate; that node began draining while the prefill ran and
    refused the KV (``draining``). The prefill node's ``kv_handoff_failed`` says this node cannot
    finish the attempt while another could: the request is submitted again (``<id>-r1``) and
    completes on the decode node that came back meanwhile, its text exact."""
    prompt, n = "a prompt long enough to keep the prefill node busy " * 60, 6
    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, model=fast_model(scale=40.0),
                     ingress_overrides={"liveness_timeout_s": 1.0}) as st:
        await st.kill_agent("decode-1")
        await wait_until(lambda: all(v.node != "decode-1" or v.stale for v in st.ingress.readiness.ready.nodes), 10,
                         "decode-1 out of the view")
        sent = asyncio.create_task(st.complete(prompt=prompt, max_tokens=n))
        rid = await wait_until(lambda: next(iter(st.agents["prefill-0"].reqs), None), 10, "the prefill node's request")
        job = st.agents["prefill-0"].reqs[rid].job
        assert job is not None and job.decode_candidates == ["decode-0"], job
        drain = asyncio.create_task(st.agents["decode-0"].drain("test"))
        await st.restart_agent("decode-1")
        assert rid in st.agents["prefill-0"].reqs, "the prefill ended before decode-0 drained: the race was not set up"
        status, body = await asyncio.wait_for(sent, 60)
        await asyncio.wait_for(drain, 30)
        assert status == 200, body
        assert body["choices"][0]["text"] == expected(prompt, n)
        rec = await get_record(st, rid, finished)
        assert [(a["attempt_id"], a["moved"]) for a in rec["attempts"]] == [
            (rid, "kv_handoff_failed:node_agent:prefill-0"), (f"{rid}-r1", None)], rec["attempts"]
        assert rec["decode_node"] == "decode-1", rec
