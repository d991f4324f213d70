"""The ingress's SSE end and request ids against vLLM 0.32 (issue 20), driven with the fake bus and
manual clock of tests/unit/test_ingress_relay.py (the test plays the dispatchers and node agents).

vLLM puts the ``finish_reason`` on the last token's chunk (``vllm/entrypoints/openai/completion/
serving.py``); the node agents mark that token event (``TokenEvent.finish_reason``), so the ingress
writes the chunk at once — nothing is held back — and sends no extra chunk at the end. A token
event without the mark (an agent that does not set it) still ends right when its chunk is unwritten
when the done event is handled; else the finish reason comes in one chunk without text, as vLLM
sends when its last output has no token.
"""

from __future__ import annotations

import asyncio

import orjson

from kairos.contracts.permissions import agent_user
from kairos.contracts.events import DoneEvent, TokenEvent
from tests.unit.test_ingress_relay import MODEL, WAIT_S, Stack, post, sse_payloads, stack  # noqa: F401  (fixture)


async def started(st: Stack, **body) -> tuple[asyncio.Task, str]:
    task = post(st, stream=True, **body)
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    return task, rid


async def token(st: Stack, rid: str, i: int, text: str, finish: str | None = None) -> None:
    await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=i, count=1, text=text, node="decode-0",
                                                    sent_unix_ms=st.clock.now_ms(), finish_reason=finish))


async def done(st: Stack, rid: str, n: int, reason: str = "length") -> None:
    await st.out(agent_user("decode-0"), DoneEvent(request_id=rid, completion_tokens=n, node="decode-0",
                                                   finish_reason=reason, sent_unix_ms=st.clock.now_ms()))


class Reader:
    """A streaming client reading the SSE events as they come; :meth:`wait_for` waits until a
    condition on what it has read holds (the ingress wrote it), never on time."""

    def __init__(self, st: Stack, path: str, body: dict) -> None:
        self.events: list = []
        self.changed = asyncio.Condition()
        self.task = asyncio.ensure_future(self._read(st, path, body))

    async def _read(self, st: Stack, path: str, body: dict) -> None:
        async with st.http.post(st.base + path, json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: "):
                    async with self.changed:
                        self.events.extend(sse_payloads(line + b"\n"))
                        self.changed.notify_all()

    async def wait_for(self, pred) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: pred(self.events)), WAIT_S)

    async def end(self) -> list:
        await asyncio.wait_for(self.task, WAIT_S)
        return self.events


def texts_and_reasons(events: list) -> list[tuple[str, str | None]]:
    return [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in events if c != "[DONE]"
            and c["choices"]]


async def test_a_marked_last_token_reaches_the_client_at_once_with_the_finish_reason_and_only_usage_follows(stack):
    st = stack
    rd = Reader(st, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True,
                                        "stream_options": {"include_usage": True}})
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    await token(st, rid, 0, "a")
    await token(st, rid, 1, "b", finish="length")
    # the client has the last token's chunk, with its finish reason, before the done event exists
    await rd.wait_for(lambda ev: len(ev) == 2)
    assert texts_and_reasons(rd.events) == [("a", None), ("b", "length")]
    await done(st, rid, 2)
    got = await rd.end()
    assert got[-1] == "[DONE]" and len(got) == 4  # the two token chunks, the usage chunk, [DONE]
    assert got[2]["choices"] == [] and got[2]["usage"]["completion_tokens"] == 2


async def test_a_chat_stream_has_the_role_chunk_then_one_chunk_per_token(stack):
    st = stack
    task = asyncio.ensure_future(_chat(st))
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    await token(st, rid, 0, "x")
    await token(st, rid, 1, "y", finish="stop")
    await done(st, rid, 2, "stop")
    events = sse_payloads(await asyncio.wait_for(task, WAIT_S))
    chunks = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "x"},
                                                          {"content": "y"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]


async def _chat(st: Stack) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    async with st.http.post(st.base + "/v1/chat/completions", json=body) as r:
        return await r.read()


async def test_an_unmarked_last_token_already_written_gets_a_chunk_without_text_for_the_finish(stack):
    st = stack
    rd = Reader(st, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    await token(st, rid, 0, "a")
    await token(st, rid, 1, "b")
    await rd.wait_for(lambda ev: len(ev) == 2)  # written: no done event was waiting
    await done(st, rid, 2)
    assert texts_and_reasons(await rd.end()) == [("a", None), ("b", None), ("", "length")]


async def test_an_unmarked_last_token_still_unwritten_at_the_done_event_carries_the_finish(stack):
    st = stack
    task, rid = await started(st, max_tokens=2)
    await token(st, rid, 0, "a")
    await token(st, rid, 1, "b")
    await done(st, rid, 2)  # queued behind the tokens: the last chunk is not written before the done is handled
    events = sse_payloads((await asyncio.wait_for(task, WAIT_S))[2])
    assert texts_and_reasons(events) == [("a", None), ("b", "length")]


async def test_x_request_id_is_the_response_id_and_echoed_and_the_record_keeps_it(stack):
    st = stack

    async def go(**headers) -> tuple[int, dict, bytes]:
        async with st.http.post(st.base + "/v1/completions", headers=headers,
                                json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}) as r:
            return r.status, r.headers.copy(), await r.read()

    task = asyncio.ensure_future(go(**{"X-Request-Id": "0f8fad5b-d9cb-469f-a165-70867728950e"}))
    req = await st.bus.published()
    assert req.request_id.startswith("cmpl-") and "0f8fad5b" not in req.request_id  # the bus id is Kairos' own
    await st.routed(req.request_id, "decode-0")
    await token(st, req.request_id, 0, "a", finish="length")
    await done(st, req.request_id, 1)
    status, headers, body = await asyncio.wait_for(task, WAIT_S)
    out = orjson.loads(body)
    assert status == 200 and out["id"] == "cmpl-0f8fad5b-d9cb-469f-a165-70867728950e"
    assert headers["X-Request-Id"] == "0f8fad5b-d9cb-469f-a165-70867728950e"
    assert headers["X-Kairos-Request-Id"] == req.request_id
    assert (await st.record(req.request_id)).client_request_id == "0f8fad5b-d9cb-469f-a165-70867728950e"


async def test_a_bad_x_request_id_is_a_400_naming_the_header_and_nothing_is_queued(stack):
    st = stack
    for value in ("x" * 129, "has space", 'quote"d', "semi;colon", "comma,sep"):
        async with st.http.post(st.base + "/v1/completions", headers={"X-Request-Id": value},
                                json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}) as r:
            err = await r.json()
            assert r.status == 400, (value, err)
            assert err["error"]["param"] == "X-Request-Id" and err["error"]["code"] == "invalid_request_id"
            assert "X-Request-Id" in err["error"]["message"]
    async with st.http.post(st.base + "/v1/completions", headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")],
                            json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "X-Request-Id"
    assert st.bus.enqueued.empty()
