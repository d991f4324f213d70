"""The simulator's KV-transfer links (kairos/sim/links.py): one FIFO link per (prefill, decode) pair,
one transfer at a time, and the queued work a prefill node's links carry (kairos+'s kv_backlog_ms)."""

from __future__ import annotations

import pytest

from kairos.core.model.latency import LinkModel
from kairos.core.workload.workloads import WorkloadRequest
from kairos.sim.links import KvLinks
from kairos.sim.results import SimRequest

# 1 GB/s and 2 ms setup, 1000 bytes per token: a transfer of t tokens takes 2 + t / 1000 ms
LINK = LinkModel(bandwidth_gb_s=1.0, setup_ms=2.0)


def req(i: int, tokens: int) -> SimRequest:
    r = SimRequest(WorkloadRequest(id=f"r{i}", arrival_s=0.0, prompt_tokens=tokens, output_tokens=1))
    r.transfer_tokens = tokens
    return r


def queued(key: tuple[int, int], *tokens: int) -> tuple[KvLinks, list[SimRequest]]:
    """Links with one request of each size in ``tokens`` queued on ``key``, in that order."""
    links, reqs = KvLinks(LINK, 1000.0), [req(i, n) for i, n in enumerate(tokens)]
    for r in reqs:
        links.enqueue(key, r)
    return links, reqs


def test_a_link_runs_one_transfer_at_a_time_in_fifo_order():
    links, (a, b) = queued((0, 1), 4000, 1000)
    assert links.start((0, 1)) is a
    assert links.start((0, 1)) is None  # busy until its transfer ends
    assert links.transfer_ms(a) == pytest.approx(6.0)
    links.finish((0, 1))
    assert links.start((0, 1)) is b
    links.finish((0, 1))
    assert links.start((0, 1)) is None  # nothing queued


def test_links_of_other_pairs_run_in_parallel():
    links = KvLinks(LINK, 1000.0)
    a, b = req(0, 10), req(1, 10)
    links.enqueue((0, 0), a)
    links.enqueue((0, 1), b)
    assert links.start((0, 0)) is a and links.start((0, 1)) is b


def test_backlog_counts_the_queued_transfers_of_one_prefill_node_only():
    links = KvLinks(LINK, 1000.0)
    for i, (key, tokens) in enumerate([((0, 0), 1000), ((0, 1), 3000), ((1, 0), 5000), ((0, 0), 2000)]):
        links.enqueue(key, req(i, tokens))
    assert links.backlog_ms(0) == pytest.approx((2 + 1) + (2 + 3) + (2 + 2))
    assert links.backlog_ms(1) == pytest.approx(2 + 5)
    links.start((0, 0))  # a started transfer is no longer backlog
    assert links.backlog_ms(0) == pytest.approx((2 + 3) + (2 + 2))


def test_only_a_transfer_that_has_not_started_can_be_unqueued():
    links, (a, b) = queued((0, 0), 10, 10)
    assert links.start((0, 0)) is a
    assert not links.unqueue((0, 0), a)
    assert links.unqueue((0, 0), b) and not links.unqueue((0, 0), b)
    links.finish((0, 0))
    assert links.start((0, 0)) is None
