"""Execution claims on a real bus: one bus request id runs on at most one node, whichever
dispatcher sends it where (kairos/services/node_agent/acceptance.py)."""

from __future__ import annotations

import asyncio

import pytest

from kairos.contracts import subjects as S
from kairos.runtime.messaging import request_typed
from kairos.runtime.claims import withdraw
from kairos.contracts.wire import Claim, InferenceRequest, Job, JobAck, decode, now_ms
from tests.integration.conftest import stack, wait_until

pytestmark = pytest.mark.integration


def job(rid: str, node: str, dispatcher: str = "d-x", attempt: int = 0) -> Job:
    req = InferenceRequest(request_id=rid, model="m", prompt_tokens=64, max_tokens=3, created_unix_ms=now_ms(),
                           deadline_unix_ms=now_ms() + 30_000)
    return Job(kind="keep", request=req, node=node, decode_candidates=["decode-0"], dispatcher_id=dispatcher,
               attempt=attempt)


async def test_second_node_refuses_a_claimed_request_and_names_the_first(nats_url):
    async with stack(nats_url, prefill=2, decode=1, dispatchers=0) as st:
        nc = st.ingress.nc
        rid = "claim-test-1"
        sub = await nc.subscribe(S.out_wildcard(rid))
        first = await request_typed(nc, S.jobs_subject("prefill-0"), job(rid, "prefill-0", "d-a"), JobAck, 2)
        assert first.accepted and first.reason == ""
        # the redelivered request, routed by another dispatcher to another node, concurrently twice
        acks = await asyncio.gather(*[request_typed(nc, S.jobs_subject("prefill-1"), job(rid, "prefill-1", "d-b", 1),
                                                    JobAck, 2) for _ in range(2)])
        for a in acks:
            assert not a.accepted and a.reason == "claimed" and a.claim is not None
            assert a.claim.node == "prefill-0" and a.claim.dispatcher_id == "d-a" and a.claim.kind == "keep"
        # re-sent to the node that has it: accepted as a duplicate, not run again
        again = await request_typed(nc, S.jobs_subject("prefill-0"), job(rid, "prefill-0", "d-b", 1), JobAck, 2)
        assert again.accepted and again.reason == "duplicate"
        e = await st.ingress.claims.buckets[0].get(S.claim_key(rid))  # the single server's claim bucket
        assert decode(e.value, Claim).node == "prefill-0"
        # exactly one execution: one done event, and only prefill-0 ever ran it
        events = []
        while not any(b'"done"' in m for m in events):
            events.append((await sub.next_msg(timeout=5)).data)
        assert rid not in st.agents["prefill-1"].reqs
        await wait_until(lambda: rid not in st.agents["prefill-0"].reqs, 5, "prefill-0 handed it off")
        assert sum(b'"done"' in m for m in events) == 1


async def test_concurrent_claims_on_two_nodes_one_wins(nats_url):
    async with stack(nats_url, prefill=2, decode=1, dispatchers=0) as st:
        nc = st.ingress.nc
        for k in range(10):
            rid = f"race-{k}"
            acks = await asyncio.gather(
                request_typed(nc, S.jobs_subject("prefill-0"), job(rid, "prefill-0"), JobAck, 2),
                request_typed(nc, S.jobs_subject("prefill-1"), job(rid, "prefill-1"), JobAck, 2))
            winners = [a for a in acks if a.accepted]
            assert len(winners) == 1, acks
            loser = next(a for a in acks if not a.accepted)
            assert loser.reason == "claimed" and loser.claim.node == winners[0].node


async def test_a_job_that_arrives_after_its_request_was_cancelled_is_refused_and_never_runs(nats_url):
    # the request ended (e.g. the dispatcher gave up on a slow ack and failed it; the ingress
    # cancels it) before the node got the job: the node refuses it instead of running it late
    async with stack(nats_url, prefill=1, decode=1, dispatchers=0) as st:
        nc = st.ingress.nc
        rid = "cancelled-before-its-job"
        await st.ingress.bus.cancel(rid, "no_available_node")
        agent = st.agents["prefill-0"]
        await wait_until(lambda: rid in agent.cancelled, 5, "the agent to hear the cancel")
        ack = await request_typed(nc, S.jobs_subject("prefill-0"), job(rid, "prefill-0"), JobAck, 2)
        assert not ack.accepted and ack.reason == "cancelled"
        assert rid not in agent.reqs
        control = await request_typed(nc, S.jobs_subject("prefill-0"), job("not-cancelled", "prefill-0"), JobAck, 2)
        assert control.accepted  # the refusal is about that request, not the node


async def test_an_attempt_the_ingress_withdrew_is_refused_by_a_node_that_never_heard_its_cancel(nats_url):
    """The ingress answered ``enqueue_failed`` and created the attempt's tombstone
    (kairos/runtime/claims.py); its job then reaches a node before (here: without) the cancel — the order
    nats-py's per-subscription tasks allowed in CI. The node refuses it, and a node's claim made
    first is what ``withdraw`` reports (``ran``) instead of overwriting it."""
    async with stack(nats_url, prefill=1, decode=1, dispatchers=0) as st:
        nc, kv, agent = st.ingress.nc, st.ingress.claims, st.agents["prefill-0"]
        rid = "withdrawn-before-its-job"
        outcome, tomb = await withdraw(kv, rid, "enqueue_failed", now_ms() + 5_000)
        assert outcome == "withdrawn" and tomb is not None and tomb.withdrawn == "enqueue_failed" and not tomb.node
        ack = await request_typed(nc, S.jobs_subject("prefill-0"), job(rid, "prefill-0"), JobAck, 2)
        assert not ack.accepted and ack.reason == "cancelled"
        assert rid not in agent.reqs
        first = await request_typed(nc, S.jobs_subject("prefill-0"), job("ran-first", "prefill-0"), JobAck, 2)
        assert first.accepted
        outcome, held = await withdraw(kv, "ran-first", "enqueue_failed", now_ms() + 5_000)
        assert outcome == "ran" and held is not None and held.node == "prefill-0"

