"""Two dispatcher replicas under a burst spread keep-path prefills over the prefill nodes: each
folds the jobs routed by every replica since the last view into its snapshot (kairos.core.cluster.routing.fold_recent)."""

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
