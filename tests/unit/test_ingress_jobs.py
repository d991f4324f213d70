"""The ingress as the one sender of its requests' jobs (kairos/services/ingress/jobrelay.py, issue 34),
with the fake bus and manual clock of tests/unit/test_ingress_relay.py: the test plays the dispatchers
(jobs handed to the ingress on the attempt's conversation subject) and the nodes (their answers, by
:attr:`FakeBus.job_answers`, and their tokens).

What each test pins is one rule of the attempt's arbiter as the ingress applies it: after a node
accepted, no other job goes out (a second dispatcher's copy is told ``cancelled``); a refusal or no
agent lets the next plan go; a node that does not answer may run the job, so the attempt moves under a
new id; one job is out at a time; a job for an attempt the ingress does not follow is never sent.
"""

from __future__ import annotations

import asyncio

import orjson

from kairos.contracts.permissions import agent_user
from kairos.contracts.events import TokenEvent
from kairos.contracts.wire import JOB_CANCELLED, JOB_NO_RESPONDERS, JOB_UNANSWERED, JobAck
from kairos.services.ingress.ports import NoAgent, NodeSilent
from tests.unit.test_ingress_relay import WAIT_S, Msg, post, sse_payloads, stack  # noqa: F401  (the fixture)


async def test_an_accepted_job_makes_its_node_the_sender_and_no_other_job_goes_out(stack):
    """The node's tokens are relayed with no routing event; a second dispatcher's job for another
    node (a copy of the request sent again) is answered cancelled and never sent."""
    st = stack
    answer = post(st, max_tokens=2, stream=True)
    rid = (await st.bus.published()).request_id
    ack = await st.plan(rid, "decode-0")
    assert ack.accepted and st.bus.jobs[0][0] == "decode-0"
    late = await st.plan(rid, "decode-1")
    assert (late.accepted, late.reason) == (False, JOB_CANCELLED)
    assert [n for n, _ in st.bus.jobs] == ["decode-0"]
    await st.tokens(rid, "decode-0", ["a", "b"])
    status, _, body = await asyncio.wait_for(answer, WAIT_S)
    assert status == 200 and "".join(c["choices"][0]["text"] for c in sse_payloads(body)[:-1]) == "ab"
    assert st.ing.m.jobs.labels("accepted")._value.get() == 1 and st.ing.m.jobs.labels("not_sent")._value.get() == 1


async def test_a_refusal_or_no_agent_lets_the_next_job_go(stack):
    st = stack
    answer = post(st, max_tokens=1)
    rid = (await st.bus.published()).request_id
    st.bus.job_answers["prefill-0"] = JobAck(accepted=False, node="prefill-0", reason="draining")
    st.bus.job_answers["prefill-1"] = NoAgent("no responders")
    assert (await st.plan(rid, "prefill-0", "keep")).reason == "draining"
    assert (await st.plan(rid, "prefill-1", "keep")).reason == JOB_NO_RESPONDERS
    del st.bus.job_answers["prefill-1"]  # its agent subscribed again: the same node may be tried again
    assert (await st.plan(rid, "prefill-1", "keep")).accepted
    assert [n for n, _ in st.bus.jobs] == ["prefill-0", "prefill-1", "prefill-1"]
    await st.tokens(rid, "prefill-1", ["x"])
    status, _, _ = await asyncio.wait_for(answer, WAIT_S)
    assert status == 200


