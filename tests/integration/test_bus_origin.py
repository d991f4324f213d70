"""The attacks of issue 17, part 1, each made with only the credential of decode-0's agent against
a real nats-server running the generated permission table and the whole stack logged in as its
roles (tests/integration/conftest.py ``secure_server`` + ``stack(passwords=...)``).

Each attack must end in a permission violation the server reports to the attacker, or in a
refusal the victim counts (``kairos_<service>_forged_messages_total``, kairos/contracts/origin.py) — and the
victim's state must show that the forged message changed nothing.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgspec

import nats.errors
import nats.js.errors
import pytest
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.contracts.permissions import DISPATCHER, agent_user
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent
from kairos.contracts.wire import (decode, encode, InferenceRequest, Job, KvAck, KvHandoff, NodeState, now_ms,
                                   StepRecordEvent)
from tests.integration.conftest import fast_model, secure_server, stack, wait_until
from tests.integration.test_bus_security import _close, as_role

NODES = ["prefill-0", "decode-0", "decode-1"]
ATTACKER = agent_user("decode-0")


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    with secure_server(tmp_path_factory.mktemp("origin-nats"), NODES) as server:
        yield server


def forged_count(svc, kind: str) -> float:
    """``kairos_<service>_forged_messages_total{kind}`` of a running service."""
    return svc.origin.counter.labels(kind)._value.get()


def heartbeat(node: str, role: str, epoch: float, seq: int = 1) -> NodeState:
    return NodeState(node=node, role=role, seq=seq, sent_unix_ms=now_ms(), epoch_unix_ms=epoch, period_ms=50.0)


async def test_heartbeats_naming_another_node_are_refused_and_counted(secure):
    """decode-0's agent sends, on its own subject, heartbeats naming decode-1 with a newer epoch
    (which made the ingress declare decode-1 restarted and end its streams) and a made-up node
    (which became routable). Nobody takes them for those nodes. Then a heartbeat of decode-0
    itself (``waiting=777``, a new epoch) on the same connection: once it is seen, the forged
    ones before it were processed (one connection's messages reach a subscriber in order)."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw, policy="kairos+") as st:
        epoch1 = await wait_until(lambda: st.ingress.liveness.epoch("decode-1"), 5, "decode-1 heard by the ingress")
        attacker = await as_role(url, pw, ATTACKER)
        forged = [msgspec.structs.replace(heartbeat("decode-1", "decode", now_ms() + 1000.0), waiting=999),
                  heartbeat("ghost-9", "prefill", now_ms())]
        for hb in forged:
            await attacker.nc.publish(S.state_subject("decode-0"), encode(hb))
        control = msgspec.structs.replace(heartbeat("decode-0", "decode", now_ms() + 500.0), waiting=777)
        await attacker.nc.publish(S.state_subject("decode-0"), encode(control))
        await flush_barrier(attacker.nc)

        def views() -> dict:
            return {n.node: n for n in st.aggregator.builder.build(time.monotonic() * 1000.0, now_ms()).nodes}

        await wait_until(lambda: st.ingress.liveness.epoch("decode-0") == control.epoch_unix_ms
                         and views()["decode-0"].waiting == 777, 5, "the control heartbeat")
        assert st.ingress.liveness.epoch("decode-1") == epoch1  # decode-1 did not "restart"
        assert st.ingress.liveness.epoch("ghost-9") is None
        assert "ghost-9" not in views() and views()["decode-1"].waiting != 999
        for svc in (st.aggregator, st.ingress):
            assert forged_count(svc, "heartbeat") == len(forged)
        await wait_until(lambda: forged_count(st.dispatchers[0], "heartbeat") == len(forged), 5, "dispatcher")
        await _close(attacker)


async def test_step_records_naming_another_node_do_not_set_its_correction(secure):
    """Forged step records naming decode-1 (4x its predicted step time) set its correction to 4.0.
    The control batch after them is decode-0's own (3x): once decode-0's correction shows it,
    the forged batch was processed."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw) as st:
        attacker = await as_role(url, pw, ATTACKER)

        def batch(node: str, ratio: float) -> bytes:
            recs = [StepRecordEvent(node=node, role="decode", step=i, started_unix_ms=now_ms(), wall_ms=10.0 * ratio,
                                    predicted_ms=10.0, batch_size=4, kv_tokens=400, prefill_tokens=0)
                    for i in range(200)]
            return b"[" + b",".join(encode(r) for r in recs) + b"]"

        await attacker.nc.publish(S.steps_subject("decode-0"), batch("decode-1", 4.0))
        await attacker.nc.publish(S.steps_subject("decode-0"), batch("decode-0", 3.0))
        await flush_barrier(attacker.nc)

        def bias(node: str) -> float:
            c = st.aggregator.corrector.corrections(time.monotonic() * 1000.0).get(node)
            return c.bias if c is not None else 1.0

        await wait_until(lambda: bias("decode-0") > 2.0, 5, "decode-0's own records")
        assert bias("decode-1") < 2.0  # 4.0 when the forged records were believed
        assert forged_count(st.aggregator, "step_record") == 1
        await _close(attacker)


async def test_an_agent_cannot_create_a_consumer_that_delivers_into_another_roles_subject(secure):
    """The push-consumer trick (deliver_subject = kairos.jobs.prefill-0) in each subject form
    nats-py / nats-server 2.15 accept, a pull request whose reply is that subject, and the other
    victims of the issue (kairos.cancel, kairos.state.decode-0): every one is a publish violation,
    and prefill-0 never sees a job."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw) as st:
        attacker = await as_role(url, pw, ATTACKER)
        bucket = S.RESERVATION_BUCKET  # the one bucket an agent writes: its own reservation keys
        stream = f"KV_{bucket}"
        job = Job(kind="keep", node="prefill-0", request=InferenceRequest(
            request_id="forged-job-1", model="m", prompt_tokens=4, max_tokens=2, created_unix_ms=now_ms(),
            deadline_unix_ms=now_ms() + 60_000))
        own_key = S.reservation_key("decode-0", 0)
        await attacker.nc.publish(f"$KV.{bucket}.{own_key}", encode(job))  # its own key holds the forged job
        for victim in (S.jobs_subject("prefill-0"), S.CANCEL_SUBJECT, S.state_subject("decode-0")):
            cfg = {"deliver_subject": victim, "ack_policy": "none", "deliver_policy": "all"}
            attempts = {
                f"$JS.API.CONSUMER.CREATE.{stream}": {"stream_name": stream, "config": cfg},
                f"$JS.API.CONSUMER.CREATE.{stream}.evil.$KV.{bucket}.>":
                    {"stream_name": stream, "config": {**cfg, "name": "evil", "filter_subject": f"$KV.{bucket}.>"}},
                f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.evil":
                    {"stream_name": stream, "config": {**cfg, "durable_name": "evil"}},
            }
            for subject, body in attempts.items():
                await attacker.nc.publish(subject, json.dumps(body).encode(), reply=attacker.nc.new_inbox())
                await attacker.violation(subject, "publish")
        # a request to route whose answer would go onto prefill-0's job subject: agents send no requests
        await attacker.nc.publish(S.ROUTE_SUBJECT, b"{}", reply=S.jobs_subject("prefill-0"))
        await attacker.violation(S.ROUTE_SUBJECT, "publish")
        # a direct get of its own key answered onto prefill-0's job subject: an agent has no get at all
        get = f"$JS.API.DIRECT.GET.{stream}.$KV.{bucket}.{own_key}"
        await attacker.nc.publish(get, b"", reply=S.jobs_subject("prefill-0"))
        await attacker.violation(get, "publish")
        agent = st.agents["prefill-0"]
        assert "forged-job-1" not in agent.jobs_received and "forged-job-1" not in agent.reqs
        status, body = await st.complete("still served", max_tokens=3)
        assert status == 200, body
        await _close(attacker)


async def test_an_agent_cannot_list_or_read_other_requests_records(secure):
    """Watching kairos_requests showed every request id in the cluster. Now an agent has no
    JetStream API at all: it cannot open the bucket, watch it, list it, or read a record."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw) as st:
        status, body = await st.complete("someone else's request", max_tokens=2)
        assert status == 200, body
        rid = body["id"]
        attacker = await as_role(url, pw, ATTACKER)
        js = attacker.nc.jetstream(timeout=1.0)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):  # not even the bucket's lookup
            await js.key_value(S.REQUESTS_BUCKET)
        await attacker.violation(f"$JS.API.STREAM.INFO.KV_{S.REQUESTS_BUCKET}", "publish")
        kv = KeyValue(name=S.REQUESTS_BUCKET, stream=f"KV_{S.REQUESTS_BUCKET}", pre=f"$KV.{S.REQUESTS_BUCKET}.",
                      js=js, direct=True)  # a handle built by hand, as an attacker would
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await kv.watchall()
        await attacker.violation(f"$JS.API.CONSUMER.CREATE.KV_{S.REQUESTS_BUCKET}", "publish")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await kv.get(S.record_key(rid, "decision"))
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await js.get_msg(f"KV_{S.REQUESTS_BUCKET}", seq=1, next=True,
                             subject=f"$KV.{S.REQUESTS_BUCKET}.>")
        await attacker.violation(f"$JS.API.STREAM.MSG.GET.KV_{S.REQUESTS_BUCKET}", "publish")
        with pytest.raises((nats.errors.TimeoutError, nats.errors.Error)):
            await js.add_stream(name="KV_kairos_capture", subjects=["kairos.jobs.>"])
        await attacker.violation("$JS.API.STREAM.CREATE.KV_kairos_capture", "publish")
        await _close(attacker)



async def test_a_kv_handoff_must_come_from_the_node_it_names(secure):
    """decode-1 accepted a handoff forged by decode-0 naming a prefill node that does not exist.
    Now the subject names the sender (the bus checks it) and the body must name that sender; the
    real keep path still works. (Whether the sender ran the request is the ingress's to judge: it
    relays a decode node's tokens only when the job's prefill node named it, kairos/services/ingress/senders.py.)"""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=1, passwords=pw) as st:
        attacker = await as_role(url, pw, ATTACKER)
        victim = st.agents["decode-1"]
        req = InferenceRequest(request_id="forged-kv-1", model="m", prompt_tokens=8, max_tokens=4,
                               created_unix_ms=now_ms(), deadline_unix_ms=now_ms() + 60_000)
        replies = {}
        for src in ("prefill-9", "prefill-0"):  # made up, another real node
            h = KvHandoff(request=req, src_node=src, kv_tokens=8, prefill_done_unix_ms=now_ms())
            reply = await attacker.nc.request(S.kv_subject("decode-1", ATTACKER), encode(h), timeout=5)
            replies[src] = decode(reply.data, KvAck)
        assert {s: (a.accepted, a.reason) for s, a in replies.items()} == {
            "prefill-9": (False, "forged"), "prefill-0": (False, "forged")}
        assert "forged-kv-1" not in victim.reqs and forged_count(victim, "kv_handoff") == 2
        # posing as prefill-0's agent on the subject: a publish violation
        spoofed = S.kv_subject("decode-1", agent_user("prefill-0"))
        await attacker.nc.publish(spoofed, encode(h), reply=attacker.nc.new_inbox())
        await attacker.violation(spoofed, "publish")
        status, body = await st.complete("the real keep path", max_tokens=4)
        assert status == 200, body
        await _close(attacker)


def held_out_events(st, rid: str) -> int:
    """Out events of ``rid`` the ingress holds because their sender is not accepted (yet)."""
    f = st.ingress.flights.get(rid)
    senders = getattr(f, "senders", None)
    return len(senders.held) if senders is not None else 0


async def _forge_before_routing(secure, forged: list, max_tokens: int = 6):
    """A request that no dispatcher routes yet (the stack starts without one, decode-0 drains so
    that it takes no part: the keep path, prefill-0 then decode-1); decode-0's agent publishes
    ``forged(rid)`` on its own out subject of that request and tries to pose as decode-1 and as a
    dispatcher (publish violations). Once the ingress holds them (or, without the check, has
    ended the request) a dispatcher starts. Returns the client's (status, body) and the ingress."""
    url, pw = secure
    async with stack(url, prefill=1, decode=2, dispatchers=0, passwords=pw, policy="pd") as st:
        st.agents["decode-0"].accepting = False
        await wait_until(lambda: all(not n.accepting for n in st.ingress.view.nodes if n.node == "decode-0"), 5,
                         "decode-0 draining in the view")
        client = asyncio.create_task(st.complete("the victim's request", max_tokens=max_tokens))
        rid = await wait_until(lambda: next(iter(st.ingress.flights), None), 5, "the request in flight")
        attacker = await as_role(url, pw, ATTACKER)
        events = forged(rid)
        for ev in events:
            await attacker.nc.publish(S.out_subject(rid, ATTACKER), encode(ev))
        for sender in (agent_user("decode-1"), DISPATCHER):
            await attacker.nc.publish(S.out_subject(rid, sender), encode(events[0]))
            await attacker.violation(S.out_subject(rid, sender), "publish")
        await flush_barrier(attacker.nc)
        await wait_until(lambda: client.done() or held_out_events(st, rid) == len(events), 5,
                         "the forged events at the ingress")
        d = Dispatcher(DispatcherConfig(replica_id="dispatcher-late", nats_url=url, policy="pd", metrics_port=-1,
                                        nats_user=DISPATCHER, nats_password=pw[DISPATCHER]), model=fast_model())
        await d.start()
        try:
            status, body = await asyncio.wait_for(client, 15)
        finally:
            await d.close()
            await _close(attacker)
        return status, body, st.ingress


async def test_a_forged_error_event_from_another_agent_does_not_fail_the_client(secure):
    """A forged error event on a request's out stream failed other nodes' clients with 503. Now
    the subject names the sender and the ingress accepts the request's events only from the node
    its job went to (prefill-0, then decode-1 which prefill-0 handed the KV to)."""
    def forged(rid: str) -> list:
        return [ErrorEvent(request_id=rid, status=503, code="node_shutdown", message="forged by decode-0",
                           source="node_agent:decode-0", sent_unix_ms=now_ms())]
    status, body, ingress = await _forge_before_routing(secure, forged)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6
    assert forged_count(ingress, "out_event") == 1


async def test_a_forged_first_token_does_not_change_the_text(secure):
    """A forged first token (and end) from decode-0 made the response wrong. Now it is refused and
    counted; the client gets decode-1's tokens only."""
    def forged(rid: str) -> list:
        return [TokenEvent(request_id=rid, first_index=0, count=1, text="FORGED ", node="decode-0",
                           sent_unix_ms=now_ms()),
                DoneEvent(request_id=rid, completion_tokens=1, node="decode-0", sent_unix_ms=now_ms())]
    status, body, ingress = await _forge_before_routing(secure, forged)
    assert status == 200, body
    text = body["choices"][0]["text"]
    assert "FORGED" not in text and body["usage"]["completion_tokens"] == 6, body
    assert forged_count(ingress, "out_event") == 2
