"""Issue 20: ``n`` > 1 and batched completions prompts fanned out at the ingress (kairos/services/ingress/fanout.py)
through the real stack (ingress → NATS → dispatcher → emulated agents), keep and deflect paths:
one choice per (prompt, j) with vLLM's index (prompt × n + j), usage as vLLM sums it, streams that
interleave the choices' chunks with their index and end with one usage chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.integration.conftest import post_openai as post, stack

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


def streamed(chunks: list[dict], chat: bool) -> dict[int, tuple[str, str | None]]:
    """Per choice index: (text, finish_reason) from a stream's chunks."""
    out: dict[int, list] = {}
    for c in chunks:
        for ch in c["choices"]:
            t = ch["delta"].get("content") if chat else ch["text"]
            cur = out.setdefault(ch["index"], ["", None])
            cur[0] += t or ""
            if ch["finish_reason"] is not None:
                assert cur[1] is None, "two finish reasons for one choice"
                cur[1] = ch["finish_reason"]
    return {i: (t, f) for i, (t, f) in out.items()}


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_n_and_batched_prompts(nats_url, policy):
    async with stack(nats_url, policy=policy) as st:
        # n=3 with a seed: choice j samples with seed + j (emulated text: a function of (seed, index))
        status, headers, out = await post(st, {"prompt": "alpha beta", "max_tokens": 4, "n": 3, "seed": 5})
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert len({c["text"] for c in out["choices"]}) == 3  # three seeds, three texts
        assert len(headers["X-Kairos-Sub-Request-Ids"].split(",")) == 3
        one = (await post(st, {"prompt": "alpha beta", "max_tokens": 4, "seed": 6}))[2]
        assert out["choices"][1]["text"] == one["choices"][0]["text"]  # choice 1 is seed 5 + 1
        pt = one["usage"]["prompt_tokens"]
        assert out["usage"]["prompt_tokens"] == pt and out["usage"]["completion_tokens"] == 12  # prompt once
        # 2 prompts x n=2: index = prompt * n + j; prompt tokens once per prompt
        body = {"prompt": ["alpha beta", "gamma delta epsilon zeta"], "max_tokens": 3, "n": 2, "seed": 1}
        status, _, out = await post(st, body)
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        second = (await post(st, {"prompt": "gamma delta epsilon zeta", "max_tokens": 3, "seed": 2}))[2]
        assert out["usage"]["prompt_tokens"] == pt + second["usage"]["prompt_tokens"]
        assert out["usage"]["completion_tokens"] == 12
        assert out["choices"][3]["text"] == second["choices"][0]["text"]
        status, _, ids = await post(st, {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2})  # token-id lists
        assert status == 200 and len(ids["choices"]) == 2 and ids["usage"]["prompt_tokens"] == 5, ids
        # the same streamed: the choices' texts and finish reasons, one usage chunk at the end
        status, _, chunks = await post(st, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200, chunks
        assert streamed(chunks[:-1], False) == {c["index"]: (c["text"], c["finish_reason"]) for c in out["choices"]}
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
        assert all(c.get("usage") is None for c in chunks[:-1])
        # chat: n=2, a role chunk per choice
        msgs = [{"role": "user", "content": "hi"}]
        status, _, chat = await post(st, {"messages": msgs, "max_tokens": 3, "n": 2, "seed": 9}, chat=True)
        assert status == 200 and [c["index"] for c in chat["choices"]] == [0, 1], chat
        status, _, chunks = await post(st, {"messages": msgs, "max_tokens": 3, "n": 2, "seed": 9, "stream": True},
                                       chat=True)
        assert status == 200, chunks
        roles = [ch["index"] for c in chunks for ch in c["choices"] if ch["delta"].get("role") == "assistant"]
        assert sorted(roles) == [0, 1]
        assert streamed(chunks, True) == {c["index"]: (c["message"]["content"], c["finish_reason"])
                                          for c in chat["choices"]}


async def test_fanout_limits_and_greedy_rule(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        status, _, out = await post(st, {"prompt": "a", "n": 65})
        assert status == 400 and out["error"]["param"] == "n", out
        status, _, out = await post(st, {"prompt": ["a"] * 17, "n": 4})
        assert status == 400 and out["error"]["param"] == "prompt", out
        status, _, out = await post(st, {"prompt": "a", "n": 2, "temperature": 0})  # vLLM: greedy needs n=1
        assert status == 400 and out["error"]["param"] == "n", out


async def test_a_sub_request_failing_mid_stream_ends_the_stream_and_stops_its_siblings(nats_url):
    """A real fault after the stream opened: the decode node of choice 0 crashes (no drain, no goodbye),
    with migration off (``max_migrations`` 0; with it on, choice 0 moves: tests/integration/test_migration.py).
    Choice 0 fails with ``node_lost`` (its tokens already reached the client: not resubmitted); the
    stream ends with an SSE error event and ``[DONE]``; choice 1, streaming on the other decode node,
    is stopped with the cause ``sibling_failed`` (cancelled there: no node holds it; 424 and that code in its
    record, not 499 ``client_disconnected``: the client is still there)."""
    from tests.integration.conftest import get_record, wait_until
    from tests.integration.test_ingress_robustness import holder, read_sse

    async with stack(nats_url, prefill=1, decode=2, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"max_migrations": 0}) as st:
        body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "n": 2, "seed": 3,
                "stream": True}
        async with st.http.post(st.base + "/v1/completions", json=body) as r:
            assert r.status == 200
            subs = r.headers["X-Kairos-Sub-Request-Ids"].split(",")
            head = await read_sse(r, 4)
            nodes = [await wait_until(lambda s=s: holder(st, s, "decode"), 5, f"the decode node of {s}") for s in subs]
            assert nodes[0] != nodes[1], f"both choices on {nodes[0]}: the fault would not leave a sibling to stop"
            await st.kill_agent(nodes[0])
            rest = await asyncio.wait_for(read_sse(r), 20)
            # the client is still connected: choice 1 is stopped by the failure, not by a client that left
            await wait_until(lambda: holder(st, subs[1], "decode") is None, 5, "choice 1 cancelled on its node")
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "node_lost" and nodes[0] in err["message"], err
        assert any(json.loads(e).get("choices") for e in head), "the stream had opened with tokens"
        failed = await get_record(st, subs[0], lambda x: x["records"]["ingress"] is not None)
        stopped = await get_record(st, subs[1], lambda x: x["records"]["ingress"] is not None)
        assert failed["records"]["ingress"]["status"] == 503 and failed["records"]["ingress"]["error"] == "node_lost"
        assert stopped["records"]["ingress"]["status"] == 424, stopped["records"]["ingress"]  # not 499: nobody left
        assert stopped["records"]["ingress"]["error"] == "sibling_failed", stopped["records"]["ingress"]
