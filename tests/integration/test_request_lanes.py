"""Request lanes on a real nats-server (kairos/runtime/lanes.py): the ingress spreads requests over the
lanes; requests queued on a lane that stops delivering are enqueued again on another and served;
the stranded copies, delivered once the lane is back, meet their execution claims and run nowhere
again. One nats-server carries the tags of two lanes (``kairos-lane:0``, ``kairos-lane:1``), so
both lanes and both claim buckets live on it; lane 1 is stalled by pausing its dispatchers'
consumer (nats-server 2.11+ ``CONSUMER.PAUSE``): it takes requests and delivers none, as a lane
whose consumer cannot deliver does."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter

import nats
import pytest

from kairos.contracts import subjects as S
from tests.integration.conftest import running_nats, stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_lane_url(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("lanes")
    conf = d / "server.conf"
    conf.write_text('server_tags: ["kairos-lane:0", "kairos-lane:1"]\n')
    with running_nats(d / "js", "-c", str(conf)) as port:
        yield f"nats://127.0.0.1:{port}"
    shutil.rmtree(d, ignore_errors=True)


async def pause(url: str, lane: int, until: str | None) -> None:
    """Pause (``until``: RFC 3339) or resume (None) the dispatchers' consumer of ``lane``."""
    nc = await nats.connect(url)
    try:
        body = json.dumps({"pause_until": until} if until else {}).encode()
        r = await nc.request(f"$JS.API.CONSUMER.PAUSE.{S.request_stream(lane)}.{S.DISPATCHER_CONSUMER}", body, timeout=2)
        assert json.loads(r.data).get("paused") is bool(until), r.data
    finally:
        await nc.close()


async def pending(url: str, lane: int) -> tuple[int, int]:
    """(messages not delivered yet, delivered and not acknowledged) on ``lane``'s consumer."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().consumer_info(S.request_stream(lane), S.DISPATCHER_CONSUMER)
        return info.num_pending, info.num_ack_pending
    finally:
        await nc.close()


async def test_requests_on_a_stalled_lane_move_to_another_and_run_once(two_lane_url):
    url = two_lane_url
    async with stack(url, prefill=1, decode=1, dispatchers=1, lanes=2, policy="pd") as st:
        assert st.ingress.lanes.lanes == 2 and len(st.ingress.claims.buckets) == 2
        status, body = await st.complete("warm up", max_tokens=2)
        assert status == 200, body
        await pause(url, 1, "2099-01-01T00:00:00Z")
        results = await asyncio.gather(*(st.complete(f"request {i}", max_tokens=3) for i in range(8)))
        assert all(s == 200 for s, _ in results), results
        moved = st.ingress.m.lane_moves._value.get()
        assert moved >= 1  # every other request went to lane 1, which delivered none of them
        assert (await pending(url, 1))[0] >= moved  # their first copies are still queued there
        # lane 1 back: its stale copies are routed to the node that ran them, meet their claims
        # (this node and incarnation: "duplicate") and are only acknowledged — nothing runs twice
        await pause(url, 1, None)
        deadline = asyncio.get_running_loop().time() + 10
        while await pending(url, 1) != (0, 0):
            assert asyncio.get_running_loop().time() < deadline, await pending(url, 1)
            await asyncio.sleep(0.05)  # polling the server's own count, not a synchronisation guess
        ids = {b["id"] for _, b in results}
        jobs = st.agents["prefill-0"].m.jobs
        assert jobs.labels("prefill-0", "keep", "accepted")._value.get() == len(ids) + 1  # + the warm-up
        assert jobs.labels("prefill-0", "keep", "duplicate")._value.get() >= moved
        received = Counter(r for r in st.agents["prefill-0"].jobs_received if r in ids)
        assert set(received) == ids and sum(received.values()) >= len(ids) + moved
