"""Each choice's ``stop_reason`` as vLLM 0.32's OpenAI server gives it: the stop string or stop token
id that ended the choice, else null (EOS, ``length``, no stop).

Where vLLM puts it (``vllm/entrypoints/openai/completion/`` and ``chat_completion/`` ``protocol.py``,
``serving.py``):

* non-streamed, both endpoints: on every choice (``CompletionResponseChoice`` /
  ``ChatCompletionResponseChoice``, dumped with their nulls), ``output.stop_reason``;
* completions stream: on every chunk (``CompletionResponseStreamChoice(..., stop_reason=
  output.stop_reason)``, dumped ``exclude_unset=True`` — set, so present), null until the chunk
  with the ``finish_reason``;
* chat stream: only on the chunk with the ``finish_reason`` (the others, the role chunk included,
  are built without it: absent under ``exclude_unset=True``).

The ingress is driven with the fake bus and manual clock of tests/unit/test_ingress_relay.py (the
test plays the dispatchers and node agents); the node agent's side is :class:`NodeRequest`.
"""

from __future__ import annotations

import asyncio

import msgspec
import orjson
import pytest

from kairos.contracts.permissions import agent_user
from kairos.contracts.events import DoneEvent, OutEvent, TokenEvent
from kairos.contracts.wire import decode, encode, WireError
from kairos.services.ingress.openai_api.parse import prepare_request
from kairos.services.ingress.openai_api.responses import full_response, stream_chunk
from tests.unit.test_ingress_relay import MODEL, WAIT_S, Stack, sse_payloads, stack  # noqa: F401  (fixture)
from tests.unit.test_node_request import T0, deflect, published

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "m", "prompt": "hello", "max_tokens": 4}


def parsed(endpoint: str, **extra):
    body = {**(CHAT if endpoint == "chat" else COMP), **extra}
    return prepare_request(endpoint, body, ["m"], None, 4096)[0]


# -- response shapes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("reason", ["###", 42, None])
def test_a_full_response_choice_has_its_stop_reason_or_null(endpoint, reason):
    body = full_response(parsed(endpoint), "cmpl-x", 0, "text", "stop" if reason is not None else "length", 1, 2,
                         stop_reason=reason)
    choice = body["choices"][0]
    assert "stop_reason" in choice and choice["stop_reason"] == reason
    assert list(choice)[-2:] == ["finish_reason", "stop_reason"]  # vLLM's field order


@pytest.mark.parametrize("reason", ["###", 42, None])
def test_completions_chunks_carry_stop_reason_null_until_the_finishing_one(reason):
    p = parsed("completions", stream=True)
    mid = stream_chunk(p, "cmpl-x", 0, " a", None, stop_reason="ignored: no finish here")
    assert mid["choices"][0]["stop_reason"] is None
    end = stream_chunk(p, "cmpl-x", 0, " b", "stop", stop_reason=reason)
    assert end["choices"][0]["stop_reason"] == reason and "stop_reason" in end["choices"][0]


@pytest.mark.parametrize("reason", ["###", 42, None])
def test_chat_chunks_carry_stop_reason_only_on_the_finishing_one(reason):
    p = parsed("chat", stream=True)
    role = stream_chunk(p, "c", 0, "", None, first=True)
    mid = stream_chunk(p, "c", 0, " a", None, stop_reason="ignored")
    assert "stop_reason" not in role["choices"][0] and "stop_reason" not in mid["choices"][0]
    end = stream_chunk(p, "c", 0, " b", "stop", stop_reason=reason)
    assert "stop_reason" in end["choices"][0] and end["choices"][0]["stop_reason"] == reason
    only = stream_chunk(p, "c", 0, None, "length")  # a finish without text: null, present
    assert "stop_reason" in only["choices"][0] and only["choices"][0]["stop_reason"] is None


# -- the wire ----------------------------------------------------------------------------------------
def test_out_events_carry_a_string_or_token_id_stop_reason_and_older_bodies_decode():
    for reason in ("\n\n", 7, None):
        tok = TokenEvent(request_id="r", first_index=0, count=1, text="x", node="n", sent_unix_ms=0.0,
                         finish_reason="stop", stop_reason=reason)
        done = DoneEvent(request_id="r", completion_tokens=1, finish_reason="stop", node="n", sent_unix_ms=0.0,
                         stop_reason=reason)
        assert decode(encode(tok), OutEvent).stop_reason == reason  # type: ignore[union-attr]
        assert decode(encode(done), OutEvent).stop_reason == reason  # type: ignore[union-attr]
    # a body of an agent that predates the field: no stop_reason
    old = msgspec.json.decode(encode(DoneEvent(request_id="r", completion_tokens=1, node="n", sent_unix_ms=0.0)))
    del old["stop_reason"]
    assert decode(orjson.dumps(old), OutEvent).stop_reason is None  # type: ignore[union-attr]
    with pytest.raises(WireError):
        decode(orjson.dumps({**old, "stop_reason": [1]}), OutEvent)


