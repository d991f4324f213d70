"""Rejected heartbeats keep no node alive at the ingress (issue 22, "ingress liveness").

The ingress validates every heartbeat (``kairos.state.<node>``) with its own
:class:`~kairos.core.cluster.heartbeat.HeartbeatGuard` and only an accepted one is a sign of life
(:func:`kairos.core.cluster.heartbeat.accept_heartbeat`). Here, while the decode node streams a request,
heartbeats of an older incarnation and of one an hour ahead are published on its subject: taken
for its own, they would make the ingress think it restarted and end the stream. Then the node is
crashed and, for as long as the stream lasts, its own earlier heartbeats are replayed byte for
byte, with one stamped an hour ahead and one with a forged huge ``seq``. Each names the node its
subject names, so the origin check lets them through to the guard. Counted as life, they would
keep the dead node "alive" and the stream would hang until its idle timeout (30 s); refused, the
ingress declares the node lost after its liveness timeout (1 s) and ends the stream with
``node_lost``.

Real nats-server and the in-process stack (conftest); waits are on conditions with deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import nats
import pytest

from kairos.contracts import subjects as S
from kairos.contracts.wire import NodeState, decode, encode, now_ms
from tests.integration.conftest import stack, wait_until
from tests.integration.test_ingress_robustness import counter, long_decode_stream, read_sse

pytestmark = pytest.mark.integration


async def test_replayed_and_forged_heartbeats_of_a_crashed_node_do_not_keep_it_alive(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", idle_timeout_s=30.0,
                     request_timeout_s=60.0, ingress_overrides={"liveness_timeout_s": 1.0, "max_migrations": 0}) as st:
        forger = await nats.connect(nats_url)
        seen: list[bytes] = []  # decode-0's real heartbeats, as the bus carried them

        async def keep(m) -> None:
            seen.append(m.data)

        sub = await forger.subscribe(S.state_subject("decode-0"), cb=keep)
        async with long_decode_stream(st) as (r, _, _, node):
            assert node == "decode-0"
            await wait_until(lambda: len(seen) >= 3, 5, "three real heartbeats of decode-0")
            # while it lives: an older incarnation's heartbeat and one of an incarnation an hour
            # ahead; counted, either would make the ingress think decode-0 restarted (node_lost)
            epoch = await wait_until(lambda: st.ingress.liveness.epoch(node), 5, "decode-0 heard by the ingress")
            live = decode(seen[-1], NodeState)
            await forger.publish(S.state_subject(node), encode(msgspec.structs.replace(
                live, epoch_unix_ms=epoch - 60_000.0, seq=1, sent_unix_ms=now_ms())))
            await forger.publish(S.state_subject(node), encode(msgspec.structs.replace(
                live, epoch_unix_ms=now_ms() + 3_600_000.0, seq=1, sent_unix_ms=now_ms())))
            await wait_until(lambda: counter(st.ingress.m.hb_rejected.labels("old_epoch")) == 1
                             and counter(st.ingress.m.hb_rejected.labels("future")) == 1, 5, "both refused")
            assert st.ingress.liveness.epoch(node) == epoch
            await st.kill_agent(node)
            await sub.unsubscribe()
            real = [b for b in seen if decode(b, NodeState).epoch_unix_ms == epoch]  # not the two forged above
            last = decode(real[-1], NodeState)
            forged = [
                real[0],  # replay: the oldest real heartbeat, seq long passed
                real[1],
                encode(msgspec.structs.replace(last, sent_unix_ms=now_ms() + 3_600_000.0)),  # future (skew ≤ 5 s)
                encode(msgspec.structs.replace(last, seq=last.seq + 10 ** 9, sent_unix_ms=now_ms())),  # seq_jump
            ]
            rejected0 = {k: counter(st.ingress.m.hb_rejected.labels(k)) for k in ("replay", "future", "seq_jump")}
            stop = asyncio.Event()

            async def forge() -> None:  # every 20 ms, well inside the 1 s liveness timeout
                i = 0
                while not stop.is_set():
                    await forger.publish(S.state_subject(node), forged[i % len(forged)])
                    i += 1
                    await asyncio.sleep(0.02)  # pacing of the attack, not synchronisation

            task = asyncio.create_task(forge())
            t0 = time.monotonic()
            try:
                rest = await asyncio.wait_for(read_sse(r), 10)
            finally:
                elapsed = time.monotonic() - t0
                stop.set()
                await task
        await forger.close()
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "node_lost" and node in err["message"], err
        assert elapsed < 8, elapsed  # liveness timeout 1 s + polling, far from the 30 s idle timeout
        assert counter(st.ingress.m.node_lost.labels("failed")) == 1
        # the forged heartbeats reached the ingress's guard, past the origin check, and were refused
        assert counter(st.ingress.origin.counter.labels("heartbeat")) == 0
        for reason, before in rejected0.items():
            assert counter(st.ingress.m.hb_rejected.labels(reason)) > before, reason
