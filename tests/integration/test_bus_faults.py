"""A job that does not get through because of the bus — not because of the node — is sent again,
the node not excluded (issue 17 part 2: in a NATS cluster failover every such failure excluded a
live node and turned into 503 ``no_available_node``). Real nats-server, real services in-process;
the fault is the node agent's own subscription going away for a moment, as when its server dies
and it reconnects to another member, or its answer to a job never arriving."""

from __future__ import annotations

import asyncio

import pytest

from kairos.services.dispatcher.route import RECONNECT_SETTLE_S
from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from tests.integration.conftest import get_record, stack, wait_until

pytestmark = pytest.mark.integration


def retries(d, why: str) -> float:
    return d.m.bus_retries.labels(why)._value.get()


async def test_a_node_missing_its_job_subscription_for_a_moment_is_retried_not_excluded(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        d, agent = st.dispatchers[0], st.agents["prefill-0"]
        # past the dispatcher's own reconnect window (there "no responders" was always retried)
        await wait_until(lambda: not d._bus.settling(RECONNECT_SETTLE_S), RECONNECT_SETTLE_S + 5, "settled")
        sub = next(s for s in agent._subs if s.subject == S.jobs_subject("prefill-0"))
        await sub.unsubscribe()
        agent._subs.remove(sub)
        await flush_barrier(agent.nc)
        task = asyncio.create_task(st.complete("hello there", max_tokens=4))
        # the dispatcher met "no responders" (or already gave up: the request then ended)
        await wait_until(lambda: task.done() or retries(d, "no_responders") >= 1, 10, "no responders met")
        agent._subs.append(await agent.nc.subscribe(S.jobs_subject("prefill-0"), cb=agent._on_job))
        status, body = await task
        assert status == 200, body
        rec = await get_record(st, body["id"], lambda r: r["decision"] is not None)
        assert rec["routing"]["excluded_nodes"] == {}, rec["routing"]
        assert rec["routing"]["attempts"] >= 2


async def test_a_node_that_does_not_answer_its_job_moves_the_attempt_and_nothing_runs_twice(nats_url):
    """The job reaches the node but its answer never comes (here: the agent drops the first job
    unanswered, as a node frozen or cut off past the ingress's job timeout would): the node may run
    it, so the ingress sends no other job of that attempt — it moves the request to a new attempt
    id (``<id>-r1``), which completes; the first attempt ran nowhere."""
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd") as st:
        agent = st.agents["prefill-0"]
        sub = next(s for s in agent._subs if s.subject == S.jobs_subject("prefill-0"))
        await sub.unsubscribe()
        agent._subs.remove(sub)
        dropped: list[str] = []

        async def drop_the_first(msg) -> None:
            if not dropped:
                dropped.append(msg.data.decode())
                return  # unanswered: the ingress's job timeout runs out
            await agent._on_job(msg)
        agent._subs.append(await agent.nc.subscribe(S.jobs_subject("prefill-0"), cb=drop_the_first))
        await flush_barrier(agent.nc)
        status, body = await st.complete("hello again", max_tokens=4)
        assert status == 200, body
        rid = body["id"]
        assert len(dropped) == 1 and rid in dropped[0]
        assert st.ingress.m.jobs.labels("silent")._value.get() == 1
        assert agent.jobs_received == [f"{rid}-r1"]  # the first attempt never ran here, nor anywhere
        rec = await get_record(st, rid, lambda r: r["records"]["ingress"] is not None)
        assert rec["records"]["ingress"]["resubmitted_as"] == [f"{rid}-r1"], rec["records"]["ingress"]
