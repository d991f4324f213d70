"""Slow is not dead, the aggregator is not needed to detect death, and forged heartbeats do not
remove a node (issue 10, required behaviours 3 and 4)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from kairos.contracts import permissions as P
from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.contracts.wire import NodeState, decode, encode, now_ms
from tests.faults.conftest import Cluster, apoll, check, get_json, request

pytestmark = pytest.mark.faults


def started(c: Cluster, n: int):
    """Predicate: ``n`` requests have had their first token (ingress TTFT histogram count)."""
    return lambda: c.metric("kairos_ingress_ttft_seconds_count") >= n


async def test_agents_paused_0_6_s_keep_their_streams(cluster: Cluster):
    c = cluster
    c.up()
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.create_task(request(http, c.base, max_tokens=120, stream=i % 2 == 0)) for i in range(6)]
        await apoll(started(c, 6), 30, "every request streaming")
        for a in c.agents:
            c.pause(a)
        await asyncio.sleep(0.6)  # the fault: every agent frozen for 0.6 s (> the 0.3 s routing staleness)
        for a in c.agents:
            c.resume(a)
        outcomes = await asyncio.gather(*sends)
    counts = check(outcomes, c, allow_errors=False)
    assert c.metric("kairos_ingress_node_lost_total") == 0
    print("agents paused 0.6 s:", counts)


async def test_aggregator_restart_cuts_no_stream(cluster: Cluster):
    c = cluster
    c.up()
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.create_task(request(http, c.base, max_tokens=150, stream=i % 2 == 0)) for i in range(6)]
        await apoll(started(c, 6), 30, "every request streaming")
        c.kill("state_aggregator")
        c.start("state_aggregator", as_name="state_aggregator-2")
        outcomes = await asyncio.gather(*sends)
        counts = check(outcomes, c, allow_errors=False)
        c.wait_routable()
        after = await asyncio.gather(*[request(http, c.base, max_tokens=8, stream=True) for _ in range(4)])
    check(after, c, allow_errors=False)
    print("aggregator restarted:", counts)


async def test_agent_killed_while_aggregator_down_is_detected(cluster: Cluster):
    """No aggregator, so no view update: the ingress's own heartbeat tracking sees the decode
    agent's death within the liveness timeout (2 s here) — streams already on it continue on the
    other decode node (migrated, issue 33), requests not yet answered are re-submitted: every
    request completes with its exact text."""
    c = cluster
    c.up()
    c.kill("state_aggregator")
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.create_task(request(http, c.base, max_tokens=200, stream=i % 3 != 0)) for i in range(9)]
        await apoll(started(c, 9), 30, "every request producing tokens")
        killed_at = time.monotonic()
        c.kill("decode-0")
        outcomes = await asyncio.gather(*sends)
    counts = check(outcomes, c, allow_errors=False)
    lost = c.metric("kairos_ingress_node_lost_total")
    assert lost >= 1, "no request was on the killed node"
    assert c.metric("kairos_ingress_node_lost_total", '{outcome="failed"}') == 0
    resubmitted = c.metric("kairos_ingress_node_lost_total", '{outcome="resubmitted"}')
    migrated = c.metric("kairos_ingress_node_lost_total", '{outcome="migrated"}')
    counts.update(node_lost=lost, resubmitted=resubmitted, migrated=migrated,
                  last_answer_after_kill_s=round(max(o.ended_at for o in outcomes) - killed_at, 2))
    print("agent killed while the aggregator is down:", counts)


async def test_forged_heartbeats_are_refused_and_counted(cluster: Cluster):
    c = cluster
    c.up()
    # the forger holds decode-0's own credential (without one, nats-server refuses the publish
    # outright); a reader with the aggregator's captures a real heartbeat to replay and tamper with
    reader = await c.connect(P.AGGREGATOR)
    nc = await c.connect(P.agent_user("decode-0"))
    try:
        real = await reader.subscribe(S.state_subject("decode-0"))
        msg = await real.next_msg(timeout=5)
        st = decode(msg.data, NodeState)
        forged = [
            st.__class__(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "seq": 10 ** 12,
                            "sent_unix_ms": now_ms()}),  # same incarnation, huge seq
            st.__class__(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "seq": st.seq + 1,
                            "sent_unix_ms": now_ms() + 3_600_000.0}),  # an hour in the future
            st.__class__(**{**{f: getattr(st, f) for f in st.__struct_fields__}, "seq": 1,
                            "epoch_unix_ms": now_ms() + 3_600_000.0, "sent_unix_ms": now_ms()}),  # future epoch
        ]
        for f in forged:
            await nc.publish(S.state_subject("decode-0"), encode(f))
        await nc.publish(S.state_subject("decode-0"), msg.data)  # a replay of a real heartbeat
        await flush_barrier(nc)
        # for 1.5 s (5 × the staleness limit) decode-0 must stay routable: its real heartbeats count
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            status, body = get_json(c.base + "/health")
            assert status == 200 and "decode-0" in body["routable"]["decode"], body
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
        await reader.close()
    rej = {r: c.metric("kairos_aggregator_heartbeats_rejected_total", f'{{reason="{r}"}}')
           for r in ("seq_jump", "future", "replay")}
    assert rej["seq_jump"] >= 1 and rej["future"] >= 2 and rej["replay"] >= 1, rej
    async with aiohttp.ClientSession() as http:
        outcomes = await asyncio.gather(*[request(http, c.base, max_tokens=8, stream=True) for _ in range(4)])
    check(outcomes, c, allow_errors=False)
    print("forged heartbeats rejected:", rej)


async def test_agent_restart_new_epoch_is_accepted_and_its_lost_requests_are_moved(cluster: Cluster):
    """A restarted agent (same node id, new epoch, seq from 1 again) is accepted at once; the
    requests its previous incarnation held are noticed by the epoch change — with a liveness
    timeout (30 s) far longer than the restart, so silence cannot be what moves them — and every
    request completes (moved to a node, issue 33) well before that timeout."""
    c = cluster
    c.env["KAIROS_LIVENESS_TIMEOUT_S"] = "30"
    c.up()
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.create_task(request(http, c.base, max_tokens=200, stream=i % 3 != 0)) for i in range(9)]
        await apoll(started(c, 9), 30, "every request producing tokens")
        killed_at = time.monotonic()
        c.kill("decode-1")
        c.start("decode-1", as_name="decode-1-restarted")
        outcomes = await asyncio.gather(*sends)
    counts = check(outcomes, c, allow_errors=False)
    assert c.metric("kairos_ingress_node_lost_total") >= 1, "no request was on the restarted node"
    latest = max(o.ended_at for o in outcomes) - killed_at
    assert latest < 20.0, latest  # not the 30 s liveness timeout, nor the 30 s idle timeout
    c.wait_routable(timeout=30)
    assert c.metric("kairos_aggregator_heartbeats_rejected_total", '{reason="old_epoch"}') == 0
    assert c.metric("kairos_aggregator_heartbeats_rejected_total", '{reason="replay"}') == 0
    counts["last_answer_after_kill_s"] = round(latest, 2)
    print("agent restarted:", counts)
