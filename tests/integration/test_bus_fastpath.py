"""Fewer bus round trips on the hot path, same outcomes (issue 12 item 5), on a real nats-server."""

from __future__ import annotations

import asyncio
import json

import nats
import nats.js.errors
import pytest

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.runtime.messaging import kv_delete_nowait, kv_put_nowait
from kairos.runtime.streams import ensure_buckets
from kairos.services.ingress.sse import SseResponse
from kairos.contracts.permissions import agent_user
from kairos.contracts.events import DoneEvent, TokenEvent
from kairos.contracts.wire import decode_step_records, encode, now_ms, StepRecordEvent, WireError
from kairos.cli.stepscale import parse_decode_steps, violation_rate
from prometheus_client import generate_latest
from tests.integration.conftest import reset_bus, stack, wait_until

pytestmark = pytest.mark.integration


async def test_an_unacknowledged_write_if_absent_keeps_the_first_value(nats_url):
    """kv_put_nowait(..., if_absent=True) (a duplicate acceptance's decision record): stored only while
    the key holds nothing; a later one is dropped by the stream, the first value stays."""
    await reset_bus(nats_url)
    nc = await nats.connect(nats_url)
    try:
        kv = (await ensure_buckets(nc.jetstream())).requests
        key = S.record_key("cmpl-dup", "decision")
        await kv_put_nowait(nc, S.REQUESTS_BUCKET, key, b"first", if_absent=True)
        await kv_put_nowait(nc, S.REQUESTS_BUCKET, key, b"second", if_absent=True)
        await flush_barrier(nc)
        assert (await kv.get(key)).value == b"first"
        await kv_put_nowait(nc, S.REQUESTS_BUCKET, key, b"third")  # a plain write still replaces it
        await flush_barrier(nc)
        assert (await kv.get(key)).value == b"third"
    finally:
        await nc.close()


async def test_unacknowledged_kv_writes_are_stored_in_order_and_expire(nats_url):
    """kv_put_nowait / kv_delete_nowait (the request records, a node's reservation deletes): one message
    each, no acknowledgement, every one stored by the bucket's stream in the order they were made
    (the last write wins, whichever it is), and a put's Nats-TTL removes the key when it expires."""
    await reset_bus(nats_url)
    nc = await nats.connect(nats_url)
    w = await nats.connect(nats_url)  # the writer: it makes no request, so any message to it is an ack
    try:
        js = nc.jetstream()
        kv = (await ensure_buckets(js)).reservations
        stream = f"KV_{S.RESERVATION_BUCKET}"
        seq0 = (await js.stream_info(stream)).state.last_seq
        key0, key1 = S.reservation_key("decode-0", 0), S.reservation_key("decode-0", 1)
        for i in range(20):  # put then delete, back to back: the delete is never overtaken
            await kv_put_nowait(w, S.RESERVATION_BUCKET, key0, f"v{i}".encode(), 30)
            await kv_delete_nowait(w, S.RESERVATION_BUCKET, key0)
        for i in range(20):  # delete then put: the put stays
            await kv_delete_nowait(w, S.RESERVATION_BUCKET, key1)
            await kv_put_nowait(w, S.RESERVATION_BUCKET, key1, f"w{i}".encode(), 30)
        await flush_barrier(w)

        async def stored() -> int:
            return (await js.stream_info(stream)).state.last_seq - seq0
        deadline = asyncio.get_running_loop().time() + 5
        while await stored() < 80 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert await stored() == 80  # every write stored, none lost
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(key0)
        assert (await kv.get(key1)).value == b"w19"
        await flush_barrier(w)  # anything the server sent the writer before this has arrived
        assert w.stats["in_msgs"] == 0  # nothing was acknowledged: the writes cost one message each

        key2 = S.reservation_key("decode-0", 2)
        await kv_put_nowait(w, S.RESERVATION_BUCKET, key2, b"expires", 1)
        await flush_barrier(w)
        assert (await kv.get(key2)).value == b"expires"
        deadline = asyncio.get_running_loop().time() + 5
        gone = False
        while not gone and asyncio.get_running_loop().time() < deadline:  # its TTL: 1 s
            try:
                await kv.get(key2)
                await asyncio.sleep(0.1)
            except nats.js.errors.KeyNotFoundError:
                gone = True
        assert gone, "the put's Nats-TTL did not expire the key"
    finally:
        await w.close()
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
        hist0 = parse_decode_steps(generate_latest(st.aggregator.tel.registry).decode(), 100.0)

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
        # its decode-step histogram (the live TBT violation count, kairos.cli.stepscale) holds exactly the
        # records that carried decodes, per node, and the share above 100 ms the records show
        hist = parse_decode_steps(generate_latest(st.aggregator.tel.registry).decode(), 100.0)
        decoding = [r for r in records if r.batch_size > 0]
        for node in {r.node for r in records}:  # prefill-0's prefill-only steps carry no decode: 0
            assert hist.get(node, (0.0, 0.0))[0] - hist0.get(node, (0.0, 0.0))[0] == sum(r.node == node for r in decoding)
        assert decoding and violation_rate(hist0, hist) == sum(r.wall_ms > 100.0 for r in decoding) / len(decoding)


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
    orig_write, orig_eof = SseResponse.write, SseResponse.write_eof

    async def write(self, data: bytes) -> None:
        writes.append(bytes(data))
        await orig_write(self, data)

    async def write_eof(self, data: bytes = b"") -> None:
        writes.append(bytes(data))
        await orig_eof(self, data)
    monkeypatch.setattr(SseResponse, "write", write)
    monkeypatch.setattr(SseResponse, "write_eof", write_eof)
    async with stack(nats_url, prefill=1, decode=1, dispatchers=0) as st:  # nobody routes: the test is the node
        body = {"model": "kairos-emulated", "prompt": "hi", "max_tokens": 8, "stream": True}

        async def take(msg) -> None:  # a "dispatcher" that takes the request and routes nothing
            await msg.respond(S.TAKEN)
        await st.aggregator.nc.subscribe(S.ROUTE_SUBJECT, queue=S.DISPATCHER_QUEUE, cb=take)

        async def client() -> list[str]:  # the headers come with the first token
            async with st.http.post(st.base + "/v1/completions", json=body) as r:
                assert r.status == 200
                return [line.strip()[6:].decode() async for line in r.content if line.startswith(b"data: ")]
        reader = asyncio.create_task(client())
        rid = await wait_until(lambda: next(iter(st.ingress.flights), None), 5, "the request in flight")
        nc = st.aggregator.nc  # any other connection: one flush, so the ingress reads them together
        out = S.out_subject(rid, agent_user("decode-0"))  # as decode-0's agent, which accepted the job
        st.ingress.flights.routed(st.ingress.flights.get(rid), rid, "deflect", "decode-0", None, 0.0)
        for i in range(8):
            await nc.publish(out, encode(TokenEvent(request_id=rid, first_index=i, count=1,
                                                                  text=f"t{i} ", node="decode-0",
                                                                  sent_unix_ms=now_ms())))
        await nc.publish(out, encode(DoneEvent(request_id=rid, completion_tokens=8,
                                                             finish_reason="length", node="decode-0",
                                                             sent_unix_ms=now_ms())))
        await nc.flush()
        payloads = await asyncio.wait_for(reader, 10)
    texts = [json.loads(p)["choices"][0]["text"] for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]" and "".join(texts) == "".join(f"t{i} " for i in range(8))
    assert sum(w.count(b"data: ") for w in writes) == len(payloads)  # every event written exactly once
    assert len(writes) < 9  # 9 events + [DONE]: one write each before; a burst now shares writes
