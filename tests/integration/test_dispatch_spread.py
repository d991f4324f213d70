"""Dispatcher replicas under a burst spread keep-path prefills over the prefill nodes and their KV
handoffs over the decode nodes: each folds the jobs routed by every replica since the last view into
its snapshot (kairos.core.cluster.routing.fold_recent), and ties between equally loaded decode nodes
go by the request id's hash (kairos.core.policy.common.least_loaded_decode)."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import get_record, stack

pytestmark = pytest.mark.integration


async def test_simultaneous_long_prompts_are_spread_over_prefill_nodes(nats_url):
    # period 1 s: the whole burst is routed between two views, so only the routed events can spread it
    async with stack(nats_url, policy="pd", dispatchers=2, period_ms=1000.0) as st:
        results = await asyncio.gather(*(st.complete([1] * 8000, max_tokens=2) for _ in range(6)))
        assert all(s == 200 for s, _ in results), results
        nodes = [(await get_record(st, body["id"]))["node"] for _, body in results]
        # without folding every replica sees two empty queues and sends all six to prefill-0
        assert min(nodes.count(n) for n in ("prefill-0", "prefill-1")) >= 2, nodes


async def test_simultaneous_keep_requests_spread_kv_over_decode_nodes(nats_url):
    # 2P4D, three replicas, one view period for the whole burst: each replica folds the keep jobs
    # routed since the last view into the decode nodes they named, and equally loaded decode nodes
    # are told apart per request (a hash of its id), so simultaneous decisions of different
    # replicas spread too (kairos.core.policy.common.least_loaded_decode)
    async with stack(nats_url, policy="pd", prefill=2, decode=4, dispatchers=3, period_ms=1000.0) as st:
        results = await asyncio.gather(*(st.complete([1] * 200, max_tokens=2) for _ in range(8)))
        assert all(s == 200 for s, _ in results), results
        recs = [await get_record(st, body["id"], lambda r: r["records"]["prefill"] is not None
                                 and r["records"]["prefill"]["handoff_node"] is not None) for _, body in results]
        assert all(r["decision"] == "keep" for r in recs), [r["decision"] for r in recs]
        handoffs = [r["records"]["prefill"]["handoff_node"] for r in recs]
        # before: every replica saw four empty decode nodes and sent all eight KVs to decode-0
        assert len(set(handoffs)) >= 3 and max(handoffs.count(n) for n in set(handoffs)) <= 4, handoffs