async def test_a_node_that_does_not_answer_may_run_the_job_so_the_attempt_moves(stack):
    """The dispatcher is told ``timeout`` (it stops routing), the attempt is cancelled and sent again
    under a new id; the silent node's tokens for the old attempt are never relayed, and a late plan
    for the old attempt is not sent."""
    st = stack
    answer = post(st, max_tokens=1)
    rid = (await st.bus.published()).request_id
    st.bus.job_answers["decode-0"] = NodeSilent("no answer within 1 s")
    assert (await st.plan(rid, "decode-0")).reason == JOB_UNANSWERED
    moved = await st.bus.published()
    assert moved.request_id == f"{rid}-r1" and (rid, "resubmitted") in st.bus.cancels
    assert (await st.plan(rid, "decode-1")).reason == JOB_CANCELLED  # the old attempt: nothing sent
    await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=0, count=1, text="old", node="decode-0",
                                                    sent_unix_ms=st.clock.now_ms()))
    await st.routed(moved.request_id, "decode-1")
    await st.tokens(moved.request_id, "decode-1", ["new"])
    status, _, body = await asyncio.wait_for(answer, WAIT_S)
    assert status == 200 and orjson.loads(body)["choices"][0]["text"] == "new"
    assert [n for n, _ in st.bus.jobs] == ["decode-0", "decode-1"]


async def test_one_job_of_an_attempt_is_out_at_a_time(stack):
    """Two dispatchers plan the same attempt at once: the second is answered cancelled while the
    first's job waits for its node (which then accepts)."""
    st = stack
    post(st, max_tokens=1)
    rid = (await st.bus.published()).request_id
    release = asyncio.Event()
    real_send = st.bus.send_job

    async def slow_send(node, job, headers):
        await release.wait()
        return await real_send(node, job, headers)

    st.bus.send_job = slow_send
    job = orjson.dumps({"v": 2, "kind": "deflect", "request": None, "node": "decode-0"})
    await st.ing.jobs.on_notice(Msg(st.bus.notice_subject(rid), job, reply="_INBOX.dispatcher.first"))  # out now
    second = await st.plan(rid, "decode-1")  # answered at once: a job is out
    assert (second.accepted, second.reason) == (False, JOB_CANCELLED) and st.bus.answered.empty()
    release.set()
    reply, first = await asyncio.wait_for(st.bus.answered.get(), WAIT_S)
    assert reply == "_INBOX.dispatcher.first" and first.accepted
    assert [n for n, _ in st.bus.jobs] == ["decode-0"]


async def test_a_job_for_an_attempt_the_ingress_does_not_follow_is_not_sent(stack):
    st = stack
    ack = await st.plan("cmpl-unknown", "decode-0")
    assert (ack.accepted, ack.reason) == (False, JOB_CANCELLED) and st.bus.jobs == []
    bad = Msg(st.bus.notice_subject("cmpl-unknown"), b'{"kind": "nonsense"}', reply="_INBOX.dispatcher.cmpl-unknown")
    await st.ing.jobs.on_notice(bad)
    _, refused = await asyncio.wait_for(st.bus.answered.get(), WAIT_S)
    assert not refused.accepted and refused.reason.startswith("bad_job") and st.bus.jobs == []


def test_a_plan_gets_the_ingress_s_request_spliced_in_and_decodes_as_the_job():
    """The dispatcher leaves the request out of the job it hands over (job_plan); the ingress splices
    in the bytes it sent (job_with_request): the node decodes the very job the dispatcher built, the
    prompt never re-encoded — a prompt that holds the marker text itself included."""
    from kairos.contracts.wire import InferenceRequest, Job, WireError, decode, encode, job_plan, job_with_request
    import pytest
    req = InferenceRequest(request_id="r-1", model="m", prompt_tokens=3, max_tokens=2, created_unix_ms=0.0,
                           deadline_unix_ms=1e15, prompt_text='say "request":null twice')
    for job in (Job(kind="deflect", request=req, node="decode-0", chunk_schedule=[16, 16], predicted_ttft_ms=3.5),
                Job(kind="keep", request=req, node="prefill-0", decode_candidates=["decode-1"])):
        plan = job_plan(job)
        assert b"say" not in plan and len(plan) < len(encode(job))  # no prompt in the plan
        assert decode(job_with_request(plan, encode(req)), Job) == job
    with pytest.raises(WireError, match="not a job plan"):
        job_with_request(encode(job), encode(req))  # a whole job: its request is there already