# -- the node agent's request ------------------------------------------------------------------------
def test_the_node_request_puts_the_engines_stop_reason_on_its_last_token_and_done_events():
    r = deflect()
    events = published(r.tokens_out(0, 1, " x", T0 + 1) + r.tokens_out(1, 1, "", T0 + 2, "stop", None, 9))
    assert [(e.finish_reason, e.stop_reason) for e in events] == [(None, None), ("stop", 9)]
    (end,) = published(r.finished("stop", 0, T0 + 3, stop_reason=9))
    assert isinstance(end, DoneEvent) and (end.finish_reason, end.stop_reason) == ("stop", 9)
    r = deflect()  # no stop_reason when the engine gives none
    r.tokens_out(0, 1, " x", T0 + 1, "length")
    (end,) = published(r.finished("length", 0, T0 + 2))
    assert end.stop_reason is None


# -- the ingress, through HTTP ----------------------------------------------------------------------
async def token(st: Stack, rid: str, i: int, text: str, finish: str | None = None, reason=None) -> None:
    await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=i, count=1, text=text, node="decode-0",
                                                    sent_unix_ms=st.clock.now_ms(), finish_reason=finish,
                                                    stop_reason=reason))


async def done(st: Stack, rid: str, n: int, reason: str = "stop", stop=None) -> None:
    await st.out(agent_user("decode-0"), DoneEvent(request_id=rid, completion_tokens=n, node="decode-0",
                                                   finish_reason=reason, sent_unix_ms=st.clock.now_ms(),
                                                   stop_reason=stop))


def call(st: Stack, path: str, body: dict) -> asyncio.Task:
    async def go() -> tuple[int, bytes]:
        async with st.http.post(st.base + path, json={"model": MODEL, **body}) as r:
            return r.status, await r.read()
    return asyncio.ensure_future(go())


async def serve(st: Stack, path: str, body: dict, reason, marked: bool = True, n: int = 1) -> list | dict:
    """One request played to its end: two tokens per choice (the last one ``marked`` with the finish
    reason and ``reason``, or not), then done with ``reason``; the JSON body or the SSE payloads."""
    task = call(st, path, body)
    rids = [(await st.bus.published()).request_id for _ in range(n)]
    for rid in rids:
        await st.routed(rid, "decode-0")
        await token(st, rid, 0, " a")
        await token(st, rid, 1, " b", "stop" if marked else None, reason if marked else None)
        await done(st, rid, 2, stop=reason)
    status, raw = await asyncio.wait_for(task, WAIT_S)
    assert status == 200, raw
    return sse_payloads(raw) if body.get("stream") else orjson.loads(raw)


CASES = [("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]


@pytest.mark.parametrize("path,body", CASES)
@pytest.mark.parametrize("reason", ["b", 17, None])
async def test_a_full_answer_has_the_done_events_stop_reason_on_its_choice(stack, path, body, reason):
    out = await serve(stack, path, body, reason)
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["stop_reason"] == reason
    assert "stop_reason" in out["choices"][0]


@pytest.mark.parametrize("path,body", CASES)
@pytest.mark.parametrize("marked", [True, False])
async def test_a_stream_has_the_stop_reason_on_the_chunk_with_the_finish_reason(stack, path, body, marked):
    """Marked: the last token's event carries it (its chunk, written at once); unmarked: the done
    event's goes on the chunk that then carries the finish reason."""
    chat = "messages" in body
    events = await serve(stack, path, {**body, "stream": True}, "b", marked=marked)
    chunks = [c for c in events[:-1] if c["choices"]]
    finishing = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0]["stop_reason"] == "b"
    others = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"] is None]
    if chat:
        assert all("stop_reason" not in ch for ch in others), others
    else:
        assert others and all("stop_reason" in ch and ch["stop_reason"] is None for ch in others), others


async def test_a_fanned_out_answer_has_each_choices_own_stop_reason(stack):
    """n = 2: each sub-request's done event gives its choice's stop_reason (non-streamed), its marked
    last token its finishing chunk's (streamed)."""
    st = stack
    task = call(st, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "n": 2, "temperature": 1.0})
    rids = [(await st.bus.published()).request_id for _ in range(2)]
    for rid, (finish, reason) in zip(rids, [("stop", 5), ("length", None)]):
        await st.routed(rid, "decode-0")
        await token(st, rid, 0, " a")
        await token(st, rid, 1, " b")
        await done(st, rid, 2, finish, reason)
    status, raw = await asyncio.wait_for(task, WAIT_S)
    out = orjson.loads(raw)
    assert status == 200 and [(c["index"], c["finish_reason"], c["stop_reason"]) for c in out["choices"]] == [
        (0, "stop", 5), (1, "length", None)]

    task = call(st, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             "n": 2, "temperature": 1.0, "stream": True})
    rids = [(await st.bus.published()).request_id for _ in range(2)]
    for rid, reason in zip(rids, ["\n", 3]):
        await st.routed(rid, "decode-0")
        await token(st, rid, 0, " a")
        await token(st, rid, 1, " b", "stop", reason)
        await done(st, rid, 2, "stop", reason)
    status, raw = await asyncio.wait_for(task, WAIT_S)
    chunks = [c["choices"][0] for c in sse_payloads(raw)[:-1] if c["choices"]]
    assert status == 200
    assert {ch["index"]: ch["stop_reason"] for ch in chunks if ch["finish_reason"]} == {0: "\n", 1: 3}
    assert all("stop_reason" not in ch for ch in chunks if not ch["finish_reason"])
