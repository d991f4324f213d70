"""The engine-state stream (contract A) through real ZMQ sockets: kairos.engines.vllm.plugin.publisher → subscriber.

No vLLM here (this runs in .venv); the in-engine side is covered by tests/vllm/inproc.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import msgspec
import pytest
import zmq

from kairos.engines.vllm.plugin.protocol import DeflectedChunk, EngineSnapshot, StepRecord, WaitingRequest, decode, encode
from kairos.engines.vllm.plugin.publisher import StatePublisher
from kairos.engines.vllm.subscriber import EngineStateError, EngineStateSubscriber


def snapshot(step_record: StepRecord | None = None, **kw) -> EngineSnapshot:
    d = dict(seq=0, sent_unix_ms=0.0, engine_pid=0, step=7, batch_size=2, kv_tokens=913,
             waiting=[WaitingRequest("cmpl-a", 300, 236), WaitingRequest("cmpl-b", 40, 40)],
             num_running=3, num_waiting=1, kv_cache_usage=0.125, free_kv_tokens=7168, block_size=128,
             step_record=step_record)
    d.update(kw)
    return EngineSnapshot(**d)


RECORD = StepRecord(step=7, started_unix_ms=1.7e12, wall_ms=12.5, prefill_tokens=64, decode_count=2,
                    kv_tokens=911, cached_tokens=0, chunks=[DeflectedChunk("cmpl-a", 1, 64)])


async def recv_until(sub: EngineStateSubscriber, pred, timeout_s: float = 10.0) -> EngineSnapshot:
    """The first message satisfying ``pred`` (bounded wait: ZMQ subscriptions join asynchronously)."""
    async def loop():
        while True:
            s = await sub.recv()
            if pred(s):
                return s
    return await asyncio.wait_for(loop(), timeout_s)


def test_codec_roundtrip_and_tag():
    s = snapshot(RECORD)
    raw = encode(s)
    assert msgspec.json.decode(raw)["type"] == "snapshot"
    assert decode(raw) == s


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
async def test_publish_reaches_subscriber_with_stamps(scheme):
    tmp = tempfile.mkdtemp(prefix="kst", dir="/tmp")  # ipc paths must stay short (< 107 bytes)
    addr = "tcp://127.0.0.1:*" if scheme == "tcp" else f"ipc://{tmp}/s.sock"
    pub = StatePublisher(addr)
    try:
        assert pub.addr.startswith(scheme + "://") and not pub.addr.endswith("*")
        async with EngineStateSubscriber(pub.addr) as sub:
            pub.publish(snapshot())
            first = await recv_until(sub, lambda s: True)  # the idle re-send reaches us once joined
            pub.publish(snapshot(RECORD))
            got = await recv_until(sub, lambda s: s.step_record is not None)
        assert got.step_record == RECORD
        assert got.engine_pid == os.getpid() and got.seq > first.seq >= 1
        assert got.sent_unix_ms >= first.sent_unix_ms > 0
        assert msgspec.structs.replace(got, seq=0, sent_unix_ms=0.0, engine_pid=0) == snapshot(RECORD)
    finally:
        pub.close()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_idle_republishes_latest_state_without_its_step_record():
    pub = StatePublisher("tcp://127.0.0.1:*", idle_period_s=0.05)
    try:
        async with EngineStateSubscriber(pub.addr) as sub:
            pub.publish(snapshot())
            await recv_until(sub, lambda s: True)
            pub.publish(snapshot(RECORD, step=8))
            rec = await recv_until(sub, lambda s: s.step_record is not None)
            # nothing else is published: the idle thread must keep the stream alive
            idle = [await sub.recv(timeout_s=5.0) for _ in range(3)]
        assert [s.seq for s in idle] == [rec.seq + 1, rec.seq + 2, rec.seq + 3]
        assert all(s.step_record is None and s.step == 8 for s in idle)  # a step is never counted twice
        assert sub.dropped == 0
    finally:
        pub.close()


async def test_malformed_message_and_seq_gaps():
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with EngineStateSubscriber(f"tcp://127.0.0.1:{port}") as sub:
            async def join():  # resend until the subscription is through
                while True:
                    raw.send(encode(snapshot(seq=1, engine_pid=42)))
                    try:
                        return await sub.recv(timeout_s=0.05)
                    except TimeoutError:
                        pass
            await asyncio.wait_for(join(), 10)
            for seq in (2, 5):  # 3 and 4 were lost
                raw.send(encode(snapshot(seq=seq, engine_pid=42)))
                await recv_until(sub, lambda s, seq=seq: s.seq == seq)
            assert sub.dropped == 2
            raw.send(encode(snapshot(seq=1, engine_pid=43)))  # engine restarted: a new pid resets the count
            await recv_until(sub, lambda s: s.engine_pid == 43)
            assert sub.dropped == 2
            raw.send(b'{"type":"snapshot","seq":"x"}')
            with pytest.raises(EngineStateError, match=r"\$\.seq"):
                await sub.recv(timeout_s=5.0)
    finally:
        raw.close(linger=0)


async def test_recv_times_out_without_publisher():
    async with EngineStateSubscriber("tcp://127.0.0.1:1") as sub:
        with pytest.raises(TimeoutError):
            await sub.recv(timeout_s=0.2)


def test_bind_conflict_is_an_error():
    pub = StatePublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(zmq.ZMQError):
            StatePublisher(pub.addr)
    finally:
        pub.close()
