"""Fewer bus round trips on the hot path, same outcomes (issue 12 item 5), on a real nats-server."""

from __future__ import annotations

import asyncio
import json

import nats
import nats.js.errors
import pytest

from shared import subjects as S
from shared.bus import ensure_buckets, kv_create
from services.ingress.service import _SseResponse
from shared.wire import DoneEvent, StepRecordEvent, TokenEvent, WireError, decode_step_records, encode, now_ms
from tests.integration.conftest import reset_bus, stack, wait_until

pytestmark = pytest.mark.integration


async def test_kv_create_after_delete_is_one_write_and_still_atomic(nats_url):
    await reset_bus(nats_url)
    nc = await nats.connect(nats_url)
    spy = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv = (await ensure_buckets(js)).reservations
        gets: list[str] = []  # JetStream "read the key" API calls (KeyValue.create's second round trip)

        async def on_get(m) -> None:
            gets.append(m.subject)
        await spy.subscribe(f"$JS.API.DIRECT.GET.KV_{S.RESERVATION_BUCKET}.>", cb=on_get)
        await spy.subscribe(f"$JS.API.STREAM.MSG.GET.KV_{S.RESERVATION_BUCKET}", cb=on_get)
        await spy.flush()
        key = S.reservation_key("decode-0", 0)

        rev1 = await kv_create(js, kv, S.RESERVATION_BUCKET, key, b"a", msg_ttl=30)  # a new key
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):  # held: refused
            await kv_create(js, kv, S.RESERVATION_BUCKET, key, b"b", msg_ttl=30)
        await kv.delete(key, last=rev1)
        marker = (await js.get_last_msg(f"KV_{S.RESERVATION_BUCKET}", f"$KV.{S.RESERVATION_BUCKET}.{key}")).seq
        # reads so far: the refused create's (KeyValue.create reads the key after a refusal), get_last_msg
        await wait_until(lambda: len(gets) == 2, 2, "two reads")
        rev2 = await kv_create(js, kv, S.RESERVATION_BUCKET, key, b"c", msg_ttl=30, deleted_revision=marker)
        assert rev2 == marker + 1 and (await kv.get(key)).value == b"c"  # one more read: this get
        await wait_until(lambda: len(gets) >= 3, 2, "the get's read")  # one connection: reads arrive in order
        assert len(gets) == 3  # the create read nothing: one write
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):  # a stale marker revision: held, refused
            await kv_create(js, kv, S.RESERVATION_BUCKET, key, b"d", msg_ttl=30, deleted_revision=marker)

        # a stale marker revision of a free key (deleted again since): falls back to create, succeeds
        await kv.delete(key, last=rev2)
        rev3 = await kv_create(js, kv, S.RESERVATION_BUCKET, key, b"e", msg_ttl=30, deleted_revision=marker)
        assert rev3 > rev2 and (await kv.get(key)).value == b"e"
    finally:
        await spy.close()
        await nc.close()


async def test_step_records_arrive_batched_and_complete(nats_url):
    """Every executed step's record reaches the bus (and the aggregator's correction), in far fewer
    messages than steps."""
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1) as st:
        nc = st.ingress.nc
        msgs: list[list[StepRecordEvent]] = []

        async def on_steps(m) -> None:
            msgs.append(decode_step_records(m.data))
        await nc.subscribe(S.STEPS_WILDCARD, cb=on_steps)
        await nc.flush()
        agg0 = st.aggregator.m_steps._value.get()

        def executed() -> int:
            return sum(int(a.m.steps.labels(n)._value.get()) for n, a in st.agents.items())
        steps0 = executed()
        results = await asyncio.gather(*[st.complete(f"hello {i}", max_tokens=24) for i in range(6)])
        assert all(status == 200 for status, _ in results)
        steps = executed() - steps0
        assert steps >= 24
        await wait_until(lambda: sum(map(len, msgs)) >= steps, 2, "every step's record")
        records = [r for batch in msgs for r in batch]
        assert len(records) == steps and len({(r.node, r.step) for r in records}) == steps  # each step once
        assert len(msgs) < steps / 2  # batched: several steps per message (one each before)
        assert {r.node for r in records} <= set(st.agents)
        await wait_until(lambda: st.aggregator.m_steps._value.get() - agg0 >= steps, 2, "the aggregator saw them")
        assert st.aggregator.m_steps._value.get() - agg0 == steps


async def test_a_single_step_record_is_still_understood():
    rec = StepRecordEvent(node="n", role="decode", step=3, started_unix_ms=1.0, wall_ms=2.0, predicted_ms=2.0,
                          batch_size=1, kv_tokens=10, prefill_tokens=0)
    assert decode_step_records(encode(rec)) == [rec]
    assert decode_step_records(encode([rec, rec])) == [rec, rec]
    with pytest.raises(WireError):
        decode_step_records(b'{"node": "n"}')


async def test_a_burst_of_token_events_is_written_once_in_order(nats_url, monkeypatch):
    """Token events that are already waiting when the ingress relays one go out in one socket write
    with it (and the end of the stream with them); the client gets every token, in order."""
    writes: list[bytes] = []
    orig_write, orig_eof = _SseResponse.write, _SseResponse.write_eof

    async def write(self, data: bytes) -> None:
        writes.append(bytes(data))
        await orig_write(self, data)

    async def write_eof(self, data: bytes = b"") -> None:
        writes.append(bytes(data))
        await orig_eof(self, data)
    monkeypatch.setattr(_SseResponse, "write", write)
    monkeypatch.setattr(_SseResponse, "write_eof", write_eof)
    async with stack(nats_url, prefill=1, decode=1, dispatchers=0) as st:  # nobody routes: the test is the node
        body = {"model": "kairos-emulated", "prompt": "hi", "max_tokens": 8, "stream": True}

        async def client() -> list[str]:  # the headers come with the first token
            async with st.http.post(st.base + "/v1/completions", json=body) as r:
                assert r.status == 200
                return [line.strip()[6:].decode() async for line in r.content if line.startswith(b"data: ")]
        reader = asyncio.create_task(client())
        rid = await wait_until(lambda: next(iter(st.ingress._flights), None), 5, "the request in flight")
        nc = st.aggregator.nc  # any other connection: one flush, so the ingress reads them together
        for i in range(8):
            await nc.publish(S.out_subject(rid), encode(TokenEvent(request_id=rid, first_index=i, count=1,
                                                                  text=f"t{i} ", node="decode-0",
                                                                  sent_unix_ms=now_ms())))
        await nc.publish(S.out_subject(rid), encode(DoneEvent(request_id=rid, completion_tokens=8,
                                                             finish_reason="length", node="decode-0",
                                                             sent_unix_ms=now_ms())))
        await nc.flush()
        payloads = await asyncio.wait_for(reader, 10)
    texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and "".join(texts) == "".join(f"t{i} " for i in range(8))
    assert sum(w.count(b"data: ") for w in writes) == len(payloads)  # every event written exactly once
    assert len(writes) < 9  # 9 events + [DONE]: one write each before; a burst now shares writes
